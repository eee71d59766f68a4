"""A vLLM server that esftctl started stops when esftctl is killed (esftctl.runtime.launcher).

Without vLLM: a launcher process starts a child as ServePlan starts vLLM (a session of its own, the plan's
environment), the child calls what esftctl's vLLM plugin calls first, and the launcher is killed with SIGKILL,
which it cannot handle. The child must then get SIGTERM; a child that was not started by the pid in the
environment must not. And a server started by an esftctl that ignores SIGINT (a shell script's background command)
must still hear the SIGINT that stops it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from esftctl.runtime.launcher import LAUNCHER_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from esftctl.runtime.launcher import follow_launcher
    signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1] + ".term", "w").write("SIGTERM"), os._exit(0)))
    follow_launcher()
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(60)
""")
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from esftctl.runtime.launcher import LAUNCHER_ENV
    env = {**os.environ, LAUNCHER_ENV: sys.argv[3] or str(os.getpid())}
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env, start_new_session=True)
    time.sleep(60)
""")


def _wait_for(path: Path, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.exists() and path.stat().st_size:
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited


@pytest.mark.parametrize("named", [True, False], ids=["started-by-esftctl", "not-its-child"])
def test_a_killed_launcher_takes_its_server_with_it(tmp_path, named):
    ready = tmp_path / "child.pid"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD, str(ready), "" if named else "1"])
    try:
        assert _wait_for(ready, 30), "the child did not start"
        child = int(ready.read_text())
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert _wait_for(Path(str(ready) + ".term"), 10 if named else 3) == named
        if named:
            end = time.monotonic() + 10
            while _alive(child) and time.monotonic() < end:
                time.sleep(0.05)
            assert not _alive(child)
        else:
            assert _alive(child)
    finally:
        launcher.kill()
        if ready.exists() and ready.read_text():
            try:
                os.kill(int(ready.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_every_plan_names_its_launcher(world, tmp_path):
    from esftctl.serve import plan

    for esft in (True, False):
        env = plan(world.base_dir, [], name="base", esft=esft, port=8000, state_dir=tmp_path).env()
        assert env[LAUNCHER_ENV] == str(os.getpid())


def test_a_server_started_from_a_background_shell_hears_the_sigint_that_stops_it(tmp_path, monkeypatch):
    """A shell script's background command ignores SIGINT and its children inherit that, so vLLM would not hear
    Server.stop's SIGINT (the suite's `sleep` stand-ins waited the 30 s grace, then SIGKILL). Server.start gives the
    child SIGINT's default back while esftctl itself keeps ignoring it."""
    from esftctl.runtime.serve_config import ServeSettings
    from esftctl.serve import ServePlan, Server

    monkeypatch.setattr(ServePlan, "command", lambda self: ["sleep", "60"])
    server = Server(ServePlan(ServeSettings(base=tmp_path, state_dir=tmp_path / "s"), tmp_path, "base"))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server.start()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # esftctl's own disposition is kept
        ignored = int(re.search(r"SigIgn:\t(\w+)", Path(f"/proc/{server.process.pid}/status").read_text())[1], 16)
        assert not ignored & (1 << (signal.SIGINT - 1))
        assert server.stop(grace=5) == -signal.SIGINT  # not -SIGKILL after the grace
    finally:
        signal.signal(signal.SIGINT, previous)
        if server.process is not None and server.process.poll() is None:
            server.process.kill()
