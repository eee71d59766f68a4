"""MoE checkpoint I/O on every supported architecture, and its refusals of bad input."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from esftctl.errors import EsftError
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint

# What each tiny config (esftctl.world.models.tiny_config) must be described as.
EXPECTED = {
    "deepseek_v2": dict(moe_layers=[1, 2, 3], experts=16, top_k=4, shared=2, inter=64),
    "qwen2_moe": dict(moe_layers=[0, 1, 2, 3], experts=16, top_k=4, shared=1, inter=128),
    "qwen3_moe": dict(moe_layers=[0, 1, 2, 3], experts=16, top_k=4, shared=0, inter=128),
    "mixtral": dict(moe_layers=[0, 1, 2, 3], experts=8, top_k=2, shared=0, inter=128),
    "olmoe": dict(moe_layers=[0, 1, 2, 3], experts=16, top_k=4, shared=0, inter=128),
    "glm4_moe": dict(moe_layers=[1, 2, 3], experts=16, top_k=4, shared=1, inter=128),
    "deepseek_v3": dict(moe_layers=[1, 2, 3], experts=16, top_k=4, shared=1, inter=64),
    "qwen3_next": dict(moe_layers=[0, 1, 2, 3], experts=16, top_k=4, shared=1, inter=128),
}


def _payload_bytes(file) -> int:
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    return file.stat().st_size - 8 - header_len


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_describe_counts_and_bytes(tiny_models, arch):
    ckpt = MoECheckpoint(tiny_models[arch])
    want = EXPECTED[arch]
    d = ckpt.describe()
    assert d["architecture"] == arch
    assert d["moe_layers"] == want["moe_layers"]
    assert d["routed_experts_per_layer"] == want["experts"]
    assert d["top_k"] == want["top_k"]
    assert d["shared_experts_per_layer"] == want["shared"]
    assert d["expert_bytes"] == 3 * 256 * want["inter"] * 2  # gate + up + down, bf16
    assert d["routed_expert_bytes"] == d["expert_bytes"] * want["experts"] * len(want["moe_layers"])
    assert d["total_bytes"] == sum(_payload_bytes(f) for f in ckpt.files)


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_read_expert_matches_model_parameters(tiny_models, arch):
    """The hub layout that save_pretrained writes is what read_expert returns, expert by expert."""
    from transformers import AutoModelForCausalLM

    ckpt = MoECheckpoint(tiny_models[arch])
    model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.bfloat16)
    layer = ckpt.moe_layers[-1]
    experts = model.model.layers[layer].mlp.experts
    inter = ckpt.moe_intermediate_size
    for e in (0, ckpt.num_experts - 1):
        w = ckpt.read_expert(layer, e)
        assert torch.equal(w.gate, experts.gate_up_proj[e, :inter])
        assert torch.equal(w.up, experts.gate_up_proj[e, inter:])
        assert torch.equal(w.down, experts.down_proj[e])


@pytest.mark.parametrize("arch", ["deepseek_v2", "mixtral"])
def test_write_checkpoint_replaces_one_expert_only(tiny_models, tmp_path, arch):
    src = MoECheckpoint(tiny_models[arch])
    layer, expert = src.moe_layers[0], 3
    old = src.read_expert(layer, expert)
    new = ExpertWeights(*(torch.randn_like(t, dtype=torch.float32).to(t.dtype) for _, t in old.items()))
    out = write_checkpoint(src, tmp_path / "out", expert_replacements(src, {(layer, expert): new}))
    dst = MoECheckpoint(out)
    assert dst.read_expert(layer, expert).equal(new)
    assert not dst.read_expert(layer, expert).equal(old)
    for name in src.tensors:
        if name not in src.expert_tensor_names(layer, expert).values():
            assert torch.equal(src.read_tensor(name), dst.read_tensor(name)), name
    assert (out / "config.json").read_text() == (tiny_models[arch] / "config.json").read_text()


def test_sharded_checkpoint(tmp_path):
    from esftctl.world.models import build_model, tiny_config

    model = build_model(tiny_config("qwen3_moe"), seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m", max_shard_size="2MB")
    ckpt = MoECheckpoint(tmp_path / "m")
    assert len(ckpt.files) > 1
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    ref = model.model.layers[2].mlp.experts
    assert torch.equal(ckpt.read_expert(2, 5).down, ref.down_proj[5])
    # writing keeps the sharding, and the copy reads back the same
    copy = MoECheckpoint(write_checkpoint(ckpt, tmp_path / "copy"))
    assert [f.name for f in copy.files] == [f.name for f in ckpt.files]
    assert copy.read_expert(2, 5).equal(ckpt.read_expert(2, 5))

    # a missing shard is named
    victim = ckpt.files[-1]
    victim.unlink()
    with pytest.raises(EsftError, match=victim.name + ": missing safetensors shard"):
        MoECheckpoint(tmp_path / "m")


def test_stored_bytes_are_the_tensors_bytes(tmp_path):
    """read_bytes reads a tensor's bytes where the safetensors header puts them, in every shard, from any start;
    a file cut short after opening is one line naming it."""
    from esftctl.world.models import build_model, tiny_config

    model = build_model(tiny_config("qwen3_moe"), seed=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m", max_shard_size="2MB")
    ckpt = MoECheckpoint(tmp_path / "m")
    ckpt.prefetch(ckpt.tensors)  # only advice to the kernel: reads are the same with it
    for name in sorted(ckpt.tensors)[::7]:
        want = ckpt.read_tensor(name).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        got = bytearray(len(want))
        ckpt.read_bytes(name, memoryview(got))
        assert got == want, name
        tail = bytearray(len(want) - 3)
        ckpt.read_bytes(name, memoryview(tail), start=3)
        assert tail == want[3:], name
    with pytest.raises(ValueError, match="outside"):
        ckpt.read_bytes(name, memoryview(bytearray(len(want))), start=1)
    info = ckpt.tensors[max(ckpt.tensors, key=lambda n: ckpt.tensors[n].offset)]  # the last tensor of a shard
    info.file.write_bytes(info.file.read_bytes()[:info.offset + 1])
    with pytest.raises(EsftError, match="the file ends inside tensor"):
        ckpt.read_bytes(max(ckpt.tensors, key=lambda n: ckpt.tensors[n].offset), memoryview(bytearray(2)))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors_is_named(tiny_models, tmp_path):
    m = _copy(tiny_models["mixtral"], tmp_path / "m")
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(EsftError, match="model.safetensors: not a readable safetensors file"):
        MoECheckpoint(m)


def test_garbage_safetensors_is_named(tiny_models, tmp_path):
    m = _copy(tiny_models["qwen3_moe"], tmp_path / "m")
    (m / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(EsftError, match="not a readable safetensors file"):
        MoECheckpoint(m)


def test_unsupported_architecture(tiny_models, tmp_path):
    m = _copy(tiny_models["qwen3_moe"], tmp_path / "m")
    config = json.loads((m / "config.json").read_text())
    config["model_type"] = "llama"
    (m / "config.json").write_text(json.dumps(config))
    with pytest.raises(EsftError, match=r"config.json: unsupported architecture 'llama'"):
        MoECheckpoint(m)


def test_shape_mismatch_names_tensor_and_file(tiny_models, tmp_path):
    m = _copy(tiny_models["deepseek_v2"], tmp_path / "m")
    config = json.loads((m / "config.json").read_text())
    config["moe_intermediate_size"] = 32
    (m / "config.json").write_text(json.dumps(config))
    expected = (r"model.safetensors: expert tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' has shape "
                r"\[64, 256\], expected \[32, 256\]")
    with pytest.raises(EsftError, match=expected):
        MoECheckpoint(m)


def test_missing_expert_tensor(tiny_models, tmp_path):
    from safetensors.torch import load_file

    m = _copy(tiny_models["qwen3_moe"], tmp_path / "m")
    tensors = load_file(m / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.15.up_proj.weight"]
    save_file(tensors, m / "model.safetensors")
    with pytest.raises(EsftError, match="missing expert tensor 'model.layers.3.mlp.experts.15.up_proj.weight'"):
        MoECheckpoint(m)


def test_not_a_folder_and_bad_json(tmp_path):
    with pytest.raises(EsftError, match="not a model folder"):
        MoECheckpoint(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{broken")
    with pytest.raises(EsftError, match="config.json: not valid JSON"):
        MoECheckpoint(tmp_path / "m")


@pytest.mark.parametrize("arch, change, match", [
    ("deepseek_v2", {"n_group": "8"}, r"'n_group' must be an integer in 0-65536 or null, not \"8\""),
    ("deepseek_v3", {"n_shared_experts": "x"}, r"'n_shared_experts' must be an integer in 0-65536 or null"),
    ("glm4_moe", {"first_k_dense_replace": [3, 3]}, r"'first_k_dense_replace' must be an integer in 0-4096 or null"),
    ("qwen2_moe", {"mlp_only_layers": 16}, r"'mlp_only_layers' must be a list of layer indices or null, not 16"),
    ("qwen3_moe", {"decoder_sparse_step": True}, r"'decoder_sparse_step' must be an integer in 0-4096 or null"),
    ("deepseek_v2", {"scoring_func": 1}, r"'scoring_func' must be a string or null, not 1"),
    ("mixtral", {"num_hidden_layers": 2 ** 31}, r"'num_hidden_layers' must be an integer in 1-4096, not 2147483648"),
    ("olmoe", {"num_experts": None}, r"'num_experts' must be an integer in 1-65536, not null"),
    ("qwen3_next", {"hidden_size": 1.5}, r"'hidden_size' must be an integer in 1-1048576, not 1.5"),
])
def test_config_fields_are_checked_before_use(tiny_models, tmp_path, arch, change, match):
    """Every config field an architecture's rules read has its JSON type and a range (formats/architectures.py):
    a string n_group was a TypeError and 2**31 layers a hang until the fuzz below found them."""
    m = _copy(tiny_models[arch], tmp_path / "m")
    config = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(EsftError, match=rf"^\S*config.json: config's {match}"):
        MoECheckpoint(m)
    (m / "config.json").write_text(json.dumps([config]))
    with pytest.raises(EsftError, match=r"config.json: config is not a JSON object$"):
        MoECheckpoint(m)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "..", 5, None])
def test_index_names_only_files_of_the_folder(tiny_models, tmp_path, monkeypatch, shard):
    """A downloaded checkpoint's index cannot send the reader outside its folder: a shard is a file name in it."""
    from esftctl.formats import checkpoint

    m = _copy(tiny_models["qwen3_moe"], tmp_path / "m")
    shutil.copy(m / "model.safetensors", tmp_path / "outside.safetensors")
    names = list(MoECheckpoint(m).tensors)
    weight_map = dict.fromkeys(names, "model.safetensors") | {names[-1]: shard}
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    opened = []
    monkeypatch.setattr(checkpoint, "open_regular", lambda path: opened.append(path))
    with pytest.raises(EsftError, match=rf"index.json: the index puts tensor '{names[-1]}' in .*, not a file name "
                                        "of the model folder$"):
        MoECheckpoint(m)
    assert opened == []


