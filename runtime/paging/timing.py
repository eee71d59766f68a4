"""How long paged layers take to load and to compute: the residency planner's input (esftctl.runtime.paging.planner)."""

from __future__ import annotations

import time

import torch


class LayerTimes:
    """Milliseconds of paged layers' loads and of their kernels, for the planner's rho = compute / load.

    On CUDA each span is a pair of timing events, read once the second has completed (never waited for);
    on the CPU, where everything runs synchronously, the host clock. Off until a planner turns it on (spans
    pile up until someone takes them)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.enabled = False
        self._open: dict[tuple[str, int], object] = {}
        self._pending: list[tuple[str, object, object]] = []
        self._done: dict[str, list[float]] = {"load": [], "compute": []}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, kind: str, layer: int) -> None:
        if self.enabled:
            self._open[kind, layer] = self._now()

    def stop(self, kind: str, layer: int) -> None:
        start = self._open.pop((kind, layer), None)
        if start is None:
            return
        end = self._now()
        if self.cuda:
            self._pending.append((kind, start, end))
        else:
            self._done[kind].append(1e3 * (end - start))

    def take(self) -> tuple[list[float], list[float]]:
        """The spans finished since the last call: (compute ms, load ms)."""
        waiting = []
        for kind, start, end in self._pending:
            if end.query():
                self._done[kind].append(start.elapsed_time(end))
            else:
                waiting.append((kind, start, end))
        self._pending = waiting
        done, self._done = self._done, {"load": [], "compute": []}
        return done["compute"], done["load"]

