"""Run a server module so that it dies with the process that launched it.

    python -m nemo_rl.environments.parent_watch <launcher pid> <module> [args...]

Asks Linux for SIGTERM when the parent dies (`PR_SET_PDEATHSIG`), checks the parent is still
the launcher (else exits 1 at once), then runs `module` as `__main__`. Why: our Gym servers run
in their own sessions, and a SIGKILLed driver runs no `atexit`. The signal follows the THREAD
that forked the child: start servers from a long-lived thread. Refuses non-Linux hosts
(a `NemoGymError` of kind `platform`) rather than run a server that outlives its driver.
See docs/design-docs/gym-environment.md, "Servers die with their launcher".
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    if not sys.platform.startswith("linux"):
        # Imported here: this wrapper starts every Gym server, and only a refusal needs the config module.
        from nemo_rl.environments.nemo_gym_config import NemoGymError

        raise NemoGymError(f"parent_watch needs Linux prctl(PR_SET_PDEATHSIG); this is {sys.platform}", kind="platform")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {int(sig)}) failed: {os.strerror(err)}")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m nemo_rl.environments.parent_watch <launcher pid> <module> [args...]", file=sys.stderr)
        return 2
    launcher_pid, module = int(argv[0]), argv[1]
    die_with_parent()
    if os.getppid() != launcher_pid:
        print(f"[parent_watch] launcher {launcher_pid} is gone before {module} started; exiting", file=sys.stderr)
        return 1
    sys.argv = [module, *argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
