"""Run a server module so that it dies with the process that launched it.

    python -m nemo_rl.environments.parent_watch <launcher pid> <module> [args...]

Contract:
- Before importing `module`, asks Linux to send this process SIGTERM when its parent dies
  (`prctl(PR_SET_PDEATHSIG)`), then checks that the parent is still `<launcher pid>`: if the
  launcher died in between (the signal would never come), it exits with status 1 at once.
  Then runs `module` as `__main__` (as `python -m module` would), with `sys.argv[1:]` = args.
- Why: the Gym servers run in their own sessions (so a stop can signal their whole group), which
  also shields them from the terminal's signals; a SIGKILLed driver (pre-emption, OOM killer)
  runs no `atexit`, and without this they would keep serving, and holding ports, for ever.
- Linux sends the signal when the THREAD that forked the child exits, not only the process:
  start servers from a thread that lives as long as they should (the event loop's), never from
  a short-lived worker thread (`asyncio.to_thread`).
- Only Linux has PR_SET_PDEATHSIG: elsewhere this raises `ParentWatchUnsupported` rather than
  run a server that silently outlives its driver.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


class ParentWatchUnsupported(RuntimeError):
    """This OS cannot tie a child's life to its parent's (no prctl PR_SET_PDEATHSIG)."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    if not sys.platform.startswith("linux"):
        raise ParentWatchUnsupported(f"parent_watch needs Linux prctl(PR_SET_PDEATHSIG); this is {sys.platform}")
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
