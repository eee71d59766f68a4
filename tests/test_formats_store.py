"""Huffman-coded expert stores: bit-exact round trips, sizes against the entropy bound, refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import run_cli

from esftctl.errors import EsftError
from esftctl.formats.huffman import (
    GROUP,
    LANES,
    MAX_LENGTH,
    build_code,
    chunk_count,
    chunk_firsts,
    chunk_layout,
    code_lengths,
    decode,
    encode,
    entropy_bits,
    join_bf16,
    split_bf16,
)
from esftctl.formats.store import ExpertStore, SourceTensor, compress, decompress, header_hash, write_store


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def _special_values(n: int, seed: int) -> torch.Tensor:
    """Random bf16 bit patterns with NaNs, infinities, signed zeros and subnormals mixed in."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    specials = torch.tensor([0x7FC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFFFF],
                            dtype=torch.int32).to(torch.int16)
    bits[: len(specials)] = specials
    return bits.view(torch.bfloat16)


def _heavy_tailed(n: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return (torch.distributions.StudentT(2.0).sample((n,)) * 0.01).to(torch.bfloat16)


@pytest.mark.parametrize("values", [
    lambda: (torch.randn(5000) * 0.02).to(torch.bfloat16),
    lambda: _heavy_tailed(20_000, 1),
    lambda: _special_values(3000, 2),
    lambda: torch.ones(1, dtype=torch.bfloat16),
    lambda: torch.full((777,), 3.5, dtype=torch.bfloat16),  # one symbol only
])
@pytest.mark.parametrize("chunk", [16, 48, 1024])
def test_huffman_round_trip_is_bit_exact(values, chunk):
    bits = _bits(values())
    exponent, sign_mantissa = split_bf16(bits)
    assert np.array_equal(join_bf16(exponent, sign_mantissa), bits)
    code = build_code(np.bincount(exponent, minlength=256))
    assert code.max_length <= MAX_LENGTH
    data, offsets = encode(exponent, code, chunk)
    assert len(offsets) == len(chunk_layout(len(exponent), chunk)[1])
    assert np.array_equal(decode(data, offsets, len(exponent), code, chunk), exponent)


@pytest.mark.parametrize("count", [0, 1, 17, 5000, 2 * LANES * 64 + 100])
def test_chunk_layout_gives_every_value_once_a_warp_writes_whole_runs(count):
    """Chunks of one block take turns by GROUP values: every value once, and at a group's turn the block's
    lanes hold one contiguous run."""
    chunk = 64
    order, lengths = chunk_layout(count, chunk)
    assert np.array_equal(np.sort(order), np.arange(count))
    assert lengths.sum() == count and (lengths > 0).all() and (lengths <= chunk).all()
    starts = np.cumsum(lengths) - lengths
    assert chunk_count(count, chunk) == len(lengths)
    assert np.array_equal(chunk_firsts(count, chunk), order[starts])
    for block in range(-(-len(lengths) // LANES)):
        lanes = range(block * LANES, min(len(lengths), (block + 1) * LANES))
        for g in range(chunk // GROUP):
            turn = np.concatenate([[]] + [order[starts[k] + g * GROUP: starts[k] + min(lengths[k], (g + 1) * GROUP)]
                                          for k in lanes]).astype(np.int64)
            if len(turn):
                assert np.array_equal(turn, np.arange(turn[0], turn[0] + len(turn)))


def test_length_limit_keeps_a_prefix_code():
    counts = np.zeros(256, dtype=np.int64)
    counts[:40] = [2 ** min(i, 40) for i in range(40)]  # Fibonacci-like skew: unlimited lengths reach 39
    lengths = code_lengths(counts, max_length=12)
    used = lengths[counts > 0]
    assert used.max() == 12 and (used > 0).all()
    assert sum(2.0 ** -l for l in used) <= 1.0
    exponent = np.repeat(np.arange(40, dtype=np.uint8), 3)
    code = build_code(counts)
    data, offsets = encode(exponent, code, 16)
    assert np.array_equal(decode(data, offsets, len(exponent), code, 16), exponent)


def _store_of(tensors: dict[str, torch.Tensor], out, **kw):
    sources = [SourceTensor(n, 0, i, "gate", lambda t=t: t) for i, (n, t) in enumerate(tensors.items())]
    write_store({"kind": "tensors", "path": "test"}, sources, out, **kw)
    return ExpertStore(out)


@pytest.mark.parametrize("scope", ["tensor", "layer"])
def test_store_round_trip_edge_tensors(tmp_path, scope):
    tensors = {"specials": _special_values(4099, 3), "heavy": _heavy_tailed(3000, 4).reshape(30, 100),
               "one": torch.tensor([[1.25]], dtype=torch.bfloat16), "empty": torch.zeros(0, 8, dtype=torch.bfloat16)}
    store = _store_of(tensors, tmp_path / "s", chunk=64, table_scope=scope)
    for name, t in tensors.items():
        got = store.decode_tensor(name)
        assert got.shape == t.shape and torch.equal(got.view(torch.int16), t.view(torch.int16)), name


def test_to_device_copies_store_bin_in_pieces_the_bytes_it_copied_whole(tmp_path, monkeypatch):
    """store.bin reaches a device in DEVICE_COPY_CHUNK pieces (a Qwen3-30B-A3B store, 25 GB, once went whole
    through host memory, twice: read, then padded by np.concatenate) and gives the bytes the whole copy gave: the
    data, then zeros to whole words and 16 bytes more. Here 5 pieces and a tail; and neither the copy nor the
    decode plans hold the store in host memory (numpy's allocations, what tracemalloc sees, stay far below it)."""
    import tracemalloc

    from esftctl.formats import store as store_module

    tensors = {f"t{k}": _heavy_tailed(1000 * (200 + 7 * k), k).reshape(200 + 7 * k, 1000) for k in range(4)}
    store = _store_of(tensors, tmp_path / "s")
    raw = np.fromfile(store.data_file, dtype=np.uint8)
    want = np.concatenate([raw, np.zeros(16 + -len(raw) % 4, dtype=np.uint8)])  # what to_device once built
    piece = len(raw) // 5 - 7
    assert len(raw) % piece and len(raw) // piece == 5
    monkeypatch.setattr(store_module, "DEVICE_COPY_CHUNK", piece)
    data, tables = store.to_device(torch.device("cpu"))
    assert data.dtype == torch.uint8 and np.array_equal(data.numpy(), want)
    assert store.to_device(torch.device("cpu"))[0] is data  # copied once, then kept
    targets = [(n, torch.empty(t.shape, dtype=torch.bfloat16)) for n, t in tensors.items()]
    store.plan(targets)  # imports done before counting
    fresh = ExpertStore(tmp_path / "s")
    tracemalloc.start()
    fresh.plan(targets)  # copies store.bin to the device first
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert np.array_equal(fresh.to_device(torch.device("cpu"))[0].numpy(), want)
    assert peak < len(raw) / 2, (peak, len(raw))  # whole, it was more than twice the store


def test_model_store_size_and_round_trip(world, tmp_path):
    from esftctl.formats.checkpoint import MoECheckpoint

    header = compress(world.base_dir, tmp_path / "store")
    store = ExpertStore(tmp_path / "store")
    d = store.describe()
    assert d["stored_bytes"] < 0.70 * d["original_bytes"]  # trained bf16 weights: exponents ~2.5 bits
    assert d["stored_bytes"] >= d["entropy_bound_bytes"]
    ckpt = MoECheckpoint(world.base_dir)
    for e in header["tensors"][:12]:
        assert torch.equal(store.decode_tensor(e["name"]), ckpt.read_tensor(e["name"]))
    decompress(tmp_path / "store", tmp_path / "out")
    from safetensors.torch import load_file

    restored = load_file(tmp_path / "out" / "experts.safetensors")
    assert len(restored) == len(ckpt.moe_layers) * ckpt.num_experts * 3
    for name, t in restored.items():
        assert torch.equal(t, ckpt.read_tensor(name))


def test_entropy_bound_matches_hand_count():
    exponent = np.array([1, 1, 2, 3], dtype=np.uint8)
    assert abs(entropy_bits(np.bincount(exponent, minlength=256)) - 1.5) < 1e-12


def test_corrupted_truncated_and_wrong_inputs(world, tmp_path):
    compress(world.base_dir, tmp_path / "store")
    for how in ("flip", "truncate"):
        copy = shutil.copytree(tmp_path / "store", tmp_path / how)
        raw = bytearray((copy / "store.bin").read_bytes())
        if how == "flip":
            raw[len(raw) // 3] ^= 1
        else:
            raw = raw[:-17]
        (copy / "store.bin").write_bytes(bytes(raw))
        with pytest.raises(EsftError, match="store.bin: checksum mismatch"):
            ExpertStore(copy)
    proc = run_cli("decompress", tmp_path / "flip", "--out", tmp_path / "x")
    assert proc.returncode == 1 and "checksum mismatch" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()
    with pytest.raises(EsftError, match="output already exists"):
        compress(world.base_dir, tmp_path / "store")
    with pytest.raises(EsftError, match="multiple of 16"):
        _store_of({"x": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "odd", chunk=24)
    old = shutil.copytree(tmp_path / "store", tmp_path / "v1")
    header = json.loads((old / "store.json").read_text())
    (old / "store.json").write_text(json.dumps({**header, "version": 1}))
    with pytest.raises(EsftError, match="store.json: store version 1 is not supported .*compress the model again"):
        ExpertStore(old)
    (old / "store.json").write_text(json.dumps({**header, "lanes": 64}))
    with pytest.raises(EsftError, match="store.json: header checksum mismatch"):
        ExpertStore(old)
    relaid = {**header, "lanes": 64}
    (old / "store.json").write_text(json.dumps({**relaid, "header_sha256": header_hash(relaid)}))
    with pytest.raises(EsftError, match="store.json: chunks laid out for 64 lanes"):
        ExpertStore(old)
    with pytest.raises(EsftError, match="only bf16"):
        _store_of({"f32": torch.zeros(4)}, tmp_path / "f32")
    assert not (tmp_path / "f32").exists()


def test_cli_compress_bundle_and_back(world, tmp_path):
    from esftctl.formats.bundle import Bundle
    from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, expert_replacements, write_checkpoint
    from esftctl.pack import pack

    base = MoECheckpoint(world.base_dir)
    new = {(2, 5): ExpertWeights(*(t * 2 for _, t in base.read_expert(2, 5).items()))}
    tuned = write_checkpoint(base, tmp_path / "tuned", expert_replacements(base, new))
    pack(world.base_dir, tuned, tmp_path / "bundle", "twice")
    d = json.loads(run_cli("compress", tmp_path / "bundle", "--out", tmp_path / "store", "--json",
                           check=True).stdout)
    assert d["source"] == "bundle" and d["tensors"] == 3
    run_cli("decompress", tmp_path / "store", "--out", tmp_path / "again", check=True)
    again, original = Bundle.open(tmp_path / "again"), Bundle.open(tmp_path / "bundle")
    assert again.manifest == original.manifest
    files = sorted(p.name for p in (tmp_path / "bundle").iterdir())  # written in two processes, byte for byte alike
    assert files == sorted(p.name for p in (tmp_path / "again").iterdir()) and "base_tensors.json" in files
    assert all((tmp_path / "again" / f).read_bytes() == (tmp_path / "bundle" / f).read_bytes() for f in files)
    assert again.read_expert(2, 5).equal(original.read_expert(2, 5))
    d = json.loads(run_cli("inspect", tmp_path / "store", "--json", check=True).stdout)
    assert d["kind"] == "store" and d["values"] == 3 * 256 * 64


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_code_lengths_against_dahuffman_an_independent_huffman_coder(seed):
    """dahuffman builds optimal (unlimited) Huffman codes: ours can be no shorter on average, and the 12-bit limit
    costs under 1% on exponent-like histograms (a few dominant symbols and a long tail down to single counts)."""
    from dahuffman import HuffmanCodec

    rng = np.random.default_rng(seed)
    counts = np.zeros(256, dtype=np.int64)
    counts[100:140] = np.maximum((1e7 * np.exp(-0.5 * ((np.arange(40) - 20) / 3.0) ** 2)).astype(np.int64), 1)
    counts[rng.choice(256, 12, replace=False)] += rng.integers(1, 4, 12)  # rare symbols: the long codes
    used = {s: int(c) for s, c in enumerate(counts) if c}
    table = HuffmanCodec.from_frequencies(used).get_code_table()
    theirs = {s: bits for s, (bits, _) in table.items() if s in used}  # dahuffman adds an end-of-file symbol
    ours = code_lengths(counts)
    total = counts.sum()
    mean_ours = float((ours * counts).sum() / total)
    mean_theirs = sum(theirs[s] * c for s, c in used.items()) / total
    assert max(theirs.values()) > MAX_LENGTH >= ours.max()  # the limit binds here
    assert mean_theirs <= mean_ours <= mean_theirs * 1.01  # here about 0.4%
    assert entropy_bits(counts) <= mean_ours


def test_compress_and_decompress_hold_one_layer_not_the_model(tmp_path):
    """At DeepSeek-V2-Lite's scale a store is about 21 GB: `compress` once built it in memory (twice, with the
    copy written out) and `decompress` read it whole and decoded every tensor before writing. Here, 6 MoE layers of
    16 experts (75 MB of experts): the Python-side peak (numpy and bytes, what tracemalloc sees) stays under a
    third of the experts' bytes, about what one layer takes, and the round trip is exact."""
    import tracemalloc

    from safetensors import safe_open

    from esftctl.bench.synthetic_model import deepseek_v2_lite_config, write_model
    from esftctl.formats.checkpoint import MoECheckpoint

    config = deepseek_v2_lite_config(num_hidden_layers=7, vocab_size=1024, hidden_size=256, intermediate_size=512,
                                     moe_intermediate_size=512, n_routed_experts=16, num_attention_heads=4,
                                     num_key_value_heads=4, qk_nope_head_dim=32, v_head_dim=64, bos_token_id=1000,
                                     eos_token_id=1001, pad_token_id=1002)
    base = MoECheckpoint(write_model(tmp_path / "base", config, seed=0, shard_bytes=16 << 20))
    expert_bytes = 6 * 16 * 3 * 256 * 512 * 2
    for step in ("compress", "decompress"):
        tracemalloc.start()
        if step == "compress":
            compress(base.path, tmp_path / "store")
        else:
            decompress(tmp_path / "store", tmp_path / "back")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < expert_bytes / 3, (step, peak, expert_bytes)
    with safe_open(tmp_path / "back" / "experts.safetensors", "pt") as f:
        assert len(list(f.keys())) == 6 * 16 * 3
        for name in list(f.keys())[::37]:
            assert torch.equal(f.get_tensor(name), base.read_tensor(name))
