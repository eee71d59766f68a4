"""The engine's status write as it was before 2026-11-27's fourteenth session, for ttft_alone.py's A/B: put on a
server's PYTHONPATH, every process of it starts with `StatusFile.tick` doing what the worker's step did then. The
first step more than a second after the last write built the record and wrote it there and then, fsynced
(esftctl.jsonfile.write_json's default), before the forward: after any pause, the step that prefilled the prompt
that woke the server. Then the sitecustomize this one shadows runs, if there is one."""

import importlib.util
import sys
import time
from pathlib import Path


def _step_write(self, status_of, *, prefill: bool = False) -> None:  # the old rule: prefill or not
    from esftctl.jsonfile import write_json

    now = time.monotonic()
    if now - self.written > self.every_s:
        self.written = now
        if self.path is not None:
            record = status_of()
            record.extra["status_write"] = "in the step"  # ttft_alone.py checks that the engine ran this
            write_json(self.path, record.to_json())


try:
    from esftctl.runtime import engine_status

    engine_status.StatusFile.tick = _step_write
except ImportError:  # a process without esftctl (none of the server's)
    pass

here = Path(__file__).resolve().parent
for entry in sys.path:
    other = Path(entry or ".").resolve() / "sitecustomize.py"
    if other.parent != here and other.is_file():
        spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", other)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        break
