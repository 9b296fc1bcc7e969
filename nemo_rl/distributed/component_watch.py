"""Liveness of a run's components, checked on a cadence while a step runs: deaths are named.

A component that dies mid-step must never become a silent stall or a pile of anonymous
placeholders after a long deadline: this module says, within about one check interval, which
component died and how. Owns `Component` names, `Probe`s (Ray actors, our processes, an actor's
own children such as vLLM's engine core) and `ComponentWatch` (`poll`, `watching`, `down`,
`rollout_path_down`, `take_deaths`). Invariants: a probe that does not answer in time counts as
alive (busy is not dead); each death is recorded once; only `ROLLOUT_PATH` deaths end rollouts
in flight; probes are re-read every round, so a replacement is watched as it is now.
See docs/design-docs/distributed.md, "Liveness of a run's components".
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_rl.distributed.actor_call import first_line


class Role(str, enum.Enum):
    ROLLOUT_PATH = "rollout_path"
    OFF_PATH = "off_path"


class ComponentKind(str, enum.Enum):
    """What a watched component is; its name (`Component.name`) says which one."""

    GYM_SERVER = "gym_server"  # the gate ("gate") or another Gym server, by its server name
    VLLM_WORKER = "vllm_worker"  # `vllm_worker_<i>`, and `vllm_worker_<i>/engine_core[_<j>]`
    TQ_CONTROLLER = "tq_controller"
    TQ_STORAGE_UNIT = "tq_storage_unit"  # `tq_storage_unit_<i>`
    FINALIZER = "finalizer"  # `finalizer_<i>`, `finalizer_<i>_r<g>` after g replacements


ENGINE_CORE = "engine_core"
_VLLM_WORKER = re.compile(r"vllm_worker_(\d+)(?:/(engine_core(?:_\d+)?))?")
_TQ_STORAGE_UNIT = re.compile(r"tq_storage_unit_(\d+)")
_FINALIZER = re.compile(r"finalizer_(\d+)(?:_r(\d+))?")


@dataclass(frozen=True)
class Component:
    """One watched component: its kind, its index among its kind, and what part of it.

    `name` is the string metrics, logs and run_info.json `components` carry; `parse(name)` is its
    inverse (a name of no other kind is a Gym server's). `part` is a process the component
    started itself (a vLLM worker's `engine_core`, `engine_core_<j>` when it runs several);
    `generation` counts replacements (finalizer actors); `server` names a Gym server.
    """

    kind: ComponentKind
    index: int | None = None
    part: str | None = None
    generation: int = 0
    server: str | None = None

    def __post_init__(self) -> None:
        indexed = self.kind in (ComponentKind.VLLM_WORKER, ComponentKind.TQ_STORAGE_UNIT, ComponentKind.FINALIZER)
        if indexed != (self.index is not None) or (self.index is not None and self.index < 0):
            raise ValueError(f"{self.kind.value} takes {'an index >= 0' if indexed else 'no index'}, got {self.index}")
        if (self.kind is ComponentKind.GYM_SERVER) != bool(self.server):
            raise ValueError(f"only a Gym server has a server name, got {self.kind.value} with server={self.server!r}")
        if self.part is not None and (self.kind is not ComponentKind.VLLM_WORKER or not self.part.startswith(ENGINE_CORE)):
            raise ValueError(f"part={self.part!r}: only a vLLM worker has a part ({ENGINE_CORE}[_<j>])")
        if self.generation < 0 or (self.generation and self.kind is not ComponentKind.FINALIZER):
            raise ValueError(f"generation={self.generation}: only a finalizer actor is replaced")

    @classmethod
    def engine_core(cls, worker: int, index: int = 0, count: int = 1) -> "Component":
        """Worker `worker`'s engine core (numbered only when the worker runs several)."""
        return cls(ComponentKind.VLLM_WORKER, worker, ENGINE_CORE + (f"_{index}" if count > 1 else ""))

    @property
    def name(self) -> str:
        kind = self.kind
        if kind is ComponentKind.GYM_SERVER:
            assert self.server is not None
            return self.server
        if kind is ComponentKind.TQ_CONTROLLER:
            return kind.value
        base = f"{kind.value}_{self.index}"
        if kind is ComponentKind.FINALIZER and self.generation:
            return f"{base}_r{self.generation}"
        return base if self.part is None else f"{base}/{self.part}"

    @classmethod
    def parse(cls, name: str) -> "Component":
        if name == ComponentKind.TQ_CONTROLLER.value:
            return cls(ComponentKind.TQ_CONTROLLER)
        if match := _VLLM_WORKER.fullmatch(name):
            return cls(ComponentKind.VLLM_WORKER, int(match[1]), match[2])
        if match := _TQ_STORAGE_UNIT.fullmatch(name):
            return cls(ComponentKind.TQ_STORAGE_UNIT, int(match[1]))
        if match := _FINALIZER.fullmatch(name):
            return cls(ComponentKind.FINALIZER, int(match[1]), generation=int(match[2] or 0))
        if not name:
            raise ValueError("a component needs a name")
        return cls(ComponentKind.GYM_SERVER, server=name)


# The TransferQueue actors: while one is down the data plane cannot list or clear its keys.
DATA_PLANE_KINDS = (ComponentKind.TQ_CONTROLLER, ComponentKind.TQ_STORAGE_UNIT)


def any_down(names: Iterable[str], *kinds: ComponentKind) -> bool:
    """Whether any of the components `names` (a watch's `down()`) is of one of `kinds`."""
    return any(Component.parse(name).kind in kinds for name in names)


@dataclass(frozen=True)
class Probe:
    name: str
    role: Role
    check: Callable[[], Awaitable[str | None]]


@dataclass(frozen=True)
class ComponentDeath:
    name: str
    role: Role
    detail: str
    detected_at_s: float  # time.monotonic() of the round that found it

    def describe(self) -> str:
        return f"{self.name} died: {self.detail}"


def exit_description(code: int) -> str:
    """`Popen.returncode` as words: "killed by SIGKILL" for -9, "exited with code 3" for 3."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class ChildProcess:
    """A process a component started itself, as that component sees it (it is the parent)."""

    name: str
    pid: int
    exitcode: int | None  # None while it runs

    def __post_init__(self) -> None:
        if not self.name or self.pid <= 0:
            raise ValueError(f"a child process needs a name and a pid > 0, got name={self.name!r} pid={self.pid}")

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "exitcode": self.exitcode}

    @classmethod
    def from_wire(cls, record: dict[str, Any]) -> "ChildProcess":
        return cls(str(record["name"]), int(record["pid"]), None if record["exitcode"] is None else int(record["exitcode"]))


def children_verdict(what: str, children: Sequence[ChildProcess]) -> str | None:
    """None while every child runs, else one line naming each dead one and how it ended."""
    dead = [c for c in children if c.exitcode is not None]
    if not dead:
        return None
    return "; ".join(f"{what} {c.name} (pid {c.pid}) {exit_description(c.exitcode)}" for c in dead)


def process_probe(name: str, role: Role, proc: subprocess.Popen, what: str) -> Probe:
    """A probe of a child process we started: dead once it has an exit code."""

    async def check() -> str | None:
        code = proc.poll()
        return None if code is None else f"{what} (pid {proc.pid}) {exit_description(code)}"

    return Probe(name, role, check)


def ray_actor_probe(name: str, role: Role, handle: Any, what: str) -> Probe:
    """A probe of a Ray actor: dead when a trivial call raises RayActorError."""
    import ray

    async def check() -> str | None:
        try:
            await handle.__ray_ready__.remote()
        except ray.exceptions.RayActorError as e:
            return f"{what} (Ray actor) is gone: {first_line(e)}"
        return None

    return Probe(name, role, check)


def actor_children_probe(
    name: str, role: Role, report: Callable[[], Awaitable[list[dict[str, Any]]]], what: str
) -> Probe:
    """A probe of processes a Ray actor started: `report()` is the actor's call returning its
    children as `ChildProcess.to_wire` dicts. A gone actor is left to its own probe (None here)."""
    import ray

    async def check() -> str | None:
        try:
            records = await report()
        except ray.exceptions.RayActorError:
            return None  # the actor's own probe names its death; its children went with it
        return children_verdict(what, [ChildProcess.from_wire(r) for r in records])

    return Probe(name, role, check)


class ComponentWatch:
    def __init__(
        self,
        probes: Callable[[], Sequence[Probe]],
        *,
        interval_s: float,
        probe_timeout_s: float,
        on_death: Callable[[ComponentDeath], None] = lambda death: None,
    ) -> None:
        if interval_s <= 0 or probe_timeout_s <= 0:
            raise ValueError(f"interval_s={interval_s} and probe_timeout_s={probe_timeout_s} must be > 0")
        self._probes = probes
        self._interval_s = interval_s
        self._probe_timeout_s = probe_timeout_s
        self._on_death = on_death
        self._dead: dict[str, ComponentDeath] = {}
        self._new: list[ComponentDeath] = []
        self._event: asyncio.Event | None = None

    @property
    def rollout_path_down(self) -> asyncio.Event:
        """Set while a rollout-path component is dead (created on first use, in the running loop)."""
        if self._event is None:
            self._event = asyncio.Event()
            if self.down():
                self._event.set()
        return self._event

    def down(self) -> dict[str, str]:
        """Rollout-path components dead now: name -> description."""
        return {name: d.detail for name, d in self._dead.items() if d.role is Role.ROLLOUT_PATH}

    def dead(self) -> dict[str, ComponentDeath]:
        return dict(self._dead)

    def take_deaths(self) -> list[ComponentDeath]:
        deaths, self._new = self._new, []
        return deaths

    def recovered(self, name: str) -> None:
        self._dead.pop(name, None)
        if self._event is not None and not self.down():
            self._event.clear()

    async def _check(self, probe: Probe) -> str | None:
        try:
            return await asyncio.wait_for(probe.check(), self._probe_timeout_s)
        except asyncio.TimeoutError:
            return None  # busy, not dead: every call into it carries its own deadline

    async def poll(self) -> list[ComponentDeath]:
        """One round over every probe; returns the components newly found dead."""
        probes = [p for p in self._probes() if p.name not in self._dead]
        verdicts = await asyncio.gather(*(self._check(p) for p in probes))
        now = time.monotonic()
        found = []
        for probe, verdict in zip(probes, verdicts):
            if verdict is None:
                continue
            death = ComponentDeath(probe.name, probe.role, verdict, now)
            self._dead[probe.name] = death
            self._new.append(death)
            found.append(death)
            self._on_death(death)
        if self.down():
            self.rollout_path_down.set()
        return found

    async def _loop(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self._interval_s)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        task = asyncio.ensure_future(self._loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