def opened_or_refused(case: Path, *, fp8: bool = False, every_expert: bool = False) -> str:
    """A fuzz case of a model folder: 'accepted' if it opens, is described and its first expert (or every one) is
    read; 'refused' if that stops with one line naming the folder; never another exception or a hang."""
    from test_formats_untrusted_bundles import deadline

    from esftctl.describe import describe_path

    try:
        with deadline(20):
            ckpt = MoECheckpoint(case, fp8=fp8)
            describe_path(case)
            pairs = ([(layer, e) for layer in ckpt.moe_layers for e in range(ckpt.num_experts)] if every_expert
                     else [(ckpt.moe_layers[0], 0)])
            for layer, expert in pairs:
                ckpt.read_expert(layer, expert)
        return "accepted"
    except EsftError as e:
        assert "\n" not in str(e) and str(case) in str(e), str(e)
        return "refused"


def test_fuzz_checkpoint_configs(tiny_models, tmp_path):
    """Random changes of tiny models' config.json values (the bundle fuzz's, tests/test_formats_untrusted_bundles.py),
    fixed seed, about 10 s over four architectures: refused in one line naming the folder's config, or opened, described
    and read; never another exception or a hang."""
    import random
    import time

    from test_formats_untrusted_bundles import mutate_manifest

    rng = random.Random(5)
    outcomes = {"refused": 0, "accepted": 0}
    start, n = time.monotonic(), 0
    while time.monotonic() - start < 10 and n < 2000:
        arch = ("deepseek_v3", "qwen2_moe", "mixtral", "glm4_moe")[n % 4]
        case = _copy(tiny_models[arch], tmp_path / f"case{n}")
        config = json.loads((case / "config.json").read_text())
        (case / "config.json").write_text(json.dumps(mutate_manifest(config, rng)))
        outcomes[opened_or_refused(case)] += 1
        shutil.rmtree(case)
        n += 1
    assert n >= 100 and min(outcomes.values()) > 0, outcomes


