"""One set of CUDA graphs under ESFT (esftctl.runtime.vllm.graphs), on vLLM's own dispatchers.

The V1 dispatcher is vLLM's real one, keyed as on a GPU (the CPU build turns graphs off, so the test sets the
capture sizes after the config's checks): vLLM's default keeps two sets; `cudagraph_specialize_lora` off keeps
one but sends a batch without adapters to no graph (eager), which is why esftctl does not use it; esftctl's
dispatch keeps one set and replays it for both kinds of batch. The V2 manager needs a distributed set-up to be
built, so its methods are checked for the arguments esftctl's wrappers hand them.
"""

from __future__ import annotations

import functools
import inspect

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture
def restored(monkeypatch):
    """vLLM's dispatchers as they were, after the test (install() changes the classes)."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    changed = {CudagraphDispatcher: ("_get_lora_cases", "dispatch"), CudaGraphManager: ("__init__", "dispatch")}
    for cls, names in changed.items():
        for name in names:
            monkeypatch.setattr(cls, name, cls.__dict__[name])
    return CudagraphDispatcher, CudaGraphManager


def v1_dispatcher(specialize: bool):
    from vllm.config import CompilationConfig, LoRAConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    config = VllmConfig(compilation_config=CompilationConfig(cudagraph_specialize_lora=specialize))
    config.lora_config = LoRAConfig(max_loras=4)
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8]
    config.compilation_config.max_cudagraph_capture_size = 8
    config.scheduler_config.max_num_seqs = 8
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, 1)
    return dispatcher


def graphs_of(dispatcher) -> int:
    return sum(len(keys) for keys in dispatcher.cudagraph_keys.values())


def decode_modes(dispatcher) -> tuple[str, str]:
    """The graph mode a decode batch of 3 runs in, without adapters and with two."""
    return tuple(dispatcher.dispatch(3, uniform_decode=True, has_lora=lora, num_active_loras=n)[0].name
                 for lora, n in ((False, 0), (True, 2)))


def test_vllm_alone_captures_two_sets_or_runs_base_batches_eagerly(restored):
    assert graphs_of(v1_dispatcher(True)) == 16 and decode_modes(v1_dispatcher(True)) == ("FULL", "FULL")
    unspecialized = v1_dispatcher(False)
    assert graphs_of(unspecialized) == 8 and decode_modes(unspecialized) == ("NONE", "FULL")


def test_esftctl_captures_one_set_and_replays_it_for_every_batch(restored):
    from esftctl.runtime.vllm import graphs

    graphs.install()
    graphs.install()  # idempotent
    for specialize in (True, False):
        dispatcher = v1_dispatcher(specialize)
        assert graphs_of(dispatcher) == 8 and decode_modes(dispatcher) == ("FULL", "FULL")
        descriptor = dispatcher.dispatch(3, True, True, 2)[1]  # positional arguments too
        assert not descriptor.has_lora and descriptor.num_active_loras == 0


def test_v2_manager_gets_no_lora_case(restored):
    _, manager = restored
    calls = []

    def recorder(real):
        @functools.wraps(real)
        def record(*args, **kwargs):
            calls.append(dict(inspect.signature(real).bind(*args, **kwargs).arguments))
        return record

    manager.__init__, manager.dispatch = recorder(manager.__init__), recorder(manager.dispatch)
    from esftctl.runtime.vllm import graphs

    graphs.install()
    manager.__init__(object(), None, "cpu", None, 1, lora_capture_cases=[0, 5])
    manager.dispatch(object(), 4, 4, 1, 3)
    assert calls[0]["lora_capture_cases"] == [0] and calls[1]["num_active_loras"] == 0
