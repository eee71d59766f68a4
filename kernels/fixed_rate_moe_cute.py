"""The fixed-rate expert GEMM in CUTLASS's Python DSL (CuTe DSL): B decoded from the code straight into the MMA's
registers, with no shared memory and no layout the compiler picks.

Why a second design. The Triton kernel (esftctl.kernels.fixed_rate_moe) decodes B as a [16, BLOCK_N] tile that
Triton then hands to its MMA in a register layout of Triton's choosing; keeping that layout vLLM's, and the escape
path out of the inner loop, cost registers and instructions (benchmarks/RESULTS.md). Here each thread builds, with
integer operations, exactly the registers `mma.sync.m16n8k16` takes from it, as Marlin does for int4: for B (K x N
= 16 x 8) thread lane holds column lane // 4 at K pairs 2 (lane % 4) and 2 (lane % 4) + 8, two bf16 a register.
The tile-ready layout of the Triton kernel already puts such pairs in the two halves of one masked word; this one
reorders a group's words so that a thread's words are adjacent (`CuteTiles`: one 16-byte load of its four
sign-mantissa words, one 8-byte load of its two code words, per weight row and group of 64 K values). A is read
from global memory in the same register layout (decode batches: a block of 16 pairs x MA), C written from the
accumulators. An escape group's exponents (`raw`, same reordering) are loaded only where the group has one.

The products are chained in K order, one m16n8k16 MMA per 16 K values, as vLLM's Triton kernel issues them with
`mma.sync` (its BLOCK_SIZE_M 16-32 configs), so the sums round alike there; vLLM's configs of 64 and more rows a
block use Hopper's wgmma instead. `decode_cute_reference` repeats the kernel's per-thread decode in PyTorch (the
words each register is built from, the K index it lands at): the CPU's check of the index arithmetic; the GPU tests
compare the kernel with vLLM's on the decoded weights.

Needs `nvidia-cutlass-dsl` (4.8; not a dependency of esftctl: compiled at run time on the device, or for sm_90a on a
machine without a GPU by `benchmarks/lab/fixed_rate_moe_cute_compile.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from esftctl.kernels.fixed_rate_moe import GROUP, TiledExperts, padded_pairs


@dataclass(frozen=True)
class CuteTiles:
    """TiledExperts with each group's words reordered for the threads: row (expert e, column j, group g, thread t)
    of `sm` holds sign-mantissa words t, t + 4, t + 8, t + 12 of that group (a thread's four), of `codes` code words
    t and t + 4, of `raw` (group r's row 4 r + t) raw words like `sm`."""

    n: int
    k: int
    sm: torch.Tensor  # int32 [E * n * k / 64 * 4, 4]
    codes: torch.Tensor  # int32 [E * n * k / 64 * 4, 2]
    base: torch.Tensor  # int32 [E]
    raw_at: torch.Tensor  # int32 [E * n * k / 64]: the group's raw row, or -1
    raw: torch.Tensor  # int32 [max(R, 1) * 4, 4]

    @classmethod
    def of(cls, t: TiledExperts) -> "CuteTiles":
        t.check()
        groups = t.k // GROUP
        sm = t.sm.view(t.experts, t.n, groups, 4, 4).transpose(-1, -2).reshape(-1, 4)
        codes = t.codes.view(t.experts, t.n, groups, 2, 4).transpose(-1, -2).reshape(-1, 2)
        raw = t.raw.view(-1, 4, 4).transpose(-1, -2).reshape(-1, 4) if t.raw.numel() else \
            torch.zeros(4, 4, dtype=torch.int32, device=t.sm.device)  # a real address with no escape
        return cls(t.n, t.k, sm.contiguous(), codes.contiguous(), t.base.contiguous(),
                   t.raw_at.reshape(-1).contiguous(), raw.contiguous())

    @property
    def experts(self) -> int:
        return self.base.numel()


def decode_cute_reference(tiles: CuteTiles) -> torch.Tensor:
    """The bf16 weights [E, N, K] as the kernel's threads build them, in PyTorch: for every weight row, group g,
    thread t, quarter q and register h (K pair 2 t + 8 h of the quarter), the pair from sign-mantissa word
    2 (q // 2) + h of the thread's four, shifted by 8 (q % 2), code word h shifted by 4 q (or the raw word where the
    group escapes), placed at K = 64 g + 16 q + 2 t + 8 h and the next."""
    e, n, k = tiles.experts, tiles.n, tiles.k
    groups = k // GROUP
    sm = tiles.sm.view(e, n, groups, 4, 4).to(torch.int64) & 0xFFFFFFFF  # [.., t, word]
    codes = tiles.codes.view(e, n, groups, 4, 2).to(torch.int64) & 0xFFFFFFFF
    at = tiles.raw_at.view(e, n, groups).long()
    raw = (tiles.raw.view(-1, 4, 4).to(torch.int64) & 0xFFFFFFFF)[at.clamp(min=0)]  # [e, n, g, t, word]
    base = tiles.base.long().view(e, 1, 1, 1)
    out = torch.empty(e, n, groups, 64, dtype=torch.int64, device=tiles.sm.device)
    for q in range(4):
        for h in range(2):
            shift = 8 * (q % 2)
            pair = (sm[..., 2 * (q // 2) + h] >> shift) & 0x00FF00FF
            sign_mantissa = (pair * 0x101) & 0x807F807F
            exp = ((codes[..., h] >> (4 * q)) & 0x000F000F) + (base | (base << 16))
            exp = torch.where((at >= 0)[..., None], (raw[..., 2 * (q // 2) + h] >> shift) & 0x00FF00FF, exp)
            word = (sign_mantissa | (exp << 7)) & 0xFFFFFFFF  # [e, n, g, t]
            for t in range(4):
                kk = 16 * q + 2 * t + 8 * h
                out[..., kk] = word[..., t] & 0xFFFF
                out[..., kk + 1] = word[..., t] >> 16
    bits = out.view(e, n, k)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


try:
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    I32 = cutlass.Int32

    @cute.jit
    def _load_group(sm: cute.Tensor, codes: cute.Tensor, raw_at: cute.Tensor, raw: cute.Tensor, expert: I32, n: I32,
                    column: I32, t: I32, groups: I32, grp: I32, dsm: cute.Tensor, dcw: cute.Tensor, drw: cute.Tensor,
                    dwhr: cute.Tensor, NA: cutlass.Constexpr):
        """A thread's words of group `grp` for its NA columns: four sign-mantissa words (one 16-byte load), two code
        words (8 bytes), and where the group escapes its four raw exponent words (else zeros)."""
        for na in cutlass.range_constexpr(NA):
            row = (expert * n + (column + 8 * na) % n) * groups + grp  # wrapped, as vLLM's B rows
            words = sm[row * 4 + t, None].load()
            code_words = codes[row * 4 + t, None].load()
            for j in cutlass.range_constexpr(4):
                dsm[j, na] = words[j]
            for j in cutlass.range_constexpr(2):
                dcw[j, na] = code_words[j]
            where = raw_at[row]
            dwhr[na] = where
            for j in cutlass.range_constexpr(4):
                drw[j, na] = 0
            if where >= 0:
                raw_words = raw[where * 4 + t, None].load()
                for j in cutlass.range_constexpr(4):
                    drw[j, na] = raw_words[j]

    @cute.kernel
    def _kernel(a_ptr: cute.Pointer, c_ptr: cute.Pointer, w_ptr: cute.Pointer, sorted_ptr: cute.Pointer,
                experts_ptr: cute.Pointer, ntpp_ptr: cute.Pointer, sm_ptr: cute.Pointer, codes_ptr: cute.Pointer,
                base_ptr: cute.Pointer, raw_at_ptr: cute.Pointer, raw_ptr: cute.Pointer,
                n: I32, k: I32, num_valid: I32, stride_am: I32, stride_cm: I32,
                TOP_K: cutlass.Constexpr, MUL_ROUTED: cutlass.Constexpr, MA: cutlass.Constexpr,
                NA: cutlass.Constexpr, WARPS: cutlass.Constexpr, NAIVE: cutlass.Constexpr):
        """Block (pid_m, pid_n): pairs [16 MA pid_m, 16 MA (pid_m + 1)) of the sorted list (or pair pid_m alone,
        naive) times columns [8 NA WARPS pid_n, ...) of their expert; warp w takes NA MMA columns of 8."""
        tidx, _, _ = cute.arch.thread_idx()
        pid_m, pid_n, _ = cute.arch.block_idx()
        lane, warp = tidx % 32, tidx // 32
        g, t = lane // 4, lane % 4  # the MMA's group (B's column, A's and C's row) and thread in it (K pair)
        block_m, groups = 16 * MA, k // 64

        tiled = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)))
        thr = tiled.get_slice(lane)
        fa = tiled.make_fragment_A(thr.partition_shape_A((16, 16)))
        fbs = [tiled.make_fragment_B(thr.partition_shape_B((8, 16))) for _ in range(NA)]
        ia = cute.recast_tensor(fa, I32)  # a0a1 (row g, K 2t), a2a3 (row g + 8), a4a5 (row g, K 2t + 8), a6a7
        ibs = [cute.recast_tensor(fb, I32) for fb in fbs]  # b0b1 (K 2t), b2b3 (K 2t + 8)
        accs = [[tiled.make_fragment_C(thr.partition_shape_C((16, 8))) for _ in range(NA)] for _ in range(MA)]
        for row in accs:
            for acc in row:
                acc.fill(0.0)

        flat = cute.make_layout(1 << 30)
        if pid_m * block_m < cute.make_tensor(ntpp_ptr, flat)[0]:
            sorted_ids = cute.make_tensor(sorted_ptr, flat)
            pair = cute.make_rmem_tensor((2, MA), I32)  # rows g and g + 8 of each M atom
            for ma in cutlass.range_constexpr(MA):
                for h in cutlass.range_constexpr(2):
                    r = 16 * ma + 8 * h + g
                    if cutlass.const_expr(NAIVE):  # the block's first row is pair pid_m, the others none
                        first = num_valid
                        if r == 0:
                            first = pid_m
                        pair[h, ma] = first
                    else:
                        pair[h, ma] = sorted_ids[pid_m * block_m + r]
            expert = cute.make_tensor(experts_ptr, flat)[pid_m]
            a = cute.make_tensor(a_ptr, flat)  # bf16 pairs as int32 words
            column = pid_n * (8 * NA * WARPS) + warp * (8 * NA) + g  # + 8 na: this thread's B column
            if expert >= 0:  # -1: another expert-parallel rank's expert (zeros, as vLLM writes)
                base = cute.make_tensor(base_ptr, flat)[expert]
                base2 = base | (base << 16)
                sm = cute.make_tensor(sm_ptr, cute.make_layout((1 << 28, 4), stride=(4, 1)))
                codes = cute.make_tensor(codes_ptr, cute.make_layout((1 << 28, 2), stride=(2, 1)))
                raw_at = cute.make_tensor(raw_at_ptr, flat)
                raw = cute.make_tensor(raw_ptr, cute.make_layout((1 << 28, 4), stride=(4, 1)))
                # B's words of group grp + 1 are loaded while group grp's are decoded and multiplied: one load's
                # latency a group is hidden behind the previous group's MMAs
                smw = cute.make_rmem_tensor((4, NA), I32)
                cw = cute.make_rmem_tensor((2, NA), I32)
                rw = cute.make_rmem_tensor((4, NA), I32)
                whr = cute.make_rmem_tensor(NA, I32)
                nsm = cute.make_rmem_tensor((4, NA), I32)
                ncw = cute.make_rmem_tensor((2, NA), I32)
                nrw = cute.make_rmem_tensor((4, NA), I32)
                nwhr = cute.make_rmem_tensor(NA, I32)

                _load_group(sm, codes, raw_at, raw, expert, n, column, t, groups, 0, smw, cw, rw, whr, NA)
                for grp in cutlass.range(groups):
                    _load_group(sm, codes, raw_at, raw, expert, n, column, t, groups, cutlass.min(grp + 1, groups - 1),
                                nsm, ncw, nrw, nwhr, NA)
                    for q in cutlass.range_constexpr(4):
                        for na in cutlass.range_constexpr(NA):
                            for h in cutlass.range_constexpr(2):
                                word = smw[2 * (q // 2) + h, na]
                                pr = (word >> (8 * (q % 2))) & 0x00FF00FF
                                sign_mantissa = (pr * 0x101) & -0x7F807F81  # 0x807F807F as an int32
                                exp = ((cw[h, na] >> (4 * q)) & 0x000F000F) + base2
                                if whr[na] >= 0:
                                    exp = (rw[2 * (q // 2) + h, na] >> (8 * (q % 2))) & 0x00FF00FF
                                ibs[na][h] = sign_mantissa | (exp << 7)
                        for ma in cutlass.range_constexpr(MA):
                            for h in cutlass.range_constexpr(2):
                                for kh in cutlass.range_constexpr(2):
                                    p = pair[h, ma]
                                    v = I32(0)
                                    if p < num_valid:
                                        v = a[((p // TOP_K) * stride_am + grp * 64 + 16 * q + 2 * t + 8 * kh) // 2]
                                    ia[h + 2 * kh] = v
                            for na in cutlass.range_constexpr(NA):
                                cute.gemm(tiled, accs[ma][na], fa, fbs[na], accs[ma][na])
                    smw.store(nsm.load())
                    cw.store(ncw.load())
                    rw.store(nrw.load())
                    whr.store(nwhr.load())
            c = cute.make_tensor(c_ptr, flat)  # bf16 pairs as int32 words
            weights = cute.make_tensor(w_ptr, flat)
            for ma in cutlass.range_constexpr(MA):
                for h in cutlass.range_constexpr(2):
                    p = pair[h, ma]
                    if p < num_valid:
                        scale = cutlass.Float32(1.0)
                        if cutlass.const_expr(MUL_ROUTED):  # in fp32, before the one cast, as vLLM
                            scale = weights[p]
                        for na in cutlass.range_constexpr(NA):
                            col = pid_n * (8 * NA * WARPS) + warp * (8 * NA) + 8 * na + 2 * t
                            if col < n:
                                out = cute.make_rmem_tensor(2, cutlass.BFloat16)
                                out[0] = (accs[ma][na][2 * h] * scale).to(cutlass.BFloat16)
                                out[1] = (accs[ma][na][2 * h + 1] * scale).to(cutlass.BFloat16)
                                c[(p * stride_cm + col) // 2] = cute.recast_tensor(out, I32)[0]

    @cute.jit
    def _launch(a_ptr: cute.Pointer, c_ptr: cute.Pointer, w_ptr: cute.Pointer, sorted_ptr: cute.Pointer,
                experts_ptr: cute.Pointer, ntpp_ptr: cute.Pointer, sm_ptr: cute.Pointer, codes_ptr: cute.Pointer,
                base_ptr: cute.Pointer, raw_at_ptr: cute.Pointer, raw_ptr: cute.Pointer,
                n: I32, k: I32, num_valid: I32, stride_am: I32, stride_cm: I32, grid_m: I32,
                stream: cuda_driver.CUstream, TOP_K: cutlass.Constexpr, MUL_ROUTED: cutlass.Constexpr,
                MA: cutlass.Constexpr, NA: cutlass.Constexpr, WARPS: cutlass.Constexpr, NAIVE: cutlass.Constexpr):
        grid_n = (n + 8 * NA * WARPS - 1) // (8 * NA * WARPS)
        _kernel(a_ptr, c_ptr, w_ptr, sorted_ptr, experts_ptr, ntpp_ptr, sm_ptr, codes_ptr, base_ptr, raw_at_ptr,
                raw_ptr, n, k, num_valid, stride_am, stride_cm, TOP_K, MUL_ROUTED, MA, NA, WARPS,
                NAIVE).launch(grid=[grid_m, grid_n, 1], block=[32 * WARPS, 1, 1], stream=stream)

except ImportError:  # the DSL is optional: without it the kernel is not there, the layout and reference are
    cute = None

DEFAULT_CONFIG = {"BLOCK_SIZE_M": 16, "NA": 2, "WARPS": 4}
_compiled: dict[tuple, Any] = {}


def _pointers(*tensors: torch.Tensor | None) -> list:
    """The kernel's 11 pointer arguments: every one int32 words but the routed weights' (float32, the third)."""
    return [make_ptr(cutlass.Float32 if k == 2 else cutlass.Int32, 0 if t is None else t.data_ptr(),
                     cute.AddressSpace.gmem, assumed_align=16) for k, t in enumerate(tensors)]


def compile_tiled_cute(*, top_k: int, mul_routed_weight: bool, config: dict[str, int], naive: bool = False,
                       options: str = "") -> Any:
    """The compiled kernel for these compile-time settings (cached); on a machine without a GPU, for the
    architecture CUTE_DSL_ARCH names (sm_90a for an H100 or H200), with `options` ("--keep-ptx")."""
    if cute is None:
        raise RuntimeError("the CuTe DSL kernel needs nvidia-cutlass-dsl")
    block_m = config["BLOCK_SIZE_M"]
    if block_m % 16:
        raise ValueError(f"BLOCK_SIZE_M of {block_m}: a multiple of 16")
    key = (top_k, mul_routed_weight, block_m // 16, config["NA"], config["WARPS"], naive, options)
    if key not in _compiled:
        args = _pointers(*[None] * 11) + [I32(1)] * 6 + [cuda_driver.CUstream(0)]
        _compiled[key] = cute.compile(_launch, *args, top_k, mul_routed_weight, block_m // 16, config["NA"],
                                      config["WARPS"], naive, options=options)
    return _compiled[key]


def invoke_fused_moe_tiled_cute(a: torch.Tensor, tiles: CuteTiles, c: torch.Tensor, topk_weights: torch.Tensor | None,
                                sorted_token_ids: torch.Tensor | None, expert_ids: torch.Tensor,
                                num_tokens_post_padded: torch.Tensor, mul_routed_weight: bool, top_k: int,
                                config: dict[str, int] | None = None) -> None:
    """One expert GEMM with the arguments of esftctl.kernels.fixed_rate_moe.invoke_fused_moe_tiled (vLLM's), `tiles`
    for B, on the current stream: c[m, j, :] = a's row (pair // top_k) times its expert's weights (times its routed
    weight if asked). `config`: BLOCK_SIZE_M (16 per M atom), NA (MMA columns of 8 a warp), WARPS."""
    config = {**DEFAULT_CONFIG, **(config or {})}
    if a.dtype != torch.bfloat16 or c.dtype != torch.bfloat16 or not a.is_cuda:
        raise ValueError(f"bf16 CUDA activations and output, not {a.dtype} on {a.device} and {c.dtype}")
    if a.dim() != 2 or a.shape[1] != tiles.k or c.dim() != 3 or c.shape[2] != tiles.n or tiles.n % 2:
        raise ValueError(f"a [M, {tiles.k}] and c [M, top_k, {tiles.n}] (N even), not {tuple(a.shape)} and "
                         f"{tuple(c.shape)}")
    if a.stride(1) != 1 or a.stride(0) % 2 or c.stride(2) != 1 or c.stride(1) % 2 or not c.is_contiguous():
        raise ValueError("a and c with unit inner strides and even row strides")
    if mul_routed_weight and (topk_weights is None or topk_weights.dtype != torch.float32
                              or not topk_weights.is_contiguous()):
        raise ValueError("the routed weights: float32 [M, top_k], contiguous")
    m, block_m = a.shape[0], config["BLOCK_SIZE_M"]
    em = padded_pairs(m, top_k, block_m, sorted_token_ids)
    kernel = compile_tiled_cute(top_k=top_k, mul_routed_weight=mul_routed_weight, config=config,
                                naive=sorted_token_ids is None)
    stream = cuda_driver.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    kernel(*_pointers(a, c, topk_weights if mul_routed_weight else None, sorted_token_ids, expert_ids,
                      num_tokens_post_padded, tiles.sm, tiles.codes, tiles.base, tiles.raw_at, tiles.raw),
           I32(tiles.n), I32(tiles.k), I32(m * top_k), I32(a.stride(0)), I32(c.stride(1)), I32(-(-em // block_m)),
           stream)
