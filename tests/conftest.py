"""Shared fixtures: small models of every architecture, and the tiny world (built once, cached)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def has_gpu() -> bool:
    return torch.cuda.is_available()


def has_vllm() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    except Exception:
        return False


# The quick subset (`bash tests/run.sh -m quick`, under 3 minutes on 2 cores): every test that needs neither vLLM's
# engine (`vllm`), a GPU (`gpu`), nor the tiny world (the `world` fixture, directly or through another fixture), less
# the files and tests below, each measured at more than 2 s on a 2-core machine (`--durations`). The whole suite,
# `bash tests/run.sh`, still runs every test.
NOT_QUICK_FILES = {
    "test_bench_offline.py",  # every offline command in a child process: 20 s
    "test_project_packaging.py",  # builds the wheel: 13 s
    "test_formats_quantized.py",  # inspect in a child per quantization method: 8 s
}
NOT_QUICK_TESTS = {  # file: test functions (every parametrization), each one's seconds as measured
    "test_bench_esft.py": {"test_cli_refuses_bad_options_in_one_line"},  # 9.5
    "test_bench_serve_slices.py": {"test_report_only_from_the_command_line",  # 4.6
                                   "test_the_cards_of_a_host_each_take_their_own_rounds"},  # 2.8
    "test_bench_traffic.py": {"test_gamma_arrivals_through_vllms_generator_have_the_asked_cv"},  # 3.2
    "test_formats_checkpoint.py": {"test_fuzz_checkpoint_configs",  # 10
                                   "test_ctrl_c_while_reading_is_an_interrupt"},  # 3
    "test_formats_esft_adapter.py": {"test_fuzz_esft_adapters"},  # 5.7
    "test_formats_fp8.py": {"test_fuzz_fp8_checkpoints",  # 8
                            "test_vllm_glue_extends_fp8_weights_and_scales_alike"},  # 2.7
    "test_formats_untrusted_bundles.py": {"test_cli_refuses_crafted_bundles_with_one_line",  # 4.9
                                          "test_fuzz_bundles"},  # 2.4
    "test_formats_untrusted_stores.py": {"test_cli_refuses_crafted_stores_in_one_line",  # 14.6
                                         "test_fuzz_stores",  # 2.5
                                         "test_triton_decoder_stays_inside_its_buffers_in_the_interpreter",  # 2.2
                                         "test_version_2_stores_are_read_only_when_asked_for_and_say_they_are_"
                                         "unprotected"},  # 3.4
    "test_kernel_huffman_decode.py": {"test_triton_decoder_in_the_interpreter"},  # 6.1
    "test_pipeline_cli.py": {"test_inspect_json",  # 3.2
                             "test_help_shows_choices_and_no_bool_placeholders"},  # 2.2
    "test_pipeline_config_layer_base.py": {"test_pack_reads_a_configs_numbering_and_refuses_to_guess"},  # 2.2
    "test_pipeline_consolidate.py": {"test_cli"},  # 7.2
    "test_pipeline_offline.py": {"test_cli_pack_merge_inspect"},  # 8.6
    "test_runtime_launcher.py": {"test_a_killed_launcher_takes_its_server_with_it"},  # 3.3
    "test_runtime_vllm_topk.py": {"test_folded_routing_gives_vllms_weights_and_the_rerouted_ids"},  # 7.6
}


def quick(item) -> bool:
    """Whether `item` belongs to the quick subset (the rule above NOT_QUICK_FILES)."""
    if "gpu" in item.keywords or "vllm" in item.keywords or "world" in getattr(item, "fixturenames", ()):
        return False
    name = getattr(item, "originalname", item.name)
    return item.path.name not in NOT_QUICK_FILES and name not in NOT_QUICK_TESTS.get(item.path.name, ())


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_vllm = pytest.mark.skip(reason="needs vLLM (install the [cpu] or [cuda] extra)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu():
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not has_vllm():
            item.add_marker(skip_vllm)
        if quick(item):
            item.add_marker(pytest.mark.quick)


FREE_AT_START = pytest.StashKey[float]()


def _free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / 2**30


def pytest_sessionstart(session):
    session.config.stash[FREE_AT_START] = _free_gib(Path(tempfile.gettempdir()))


def pytest_terminal_summary(terminalreporter, config):
    """The temporary folder's free disk at the start and the end, in the summary (the last lines CI keeps): a run
    of 2026-11-27 (stop 51) failed or errored 140 tests with ENOSPC on a disk that ran short, and nothing said so."""
    tmp = Path(tempfile.gettempdir())
    start = config.stash.get(FREE_AT_START, float("nan"))
    terminalreporter.write_line(f"free disk under {tmp}: {start:.1f} GiB at the start, {_free_gib(tmp):.1f} GiB now")


@pytest.fixture(scope="session")
def world():
    """The tiny world, from $ESFTCTL_WORLD or the default cache (built on first use, a minute or two)."""
    from esftctl.world.build import build_world

    return build_world()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """One small random model per architecture: {architecture: folder}."""
    from esftctl.world.models import ARCHITECTURES, make_random_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_random_model(arch, root / arch, seed=7) for arch in ARCHITECTURES}


def engine_settings(*, graphs: bool = False) -> dict:
    """vLLM engine settings for serving tests, as `vllm.LLM` arguments: small; eager, or with vLLM's default
    compilation and CUDA graphs; on a GPU a tenth of its memory each (servers and references run side by side), and
    where FlashInfer is not installed (the device's vLLM install carries none) Gated DeltaNet prefills (Qwen3-Next)
    by vLLM's Triton kernels, which vLLM 0.25 otherwise takes from FlashInfer on Hopper. `server_args` gives the same
    settings as server flags, so a server and its reference run alike."""
    import importlib.util

    from esftctl.vllm_generate import DEFAULT_ENGINE

    settings = {**DEFAULT_ENGINE, "enforce_eager": not graphs}
    if has_gpu():
        settings["gpu_memory_utilization"] = 0.1
        if importlib.util.find_spec("flashinfer") is None:
            settings["additional_config"] = {"gdn_prefill_backend": "triton"}
    return settings


def server_args(settings: dict) -> list[str]:
    args = ["--max-model-len", str(settings["max_model_len"]), "--max-num-seqs", str(settings["max_num_seqs"])]
    if settings["enforce_eager"]:
        args.append("--enforce-eager")
    if "gpu_memory_utilization" in settings:
        args += ["--gpu-memory-utilization", str(settings["gpu_memory_utilization"])]
    if settings.get("tensor_parallel_size", 1) > 1:
        args += ["--tensor-parallel-size", str(settings["tensor_parallel_size"])]
    if settings.get("enable_expert_parallel"):
        args.append("--enable-expert-parallel")
    if backend := settings.get("additional_config", {}).get("gdn_prefill_backend"):
        args += ["--gdn-prefill-backend", backend]
    return args


def plain_vllm(models: dict[str, Path], prompts: list[str], tmp: Path, max_tokens: int, logprobs: int,
               engine: dict | None = None) -> dict[str, list[dict]]:
    """Each model served alone by plain vLLM (esftctl.vllm_generate, one subprocess for all) with `engine`'s
    settings (default: `engine_settings()`): {name: per prompt its token_ids, text and top logprobs}."""
    import json

    req, out = tmp / "plain_vllm_request.json", tmp / "plain_vllm.json"
    req.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs,
                               "engine": engine or engine_settings()}))
    dirs = [str(d) for d in models.values()]
    proc = subprocess.run([sys.executable, "-m", "esftctl.vllm_generate", ",".join(dirs), str(req), str(out)],
                          capture_output=True, text=True, timeout=1800, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    by_dir = results if len(dirs) > 1 else {dirs[0]: results}  # one model: vllm_generate writes its list
    return {name: by_dir[str(d)] for name, d in models.items()}


def trained_like_bits(rows: int, cols: int, seed: int):
    """The bit patterns (uint16 numpy) of trained-like bf16 weights, the benches' (esftctl.bench.compress)."""
    from esftctl.bench.synthetic_model import trained_like

    return trained_like((rows, cols), torch.Generator().manual_seed(seed)).view(torch.int16).numpy().view("uint16")


def run_interpreted(code: str) -> None:
    """Run `code` (which prints "ok" at its end) in a subprocess under Triton's CPU interpreter, so machines
    without a GPU check a kernel's logic too."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def load_staged(layer, adapter: dict):
    """`adapter` (expert -> ExpertWeights) loaded as "a" into `layer` (as layer 0) through staging with its
    checksums, as `adapters load` does: (the slots, the staged rows, the adapter's rows by expert)."""
    from esftctl.runtime.adapters import AdapterSlots
    from esftctl.runtime.host_cache import stage

    slots, staged = AdapterSlots({0: layer}), stage({0: layer}, {0: adapter})
    slots.load("a", staged.experts(), staged.rows(), staged.checksums())
    return slots, staged, layer.slot_rows[0]


def refused_when_written_wrong(slots, staged, layer, monkeypatch, corrupt) -> None:
    """Loading the staged rows again, with the parts beside the weights (biases or scales) changed on their way
    into the rows by `corrupt(part13, part2) -> (part13, part2)`, is refused by the checksums, and the first
    adapter stays as it was."""
    from esftctl.errors import EsftError
    from esftctl.runtime.moe_layer import VirtualMoELayer

    write = VirtualMoELayer.write_rows
    monkeypatch.setattr(VirtualMoELayer, "write_rows",
                        lambda self, rows, w13, w2, p13, p2: write(self, rows, w13, w2, *corrupt(p13, p2)))
    with pytest.raises(EsftError, match=r"the rows of experts \[3\] do not hold"):
        slots.load("bad", staged.experts(), staged.rows(), staged.checksums())
    monkeypatch.undo()
    assert set(slots.adapters) == {"a"} and layer.free_rows == 2


def run_cli(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run `esftctl ARGS` in a subprocess, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "esftctl.cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    if check and proc.returncode != 0:
        raise AssertionError(f"esftctl {' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc


def load_script(name: str):
    """benchmarks/lab/NAME.py as a module, the lab's folder on the path while it loads (a script may import
    another beside it, as side_by_side.py imports ttft_alone)."""
    import importlib.util

    lab = ROOT / "benchmarks" / "lab"
    sys.path.insert(0, str(lab))
    try:
        spec = importlib.util.spec_from_file_location(name, lab / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name as they are made
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(lab))
    return module
