"""The engine's status file is rewritten off the serving steps (esftctl.runtime.engine_status.StatusFile): a step
never waits on the disk, the prefill of a prompt that wakes an idle server does not even build the record, and the
file is always whole and, once a write is waited on, the latest record."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from esftctl.runtime import engine_status
from esftctl.runtime.engine_status import StatusFile


def steps(status_file: StatusFile, status_of, *, n: int, apart_s: float) -> None:
    for _ in range(n):
        status_file.tick(status_of)
        time.sleep(apart_s)


def test_a_refresh_waits_for_no_disk_and_skips_the_waking_step(tmp_path, monkeypatch):
    path = tmp_path / "state" / "status.json"
    status_file = StatusFile(path, every_s=0.0, settle_s=0.2)
    built = []

    def status_of():
        built.append(len(built))
        return {"record": len(built)}

    status_file.tick(status_of)  # the first step after a pause: a prompt's prefill
    assert built == [] and not path.exists()

    started, release = threading.Event(), threading.Event()
    real_write = engine_status.write_json

    def slow_disk(target, record, **kwargs):  # a disk busy flushing: the write blocks until released
        started.set()
        release.wait(30)
        real_write(target, record, **kwargs)

    monkeypatch.setattr(engine_status, "write_json", slow_disk)
    steps(status_file, status_of, n=6, apart_s=0.05)  # a stretch longer than settle_s, steps closer than it
    assert built  # the refresh came once the stretch settled, its record built on this (the engine's) thread
    assert started.wait(30) and not path.exists()  # the steps went on while its write waited for the disk
    release.set()
    status_file.write({"record": "after a load"})  # waited on: in order after every refresh before it
    assert json.loads(path.read_text()) == {"record": "after a load"}
    assert sorted(os.listdir(path.parent)) == ["status.json"]  # nothing half-written beside it

    built.clear()
    time.sleep(0.3)  # a pause longer than settle_s: the next step wakes the server again
    status_file.tick(status_of)
    assert built == []


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
        status_file.tick(lambda: {"a": 2})  # serving goes on
        status_file._writer.submit(lambda: None).result()  # the refresh has run
    assert "status.json was not rewritten: [Errno 28] No space left on device" in caplog.text
    assert json.loads((tmp_path / "status.json").read_text()) == {"a": 1}
