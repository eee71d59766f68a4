"""The fused fixed-rate expert GEMM (esftctl.kernels.fixed_rate_moe): the layout round trip and its check, and the
kernel bit for bit against vLLM's own `fused_moe_kernel` run on the decoded bf16 weights with the same config, and
against the plain PyTorch reference.

Without a GPU both kernels run in Triton's interpreter (vLLM's CPU build disables Triton, so its kernel is compiled
here from its installed source: `vllm_kernel`; the interpreter's bf16 dot and downcast made to work as a GPU's:
`interpreter_bf16_as_on_gpus`): the w13 and w2 products, routed weights on and off, weights with no, rare and many
escapes, K tiles of 64, 128 and 256, a partial last K tile, vLLM's naive (low-latency) assignment and an
expert-parallel -1 block. The exact cases' values are +-{1, 1.5} x 2^e with each weight row's products on one grid
and their sums within 24 bits of it: fp32 holds every partial sum exactly, so any summation order gives the same
bits and the reference compares bit for bit too. On CUDA with vLLM's CUDA build: the same cases through vLLM's real
launch and `moe_align_block_size`."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import run_interpreted

from esftctl.kernels.fixed_rate_moe import GROUP, decode_tiled_reference, encode_tiled

HERE = Path(__file__).resolve().parent


# ---- inputs -------------------------------------------------------------------------------------------------------

def exact_weights(experts: int, n: int, k: int, escapes: str, seed: int) -> torch.Tensor:
    """bf16 [experts, n, k]: +-{1, 1.5} x 2^e. `none`: e in [-8, 1] (10 exponents, no escape); `rare`: that, plus
    a few outliers an expert at e in [2, 8] (17 exponents: the two rarest, 7 and 8, escape); `many`: each weight
    row its own band of 11 exponents, the bands spread over [-20, 10] (most values escape). Within a row, products
    with `exact_inputs` are multiples of 2^(lowest - 3) below 2^(lowest + 21) in sum: fp32 sums them exactly."""
    g = torch.Generator().manual_seed(seed)
    shape = (experts, n, k)
    if escapes == "many":
        band = -20 + (torch.arange(experts)[:, None, None] * 7 + torch.arange(n)[None, :, None] * 5) % 21
        exp = band + torch.randint(0, 11, shape, generator=g)
    else:
        exp = torch.randint(-8, 2, shape, generator=g)
    if escapes == "rare":
        flat = exp.view(experts, -1)
        for e in range(experts):
            outliers = [x for x in range(2, 7) for _ in range(3)] + [7, 8] + [7] * (e % 2)
            at = torch.randperm(n * k, generator=g)[:len(outliers)]
            flat[e, at] = torch.tensor(outliers)
    sig = 1 + 0.5 * torch.randint(0, 2, shape, generator=g)
    sign = 1 - 2 * torch.randint(0, 2, shape, generator=g)
    return (sign * sig * torch.exp2(exp.double())).to(torch.bfloat16)


def exact_inputs(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sig = 1 + 0.5 * torch.randint(0, 2, (m, k), generator=g)
    sign = 1 - 2 * torch.randint(0, 2, (m, k), generator=g)
    return (sign * sig * torch.exp2(-torch.randint(0, 2, (m, k), generator=g).double())).to(torch.bfloat16)


def routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), top_k)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


# ---- the layout ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("escapes", ["none", "rare", "many"])
def test_the_layout_decodes_to_the_weights_bit_for_bit(escapes):
    w = exact_weights(3, 8, 192, escapes, seed=1)
    t = encode_tiled(w)
    t.check()
    assert _same(decode_tiled_reference(t), w)
    raw_groups = int((t.raw_at >= 0).sum())
    assert (raw_groups == 0) == (escapes == "none") and t.raw.shape[0] == raw_groups


def test_the_words_hold_pairs_of_k_adjacent_values():
    """A sign-mantissa word's bytes 0 and 2 are two K-adjacent values (a pair the MMA takes in one register), its
    bytes 1 and 3 the pair 16 further; a code word's nibbles q and 4 + q are quarter q's pair: one shift and mask of
    a word gives two values of one quarter. Every value of a group sits once in each plane."""
    from esftctl.kernels.fixed_rate_moe import CODE_AT, SM_AT

    assert sorted(SM_AT.reshape(-1).tolist()) == list(range(64)) == sorted(CODE_AT.reshape(-1).tolist())
    assert torch.equal(SM_AT[:, 2] - SM_AT[:, 0], torch.ones(16, dtype=torch.long))
    assert torch.equal(SM_AT[:, 1] - SM_AT[:, 0], torch.full((16,), 16))
    assert torch.equal(CODE_AT[:, 4:] - CODE_AT[:, :4], torch.ones(8, 4, dtype=torch.long))
    w = exact_weights(1, 1, 128, "none", seed=2)
    t = encode_tiled(w)
    bits = w.view(torch.int16).to(torch.int32).view(-1) & 0xFFFF
    sm, code = ((bits >> 8) & 0x80) | (bits & 0x7F), ((bits >> 7) & 0xFF) - int(t.base[0])
    for g in range(2):
        for word in range(16):
            value = int(t.sm[0, 0, 16 * g + word]) & 0xFFFFFFFF
            for byte in range(4):
                assert (value >> (8 * byte)) & 0xFF == int(sm[64 * g + SM_AT[word, byte]])
        for word in range(8):
            value = int(t.codes[0, 0, 8 * g + word]) & 0xFFFFFFFF
            for nibble in range(8):
                assert (value >> (4 * nibble)) & 15 == int(code[64 * g + CODE_AT[word, nibble]])


def test_trained_like_weights_take_about_079_of_bf16():
    from esftctl.bench.synthetic_model import trained_like

    w = trained_like((2, 1408, 2048), torch.Generator().manual_seed(0))
    t = encode_tiled(w)
    t.check()
    assert _same(decode_tiled_reference(t), w)
    groups = t.raw_at.numel()
    assert 0.01 < t.raw.shape[0] / groups < 0.05  # groups with an escape: their exponents whole
    assert 0.78 < t.nbytes / (2 * w.numel()) < 0.80


def test_check_refuses_what_would_read_outside_the_buffers_or_lose_an_escape():
    t = encode_tiled(exact_weights(2, 4, 128, "rare", seed=3))
    t.check()
    at = t.raw_at.clone()
    e, n, g = ((at >= 0) & (at.flip(-1) < 0)).nonzero()[0].tolist()  # a raw group whose row's other group is not
    moved = at.clone()
    moved[e, n, g], moved[e, n, 1 - g] = -1, at[e, n, g]  # the raw group named on the other group of its row
    bad = {
        "raw_at past raw": replace(t, raw_at=torch.where(at >= 0, at + 1, at)),
        "a lost escape": replace(t, raw_at=torch.full_like(at, -1), raw=t.raw[:0]),
        "raw group elsewhere": replace(t, raw_at=moved),
        "dtype": replace(t, codes=t.codes.to(torch.int64)),
        "shape": replace(t, sm=t.sm[:, :, :-1].contiguous()),
        "k": replace(t, k=96, sm=t.sm[:, :, :24].contiguous(), codes=t.codes[:, :, :12].contiguous()),
        "window": replace(t, base=t.base + 250),
    }
    for name, wrong in bad.items():
        with pytest.raises(ValueError, match="fixed-rate"):
            wrong.check()
    with pytest.raises(ValueError, match="multiple of 64"):
        encode_tiled(exact_weights(1, 4, 96, "none", 0))


def test_rare_escapes_are_rare_and_exact_weights_are_exact():
    """The test inputs do what they say: `rare` escapes a few values of each expert, and the reference's fp32 sums
    equal exact (fp64) ones."""
    from esftctl.kernels.fixed_rate_moe import fused_moe_tiled_reference

    for escapes, (low, high) in {"none": (0, 0), "rare": (2, 19), "many": (100, 10 ** 9)}.items():
        w = exact_weights(4, 64, 256, escapes, seed=3)
        t = encode_tiled(w)
        per_expert = (t.raw_at >= 0).view(4, -1).sum(1)
        assert int(per_expert.min()) >= low and int(per_expert.max()) <= high, (escapes, per_expert)
        x = exact_inputs(5, 256, seed=4)
        weights, ids = routing(5, 4, 2, seed=5)
        got = fused_moe_tiled_reference(x, t, weights, ids, False, 2, block_k=64)
        exact = torch.einsum("pnk,pk->pn", w[ids.reshape(-1).long()].double(), x.double().repeat_interleave(2, 0))
        assert _same(got, exact.float().to(torch.bfloat16)), escapes


# ---- the kernel against vLLM's, in Triton's interpreter ---------------------------------------------------------

def vllm_kernel():
    """vLLM's `fused_moe_kernel` as a Triton kernel: imported from vLLM where its Triton is live (the CUDA build);
    else (vLLM's CPU build, whose Triton placeholder leaves it a plain function) compiled from its installed
    source, with `write_zeros_to_output` beside it, for Triton's interpreter."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_moe_kernel

        return fused_moe_kernel
    import triton
    import triton.language as tl

    path = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    source = (path / "model_executor/layers/fused_moe/fused_moe.py").read_text()
    lines = source.splitlines()
    namespace = {"triton": triton, "tl": tl}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in ("write_zeros_to_output", "fused_moe_kernel"):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            exec(compile("\n".join(lines[first - 1:node.end_lineno]), str(path), "exec"), namespace)
    return namespace["fused_moe_kernel"]


def interpreter_bf16_as_on_gpus() -> None:
    """Make Triton's interpreter do the two bf16 operations of these kernels as a GPU does. It keeps bf16 as
    uint16 bit patterns, and (Triton 3.9) its `tl.dot` multiplies those patterns, not the values
    (triton-lang/triton#11584: "not supported yet"), and its fp32 -> bf16 cast truncates where a GPU rounds to
    nearest even. Both kernels get the same dot and cast, so they match either way; the reference needs the
    GPU's arithmetic. Here the dot converts bf16 operands to fp32 values (as the interpreter's own upcast does)
    before its same np.matmul, and the downcast rounds as torch (and the GPU's cvt.rn) does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "bf16_as_on_gpus", False):
        return
    dot, cast = builder.create_dot, builder.cast_impl

    def value(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data.reshape(x.data.shape), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, value(a), value(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(rounded.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl, builder.bf16_as_on_gpus = create_dot, cast_impl, True


def launch_vllm(kernel, a, b, c, topk_weights, sorted_ids, expert_ids, post_padded, mul_routed_weight, top_k,
                config):
    """vLLM's kernel launched as its `invoke_fused_moe_triton_kernel` launches it for unquantized bf16 (no
    scales, no bias, SWAP_AB off, no tensor descriptors): same EM, grid and arguments."""
    import triton
    import triton.language as tl

    m = a.shape[0]
    if sorted_ids is not None:
        em = sorted_ids.numel()
        if m < config["BLOCK_SIZE_M"]:
            em = min(em, m * top_k * config["BLOCK_SIZE_M"])
    else:
        em = m * top_k * config["BLOCK_SIZE_M"]
    config = dict(config, SPLIT_K=1)
    block_k = config.pop("BLOCK_SIZE_K")
    grid = (triton.cdiv(em, config["BLOCK_SIZE_M"]) * triton.cdiv(b.shape[1], config["BLOCK_SIZE_N"]),)
    kernel[grid](a, b, c, None, None, None, topk_weights, sorted_ids, expert_ids, post_padded, b.shape[1],
                 b.shape[2], em, m * top_k, a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1),
                 c.stride(1), c.stride(2), 0, 0, 0, 0, 0, 0, 0, 0, 0, MUL_ROUTED_WEIGHT=mul_routed_weight,
                 top_k=top_k, compute_type=tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a8=False,
                 use_int8_w8a16=False, per_channel_quant=False, naive_block_assignment=sorted_ids is None,
                 HAS_BIAS=False, BLOCK_SIZE_K=block_k, SWAP_AB=False, **config)


def run_case(*, experts: int, hidden: int, intermediate: int, tokens: int, top_k: int, escapes: str,
             config: dict, seed: int, naive: bool = False, minus_one: bool = False, exact: bool = True,
             device: str = "cpu", launch=None, align=None, corrupt=None, fused_kernel=None) -> dict:
    """Both products of one MoE layer (w13: a [tokens, H] into [tokens, top_k, 2I]; w2: [pairs, I] into
    [tokens, top_k, H], routed weights applied there as vLLM does) through the fused kernel on the layout and
    vLLM's kernel on the decoded weights (`launch`, default `launch_vllm` of `vllm_kernel`), each with `config`,
    pairs aligned by `align` (default `moe_align_reference`): {product: (fused, vLLM's, reference)}. `corrupt`
    changes the layout the fused kernel gets (after the checks): the tests that show a broken escape path fails.
    `fused_kernel`: another launch with invoke_fused_moe_tiled's arguments (the CuTe DSL design's)."""
    from esftctl.bench.synthetic_model import trained_like
    from esftctl.kernels.fixed_rate_moe import fused_moe_tiled_reference, invoke_fused_moe_tiled, moe_align_reference

    if launch is None:
        interpreter_bf16_as_on_gpus()
        kernel = vllm_kernel()
        launch = lambda *args: launch_vllm(kernel, *args)  # noqa: E731
    align = align or moe_align_reference
    shapes = {"w13": (2 * intermediate, hidden), "w2": (hidden, intermediate)}
    weights, ids = routing(tokens, experts, top_k, seed)
    weights, ids = weights.to(device), ids.to(device)
    if naive:
        sorted_ids, expert_ids = None, ids.view(-1)
        post = torch.full((1,), ids.numel() * config["BLOCK_SIZE_M"], dtype=torch.int32, device=device)
    else:
        sorted_ids, expert_ids, post = align(ids, config["BLOCK_SIZE_M"], experts)
        if minus_one:  # expert parallelism: a block of another rank's expert is written as zeros
            expert_ids = expert_ids.clone()
            expert_ids[0] = -1
    out = {}
    for name, (n, k) in shapes.items():
        if exact:
            w = exact_weights(experts, n, k, escapes, seed + n)
        else:
            w = trained_like((experts, n, k), torch.Generator().manual_seed(seed + n))
        tiled = encode_tiled(w.to(device))
        tiled.check()
        assert _same(decode_tiled_reference(tiled.to("cpu")), w)
        m, top = (tokens, top_k) if name == "w13" else (tokens * top_k, 1)
        a = exact_inputs(m, k, seed + k).to(device) if exact else \
            (torch.randn(m, k, generator=torch.Generator().manual_seed(seed + k)) / 4).bfloat16().to(device)
        mul = name == "w2"
        fused = torch.full((tokens, top_k, n), 3.0, dtype=torch.bfloat16, device=device)
        plain = fused.clone()
        (fused_kernel or invoke_fused_moe_tiled)(a, corrupt(tiled) if corrupt else tiled, fused, weights, sorted_ids,
                                                 expert_ids, post, mul, top, config)
        launch(a, w.to(device), plain, weights, sorted_ids, expert_ids, post, mul, top, config)
        ref = fused_moe_tiled_reference(a, tiled, weights, ids, mul, top, config["BLOCK_SIZE_K"]).view(fused.shape)
        out[name] = (fused.cpu(), plain.cpu(), ref.cpu())
    return out


def check_case(**case) -> None:
    """The fused kernel equals vLLM's bit for bit and (exact inputs) the reference too."""
    exact = case.get("exact", True)
    for name, (fused, plain, ref) in run_case(**case).items():
        assert _same(fused, plain), (name, case, (fused.float() - plain.float()).abs().max())
        if case.get("minus_one"):
            continue  # the -1 block's pairs are zeros in both kernels, not the reference's products
        if exact:
            assert _same(fused, ref), (name, case, (fused.float() - ref.float()).abs().max())
        else:
            assert (fused.float() - ref.float()).norm() <= 1e-2 * ref.float().norm(), (name, case)


CONFIGS = {  # vLLM's keys; K tiles of one, two and four groups
    "k64": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, SPLIT_K=1),
    "k128": dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=2, SPLIT_K=1),
    "k256": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, SPLIT_K=1),
}

