"""A private, single-node Ray cluster owned by this driver process.

Contract:
- `init_local_ray(num_cpus, temp_dir=None)` starts a NEW local Ray instance (`address="local"`;
  it never joins a cluster another process started) with its own temp dir, `RAY_TMPDIR` set to
  that dir in this process, no dashboard, and a job `runtime_env` whose `env_vars` put the repo
  root first on `PYTHONPATH`, so every actor of the job (including actors that run in another
  venv) can import `nemo_rl`.
- `RayClusterHandle.shutdown()` stops only that instance (`ray.shutdown()` in the process that
  started it), restores the previous `RAY_TMPDIR`, and removes the temp dir when
  `init_local_ray` created it. It is idempotent. It never runs `ray stop` (which would kill
  every Ray on the host).
- Ray keeps Unix-domain sockets under the temp dir and `AF_UNIX` paths are limited to 107
  bytes, so the temp dir must be short: a dir longer than `MAX_TEMP_DIR_CHARS` is rejected
  up front rather than failing later inside Ray with an opaque socket error.
- Starting while Ray is already initialized in this process is an error (`RayClusterError`):
  silently reusing someone else's cluster would break the "private cluster" invariant.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import ray

# Ray appends "session_<date>_<time>_<usec>_<pid>/sockets/plasma_store" (~70 chars) to the
# temp dir, and the whole socket path must fit the 107-byte AF_UNIX limit.
MAX_TEMP_DIR_CHARS = 36
_TEMP_DIR_PREFIX = "nrl-ray-"


class RayClusterError(RuntimeError):
    """The private Ray cluster could not be started or stopped as requested."""


def repo_root() -> Path:
    """The directory that contains the `nemo_rl` package (what actors need on PYTHONPATH)."""
    return Path(__file__).resolve().parents[2]


def job_runtime_env(root: Path, inherited_pythonpath: str | None) -> dict:
    """The job-level runtime_env: the repo root first on PYTHONPATH, then what was inherited."""
    parts = [str(root)]
    if inherited_pythonpath:
        parts.extend(p for p in inherited_pythonpath.split(os.pathsep) if p and p != str(root))
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(parts)}}


def check_temp_dir(temp_dir: str) -> None:
    """Reject a temp dir that is relative or too long for Ray's Unix-socket paths."""
    if not os.path.isabs(temp_dir):
        raise RayClusterError(f"temp_dir must be an absolute path, got {temp_dir!r}")
    if len(temp_dir) > MAX_TEMP_DIR_CHARS:
        raise RayClusterError(
            f"temp_dir {temp_dir!r} is {len(temp_dir)} chars; Ray socket paths under it would exceed "
            f"the AF_UNIX limit. Use a dir of at most {MAX_TEMP_DIR_CHARS} chars (e.g. under the "
            f"system temp dir with a short name), or set TMPDIR to a short path."
        )


@dataclass
class RayClusterHandle:
    """The Ray instance started by `init_local_ray` in this process."""

    temp_dir: str
    num_cpus: int
    gcs_address: str
    owns_temp_dir: bool
    previous_ray_tmpdir: str | None
    _stopped: bool = field(default=False, repr=False)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def shutdown(self) -> None:
        """Stop this cluster (only this one); safe to call more than once."""
        if self._stopped:
            return
        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if current != self.gcs_address:
                raise RayClusterError(
                    f"this process is now connected to Ray at {current}, not the cluster this handle "
                    f"started ({self.gcs_address}); refusing to shut down a cluster it does not own"
                )
            ray.shutdown()
        if self.previous_ray_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self.previous_ray_tmpdir
        if self.owns_temp_dir:
            shutil.rmtree(self.temp_dir)
        self._stopped = True


# Ray gives a new node a hard-coded 30 s to register with its GCS; on a loaded 2-core host that
# startup race is lost now and then although nothing is wrong. It is retried, loudly, this often.
NODE_STARTUP_ATTEMPTS = 3
_NODE_STARTUP_TIMEOUT = "timed out during startup"


def _init_with_retry(num_cpus: int, temp_dir: str):
    for attempt in range(1, NODE_STARTUP_ATTEMPTS + 1):
        try:
            return ray.init(
                address="local",
                num_cpus=num_cpus,
                _temp_dir=temp_dir,
                include_dashboard=False,
                runtime_env=job_runtime_env(repo_root(), os.environ.get("PYTHONPATH")),
            )
        except Exception as e:  # Ray raises a bare Exception for this race; anything else re-raises
            if _NODE_STARTUP_TIMEOUT not in str(e) or attempt == NODE_STARTUP_ATTEMPTS:
                raise
            print(f"[ray] node startup timed out (attempt {attempt}/{NODE_STARTUP_ATTEMPTS}); retrying", flush=True)
            ray.shutdown()
    raise AssertionError("unreachable")


def init_local_ray(num_cpus: int, temp_dir: str | None = None) -> RayClusterHandle:
    """Start a private local Ray instance with `num_cpus` logical CPUs.

    `temp_dir=None` creates a fresh short dir in the system temp dir (removed on shutdown);
    a given `temp_dir` is created if needed and left in place on shutdown.
    """
    if type(num_cpus) is not int or num_cpus < 1:
        raise RayClusterError(f"num_cpus must be an int >= 1, got {num_cpus!r}")
    if ray.is_initialized():
        raise RayClusterError(
            "Ray is already initialized in this process; shut it down (RayClusterHandle.shutdown) "
            "before starting a private cluster"
        )
    owns_temp_dir = temp_dir is None
    if temp_dir is None:
        temp_dir = tempfile.mkdtemp(prefix=_TEMP_DIR_PREFIX)
    check_temp_dir(temp_dir)
    os.makedirs(temp_dir, exist_ok=True)
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir
    try:
        context = _init_with_retry(num_cpus, temp_dir)
    except Exception as e:
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        if owns_temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise RayClusterError(f"could not start a local Ray instance in {temp_dir!r}: {e}") from e
    return RayClusterHandle(
        temp_dir=temp_dir,
        num_cpus=num_cpus,
        gcs_address=context.address_info["gcs_address"],
        owns_temp_dir=owns_temp_dir,
        previous_ray_tmpdir=previous,
    )
