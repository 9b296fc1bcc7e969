"""What the GRPO loop does when a component dies (`token_capture.on_component_failure`).

Owns `build_watch` (every component the run started, on the capture and the legacy path),
`check_abort`, `recover`, `untrainable`, `refit_deaths` and `component_metrics`. Promises: a
death is printed once, at once; in-flight rollouts end as `component_failed` placeholders, so
the step is accounted, never stalled; `abort` raises `ComponentFailedError` after the step's
metrics line; `continue` restarts dead Gym servers and finalizers and masks steps while a worker,
engine core or TransferQueue actor is dead (never restarted under a live run).
Invariant: a refit failure is a death only when a round finds a rollout-path component dead;
with every component alive it propagates unchanged.
See docs/design-docs/token-capture-reliability.md, "What the loop does about a death".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from nemo_rl.data.errors import FatalError
from nemo_rl.data.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason
from nemo_rl.distributed.component_watch import ComponentDeath, ComponentWatch
from nemo_rl.experience.finalizer_pool import FinalizerPool
from nemo_rl.experience.rollout_manager import component_failure_detail
from nemo_rl.token_capture.config import TokenCaptureConfig

if TYPE_CHECKING:  # set-up builds the watch from the stack it started
    from nemo_rl.algorithms.setup import Stack


class ComponentFailedError(FatalError, RuntimeError):
    """A component died and `token_capture.on_component_failure=abort` stops the run."""


def build_watch(
    stack: Stack, pool: FinalizerPool | None, cfg: TokenCaptureConfig, progress: Callable[[str], None]
) -> ComponentWatch:
    def probes():
        found = []
        if stack.env is not None:
            found += stack.env.servers.probes()
        if stack.workers is not None:
            found += stack.workers.probes()
        if stack.data_plane is not None:
            found += stack.data_plane.probes()
        if pool is not None:
            found += pool.probes()
        return found

    def announce(death: ComponentDeath) -> None:
        then = (
            "the run stops at the end of this step (token_capture.on_component_failure=abort)"
            if cfg.on_component_failure == "abort"
            else "rollouts in flight become component_failed placeholders; recovery before the next step "
            "(token_capture.on_component_failure=continue)"
        )
        progress(f"[health] {death.describe()}; {then}")
        if pool is not None and pool.mark_dead(death.name):
            # No item waits on an actor already found dead; the pool replaces it once idle.
            progress(f"[health] {death.name} taken out of rotation; the finalizer pool replaces it")

    return ComponentWatch(probes, interval_s=cfg.component_check_interval_s,
                          probe_timeout_s=cfg.component_probe_timeout_s, on_death=announce)


def unrecoverable(stack: Stack, down: dict[str, str]) -> dict[str, str]:
    """Dead rollout-path components that `recover` cannot restart (all but the Gym servers)."""
    env = stack.env
    return {name: detail for name, detail in down.items() if env is None or env.servers.server_for(name) is None}


async def recover(stack: Stack, watch: ComponentWatch, pool: FinalizerPool | None,
                  progress: Callable[[str], None]) -> int:
    """Restart dead Gym servers, retire dead finalizer actors; returns how many servers restarted."""
    await watch.poll()
    restarted = 0
    for name in sorted(watch.dead()):
        server = stack.env.servers.server_for(name) if stack.env is not None else None
        if server is not None:
            seconds = await stack.env.servers.restart(server)
            watch.recovered(name)
            restarted += 1
            progress(f"[health] restarted {name} (Gym server {server}) on its port in {seconds:.1f}s")
        elif pool is not None and pool.mark_dead(name):
            watch.recovered(name)
            progress(f"[health] {name} taken out of rotation; the finalizer pool replaces it")
    return restarted


def untrainable(groups: Sequence[GroupResult], down: dict[str, str]) -> list[GroupResult]:
    """Every kept rollout as a `component_failed` placeholder naming `down` (empty `down`: unchanged)."""
    if not down:
        return list(groups)
    detail = f"step not trained: {component_failure_detail(down)}"
    masked = []
    for group in groups:
        entries = [
            Placeholder(e.rollout_id, e.group_index, e.sample_index, PlaceholderReason.COMPONENT_FAILED, detail,
                        e.reward, e.terminal_selection) if isinstance(e, KeptRollout) else e
            for e in group.entries
        ]
        masked.append(GroupResult(group.group_index, tuple(entries)))
    return masked


def step_deaths(watch: ComponentWatch, pool: FinalizerPool | None, progress: Callable[[str], None]) -> dict[str, str]:
    """Every component found dead during the step (watch and finalizer pool): name -> description.

    A finalizer actor the pool found dead by a failed call (before the watch's next round) is
    announced here: the pool has already replaced it.
    """
    deaths = {d.name: d.detail for d in watch.take_deaths()}
    if pool is not None:
        for name, detail in pool.take_deaths().items():
            if name not in deaths:
                deaths[name] = detail
                progress(f"[health] {name} died: {detail}; the finalizer pool replaced it")
    return deaths


def component_metrics(deaths: dict[str, str], down: dict[str, str], restarts: int, replaced: int) -> dict[str, float]:
    return {
        "component/deaths": float(len(deaths)),
        "component/down": float(len(down)),
        "component/restarts": float(restarts),
        "finalize/replaced_workers": float(replaced),
    }


async def refit_deaths(watch: ComponentWatch | None) -> dict[str, str]:
    """After a failed refit: one liveness round now; the rollout-path components dead (name -> how)."""
    if watch is None:
        return {}
    await watch.poll()
    return watch.down()


def refit_failure_error(down: dict[str, str], step: int) -> ComponentFailedError:
    """The named failure of a refit whose workers (or their engine cores) were found dead."""
    return ComponentFailedError(
        f"step {step}: refit failed: {component_failure_detail(down)}. The step was trained, the engines were "
        "not refit; token_capture.on_component_failure=abort stops the run (resume from the last checkpoint)"
    )


def check_abort(policy: str, deaths: dict[str, str], step: int) -> None:
    """With `abort`, raise ComponentFailedError naming every component that died in the step."""
    if policy != "abort" or not deaths:
        return
    named = "; ".join(f"{name} died: {detail}" for name, detail in sorted(deaths.items()))
    raise ComponentFailedError(
        f"step {step}: {named}. The step was accounted and logged (component_failed placeholders) and "
        "nothing of it was trained; token_capture.on_component_failure=abort stops the run (set it to "
        "continue to restart Gym servers / replace finalizers and keep going)"
    )
