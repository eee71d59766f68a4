"""The engine's status file is rewritten off the serving steps (esftctl.runtime.engine_status.StatusFile): a step
never waits on the disk, the prefill of a prompt that wakes an idle server and the steps just after it do not even
build the record, slow steps (vLLM's CPU build) still refresh it, and the file is always whole and, once a write is
waited on, the latest record."""

from __future__ import annotations

import json
import logging
import os
import threading
from types import SimpleNamespace

from esftctl.runtime import engine_status
from esftctl.runtime.engine_status import StatusFile


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_refresh_comes_in_a_settled_stretch_of_steps_never_on_a_waking_prompt(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(engine_status, "time", SimpleNamespace(monotonic=clock.monotonic))
    status_file = StatusFile(tmp_path / "status.json", every_s=1.0, settle_s=0.1)
    built = []

    def step(after_s: float, *, prefill: bool) -> None:
        clock.now += after_s
        status_file.tick(lambda: built.append(clock.now) or {"at": clock.now}, prefill=prefill)
        status_file._writer.submit(lambda: None).result()  # the refresh, if any, is in the file

    step(0.0, prefill=True)  # a prompt wakes the server: its prefill
    step(0.005, prefill=False)  # its first decode steps, while its first token may still be on the way
    step(0.005, prefill=False)
    assert built == [] and not (tmp_path / "status.json").exists()
    step(0.1, prefill=False)  # the stretch is 0.11 s old: the refresh, due since the start
    assert built == [clock.now]
    for _ in range(5):
        step(0.01, prefill=False)
    step(0.5, prefill=True)  # another prompt, beside the decodes: the stretch goes on
    assert len(built) == 1
    step(0.6, prefill=False)  # a second later, a refresh again
    assert len(built) == 2 and json.loads((tmp_path / "status.json").read_text()) == {"at": clock.now}

    step(5.0, prefill=True)  # after a pause: due, but this step prefills the prompt that woke the server
    step(0.05, prefill=False)
    assert len(built) == 2
    step(0.06, prefill=False)
    assert len(built) == 3

    for _ in range(6):  # vLLM's CPU build: every step slower than settle_s, decode steps included
        step(0.4, prefill=False)
    assert len(built) == 5  # every second, as before


def test_a_refresh_waits_for_no_disk_and_a_waited_write_lands_in_order(tmp_path, monkeypatch):
    path = tmp_path / "state" / "status.json"
    status_file = StatusFile(path, every_s=0.0, settle_s=0.0)
    started, release = threading.Event(), threading.Event()
    real_write = engine_status.write_json

    def slow_disk(target, record, **kwargs):  # a disk busy flushing: the write blocks until released
        started.set()
        release.wait(30)
        real_write(target, record, **kwargs)

    monkeypatch.setattr(engine_status, "write_json", slow_disk)
    status_file.tick(lambda: {"record": "refresh"}, prefill=False)
    assert started.wait(30) and not path.exists()  # the step went on while its write waited for the disk
    release.set()
    status_file.write({"record": "after a load"})  # waited on: in order after every refresh before it
    assert json.loads(path.read_text()) == {"record": "after a load"}
    assert sorted(os.listdir(path.parent)) == ["status.json"]  # nothing half-written beside it


def test_status_files_are_not_fsynced_and_a_failed_refresh_is_logged(tmp_path, monkeypatch, caplog):
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    status_file = StatusFile(tmp_path / "status.json", every_s=0.0, settle_s=0.0)
    status_file.write({"a": 1})
    assert synced == [] and json.loads((tmp_path / "status.json").read_text()) == {"a": 1}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine_status, "write_json", full_disk)
    with caplog.at_level(logging.WARNING, logger=engine_status.__name__):
        status_file.tick(lambda: {"a": 2}, prefill=False)  # serving goes on
        status_file._writer.submit(lambda: None).result()  # the refresh has run
    assert "status.json was not rewritten: [Errno 28] No space left on device" in caplog.text
    assert json.loads((tmp_path / "status.json").read_text()) == {"a": 1}