INTERPRETED = """
import sys
sys.path.insert(0, {here!r})
from test_fixed_rate_moe import CONFIGS, check_case
for case in {cases!r}:
    case = dict(case)
    case["config"] = CONFIGS[case["config"]]
    check_case(**case)
print("ok")
"""

CASES = {
    # hidden 128, intermediate 192: w13's K one or two whole tiles, w2's K (192) a partial last tile at 128 and 256
    "no-escapes": [dict(experts=6, hidden=128, intermediate=192, tokens=9, top_k=2, escapes="none", config="k64",
                        seed=1)],
    "rare-escapes": [dict(experts=6, hidden=128, intermediate=192, tokens=9, top_k=2, escapes="rare", config=c,
                          seed=2) for c in ("k64", "k128", "k256")],
    "many-escapes": [dict(experts=4, hidden=256, intermediate=64, tokens=7, top_k=2, escapes="many", config="k128",
                          seed=3)],
    "naive-and-ep": [dict(experts=8, hidden=128, intermediate=64, tokens=1, top_k=2, escapes="many", config="k64",
                          seed=5, naive=True),
                     dict(experts=8, hidden=128, intermediate=64, tokens=5, top_k=2, escapes="rare", config="k64",
                          seed=6, minus_one=True)],
    "trained-like": [dict(experts=4, hidden=256, intermediate=128, tokens=6, top_k=2, escapes="trained",
                          config="k128", seed=7, exact=False)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_vllms_on_the_decoded_weights_in_the_interpreter(name):
    pytest.importorskip("triton")
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the kernels themselves (test_kernel_equals_vllms_on_cuda)")
    run_interpreted(INTERPRETED.format(here=str(HERE), cases=CASES[name]))


BROKEN = """
import sys
sys.path.insert(0, {here!r})
from dataclasses import replace
from test_fixed_rate_moe import CONFIGS, run_case, _same
wrong = {{
    "raw exponents": lambda t: replace(t, raw=t.raw ^ 0x01010101),
    "window": lambda t: replace(t, base=t.base + 1),
}}[{which!r}]
case = dict(experts=4, hidden=128, intermediate=64, tokens=6, top_k=2, escapes="rare", config=CONFIGS["k64"],
            seed=3, corrupt=wrong)
for name, (fused, plain, ref) in run_case(**case).items():
    assert not _same(fused, plain) and _same(plain, ref), name
print("ok")
"""


@pytest.mark.parametrize("which", ["raw exponents", "window"])
def test_a_wrong_exponent_path_gives_wrong_outputs_in_the_interpreter(which):
    """Both exponent paths are really taken and really matter: with the raw groups' exponents or the window changed,
    both products differ from vLLM's (which still equals the reference)."""
    pytest.importorskip("triton")
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("interpreter only")
    run_interpreted(BROKEN.format(here=str(HERE), which=which))


def test_the_launch_refuses_k_tiles_below_a_group():
    from esftctl.kernels.fixed_rate_moe import invoke_fused_moe_tiled

    pytest.importorskip("triton")
    t = encode_tiled(exact_weights(2, 4, 128, "none", 0))
    a, c = torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(1, 1, 4, dtype=torch.bfloat16)
    config = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1)
    with pytest.raises(ValueError, match=f"a multiple of {GROUP}"):
        invoke_fused_moe_tiled(a, t, c, None, None, torch.zeros(1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), False, 1, config)


# ---- on a GPU: the compiled kernels, vLLM's own launch and alignment ----------------------------------------------

def _vllm_on_cuda():
    import triton.language as tl
    from vllm.model_executor.layers.fused_moe.fused_moe import invoke_fused_moe_triton_kernel
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    def launch(a, b, c, weights, sorted_ids, expert_ids, post, mul, top_k, config):
        invoke_fused_moe_triton_kernel(a, b, c, None, None, weights, sorted_ids, expert_ids, post, mul, top_k,
                                       config, tl.bfloat16, False, False, False, False, False, None, None)
    return launch, moe_align_block_size


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_vllms_on_cuda(name):
    launch, align = _vllm_on_cuda()
    for case in CASES[name]:
        check_case(**dict(case, config=CONFIGS[case["config"]], device="cuda", launch=launch, align=align))
