"""A vLLM server that esftctl started stops when esftctl stops, even when esftctl is killed.

esftctl starts vLLM in a session of its own (so that a Ctrl-C reaches esftctl first, which then stops vLLM in
order). Killed outright (SIGKILL, an out-of-memory kill), esftctl could not stop it, and the server lived on
holding its GPU memory and port. So the process esftctl starts, vLLM's API server, asks Linux for a SIGTERM when
its parent dies (PR_SET_PDEATHSIG), and vLLM shuts its engine down on SIGTERM. esftctl names itself in
LAUNCHER_ENV; vLLM's own processes (engine core, workers) have other parents and are left to vLLM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_ENV = "ESFTCTL_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follow_launcher() -> None:
    """In the process esftctl started (its parent's pid is LAUNCHER_ENV): get SIGTERM when esftctl dies."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if not launcher.isdigit() or os.getppid() != int(launcher) or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not granted: the server lives as it did before
    if os.getppid() != int(launcher):  # esftctl died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