def test_expert_ids_are_checked(tiny_models):
    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    with pytest.raises(EsftError, match="expert 16 out of range"):
        ckpt.read_expert(1, 16)
    with pytest.raises(EsftError, match="layer 0 is not a MoE layer"):
        ckpt.read_expert(0, 0)


def test_write_refuses_wrong_shape_and_existing_output(tiny_models, tmp_path):
    src = MoECheckpoint(tiny_models["qwen2_moe"])
    name = src.arch.expert_tensor(0, 0, "gate")
    with pytest.raises(EsftError, match="cannot replace"):
        write_checkpoint(src, tmp_path / "out", {name: torch.zeros(3, 3, dtype=torch.bfloat16)})
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.iterdir()), "no temporary folder may be left behind"
    (tmp_path / "out").mkdir()
    with pytest.raises(EsftError, match="output already exists"):
        write_checkpoint(src, tmp_path / "out")


# ---- untrusted files (issue 32) -----------------------------------------------------------------------------

def _safetensors(path, header, data=b""):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize("header,data,match", [
    ({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
      "u": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "overlap or leave gaps"),
    ({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]}}, b"\0" * 8, "overlap or leave gaps"),
    ({"t": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, r"bytes \[0, 4\] for BF16 \[4\]"),
    ({"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "no known dtype"),
    ({"t": {"dtype": "BF16", "shape": [-2], "data_offsets": [0, 4]}}, b"\0" * 4, "no known dtype, shape"),
    ({"t": {"dtype": "BF16", "shape": [True, 2], "data_offsets": [0, 4]}}, b"\0" * 4, "no known dtype, shape"),
    ({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 2, "end at byte"),
    ({"t": []}, b"", "no known dtype"),
    ([1], b"", "not a JSON object"),
    (b"[" * 50_000, b"", "header is not JSON"),
])
def test_safetensors_header_is_validated(tmp_path, header, data, match):
    """esftctl checks a safetensors header itself before reading any tensor at its offsets."""
    from esftctl.formats.checkpoint import read_header

    with pytest.raises(EsftError, match="x.safetensors: not a readable safetensors file .corrupted or truncated: "
                                        ".*" + match):
        read_header(_safetensors(tmp_path / "x.safetensors", header, data))
    (tmp_path / "y.safetensors").write_bytes((2**63).to_bytes(8, "little") + b"{}")
    with pytest.raises(EsftError, match="a header of 9223372036854775808 bytes in a file of 10"):
        read_header(tmp_path / "y.safetensors")


def test_fifo_shard_is_refused_at_once(tiny_models, tmp_path):
    from test_formats_untrusted_bundles import unblocked

    m = _copy(tiny_models["qwen3_moe"], tmp_path / "m")
    (m / "model.safetensors").unlink()
    os.mkfifo(m / "model.safetensors")
    with unblocked(m / "model.safetensors"), pytest.raises(EsftError, match="model.safetensors: not a regular file"):
        MoECheckpoint(m)


MERGE_UNDER_LIMIT = """
import resource, sys
from esftctl.formats.checkpoint import MoECheckpoint, write_checkpoint
src = MoECheckpoint(sys.argv[1])
src.read_tensor(next(iter(src.tensors)))  # torch's first tensor allocations happen before the limit
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (384 << 20), resource.RLIM_INFINITY))
write_checkpoint(src, sys.argv[2])
print("ok")
"""


def test_copy_keeps_virtual_memory_bounded(tiny_models, tmp_path):
    """Writing a checkpoint (merge, materialize) holds one shard's tensors, not a mapping of the whole shard per
    tensor: 190 tensors of a 10 MB file took 1.9 GB of address space; here it runs under 384 MB more than the
    interpreter's own."""
    args = [sys.executable, "-c", MERGE_UNDER_LIMIT, str(tiny_models["deepseek_v2"]), str(tmp_path / "o")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    a, b = MoECheckpoint(tiny_models["deepseek_v2"]), MoECheckpoint(tmp_path / "o")
    assert all(torch.equal(a.read_tensor(n), b.read_tensor(n)) for n in a.tensors)


def test_ctrl_c_while_reading_is_an_interrupt(tiny_models):
    """Ctrl-C (here SIGALRM raising KeyboardInterrupt every 0.1-2 ms) while tensors are read is always a
    KeyboardInterrupt: through safetensors' mapping, torch turned some into a ValueError, which the reader
    reported as the base file's fault ("cannot read tensor ...")."""
    import signal
    import time

    ckpt = MoECheckpoint(tiny_models["deepseek_v2"])
    names = sorted(ckpt.tensors)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupts, start, n = 0, time.monotonic(), 0
    try:
        while time.monotonic() - start < 3:
            n += 1
            try:
                signal.setitimer(signal.ITIMER_REAL, 0.0001 + (n % 20) * 0.0001)
                for name in names:
                    ckpt.read_tensor(name)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                interrupts += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert interrupts > 10
