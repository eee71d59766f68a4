"""An expert GEMM that reads the fixed-rate code of its weights: vLLM's fused-MoE kernel with a decoding B load.

Why. Paging with the fixed-rate tier decodes every paged layer into a bf16 window that vLLM's fused-MoE kernel then
reads again: 0.75 (codes) + 1.0 (write) + 1.0 (reread) = 2.75x the expert bytes of a resident step, which is why the
tier loses to plain vLLM where memory binds (benchmarks/RESULTS.md, Paging). A GEMM that decodes its B tile from
the code where it loads it reads 0.78x the bytes, with no window and no decode pass.

The layout (`TiledExperts`, built offline by `encode_tiled` from bf16 weights [E, N, K], K a multiple of 64): each
value is its bf16 bits' sign and mantissa (a byte, `s`) and a 4-bit code of its exponent, `base + code` for code
0-14, where `base` is the expert's window of 15 consecutive exponents holding the most of its values (no table to
gather), 15 an escape. Within every 64 values of a weight row (a group, the K tile's smallest unit), the
sign-mantissa bytes sit four to an int32 word (16 words) and the codes eight to an int32 (8 words), placed
(`SM_AT`, `CODE_AT`) so that one shift and mask of a word leaves two K-adjacent values of one quarter of the group
(16 consecutive K values) in its two 16-bit halves: the pair a thread hands the MMA in one register. Every
operation of the decode then builds two values. A quarter is a product over K of 16, one MMA step; chained in K
order, the quarters' products are the MMA steps vLLM's kernel issues for its whole K tile, in the same order, so
the sums round alike. A group with any escape keeps its 64 exponents whole (`raw`, 16 int32 words placed like the
bytes, found through `raw_at`, -1 for none); the kernel loads them with a mask that is off in every other group (a
predicated load that moves no bytes), so the escape path has no branch and no prefix sum.

Why words and not bytes: Triton picks the MMA operands' register layout from the narrowest load in B's backward
slice, and byte loads there gave other K indices to each thread than vLLM's bf16 B gets (the first fused prototype
was inexact so; the second cut the slice with a branch that cost it 206-255 registers a thread against vLLM's
63-72). The words are 32 bits wide, the values 16 after the split of each pair.

Size, per value: 1 byte + 4 bits + an int32 index per 64 values + 64 bytes per group with an escape (2-3% of groups
on trained-like weights): about 0.79 of bf16 (`TiledExperts.nbytes`).

`fused_moe_tiled_kernel` is vLLM's unquantized bf16 `fused_moe_kernel` (vLLM 0.25, model_executor/layers/fused_moe/
fused_moe.py, Apache-2.0; the reference for behaviour, written here anew) on its default path (no SWAP_AB, no tensor
descriptors, no bias, no quantization): the same program-to-tile mapping, the same token blocks from
`moe_align_block_size` or the naive assignment, the same masks and routed-weight product in fp32, one cast. Its B
tile comes from the layout above. `fused_moe_tiled_reference` is the plain PyTorch reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GROUP = 64  # K values of a group: the interleave period, the escape unit and the smallest K tile the kernel takes
WORDS = GROUP // 4  # sign-mantissa (and raw exponent) words of a group's row: four values each
ESCAPE = 15


@dataclass(frozen=True)
class TiledExperts:
    """Expert weights [E, n, k] (w13: n = 2 I, k = H; w2: n = H, k = I) in the fused kernel's layout."""

    n: int
    k: int
    sm: torch.Tensor  # int32 [E, n, k / 4]: four sign-mantissa bytes a word (SM_AT)
    codes: torch.Tensor  # int32 [E, n, k / 8]: eight 4-bit exponent codes a word (CODE_AT)
    base: torch.Tensor  # int32 [E]: the exponent of code 0
    raw_at: torch.Tensor  # int32 [E, n, k / 64]: the group's row of `raw`, or -1 (no escape in the group)
    raw: torch.Tensor  # int32 [R, 16]: a group's 64 exponents, interleaved as the sign-mantissa bytes

    @property
    def experts(self) -> int:
        return self.sm.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.sm, self.codes, self.base, self.raw_at, self.raw))

    def to(self, device) -> "TiledExperts":
        return TiledExperts(self.n, self.k, *(t.to(device) for t in (self.sm, self.codes, self.base, self.raw_at,
                                                                      self.raw)))

    def check(self) -> None:
        """ValueError unless every read of the kernel stays inside these buffers and every escape is kept."""
        e, n, k = self.experts, self.n, self.k
        if n < 1 or k < GROUP or k % GROUP:
            raise ValueError(f"fixed-rate tiles of {n} x {k} values: k a multiple of {GROUP}")
        shapes = {"sm": (self.sm, (e, n, k // 4), torch.int32), "codes": (self.codes, (e, n, k // 8), torch.int32),
                  "base": (self.base, (e,), torch.int32), "raw_at": (self.raw_at, (e, n, k // GROUP), torch.int32)}
        for name, (t, shape, dtype) in shapes.items():
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"fixed-rate tiles' {name}: {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
        if self.raw.dtype != torch.int32 or self.raw.dim() != 2 or self.raw.shape[1] != WORDS:
            raise ValueError(f"fixed-rate tiles' raw exponents: {self.raw.dtype} {tuple(self.raw.shape)}, expected "
                             f"torch.int32 [R, {WORDS}]")
        base = self.base.cpu()
        if base.numel() and (int(base.min()) < 0 or int(base.max()) > 255 - 14):
            raise ValueError("fixed-rate tiles' exponent windows must lie in 0..255")
        at = self.raw_at.cpu()
        used = at[at >= 0]
        if (at.numel() and int(at.min()) < -1) or not torch.equal(used.sort().values.long(),
                                                                  torch.arange(self.raw.shape[0])):
            raise ValueError("fixed-rate tiles' raw_at must name every raw group once")
        escaped = (_unpack(self.codes.cpu(), CODE_AT, 4) == ESCAPE).view(e, n, k // GROUP, GROUP).any(-1)
        if not torch.equal(escaped, at >= 0):
            raise ValueError("fixed-rate tiles' raw groups are not the groups with escapes")


def _positions() -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of a group's 64 values sits: SM[w, p] is the K index of byte p of sign-mantissa word w (16 words),
    CODE[i, j] that of nibble j of code word i (8 words). Word 8 h + i's bytes 0 and 2 are the values at 32 h + 2 i
    and the next, bytes 1 and 3 those 16 further: one mask of the word leaves two K-adjacent values in its two
    halves, the pair a thread hands the MMA in one register. Code word i's nibble q holds the value at 16 q + 2 i,
    nibble 4 + q the next."""
    sm = torch.empty(16, 4, dtype=torch.long)
    for h in range(2):
        for i in range(8):
            for p in range(4):
                sm[8 * h + i, p] = 32 * h + 16 * (p & 1) + 2 * i + (p >> 1)
    code = torch.empty(8, 8, dtype=torch.long)
    for i in range(8):
        for j in range(8):
            code[i, j] = 16 * (j % 4) + 2 * i + j // 4
    return sm, code


SM_AT, CODE_AT = _positions()


def _pack(fields: torch.Tensor, at: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., K] fields of `bits` bits -> [..., K / 64 * words] int32 words, field j of word w the value at
    at[w, j] of its group."""
    f = fields.to(torch.int64).view(*fields.shape[:-1], -1, GROUP)[..., at.to(fields.device)]  # [..., G, W, F]
    w = sum(f[..., j] << (bits * j) for j in range(at.shape[1]))
    w = torch.where(w >= 1 << 31, w - (1 << 32), w)
    return w.reshape(*fields.shape[:-1], -1).to(torch.int32)


def _unpack(words: torch.Tensor, at: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `_pack`: [..., K / 64 * words] int32 -> [..., K] fields."""
    w = words.to(torch.int64).view(*words.shape[:-1], -1, at.shape[0]) & 0xFFFFFFFF  # [..., G, W]
    f = torch.stack([(w >> (bits * j)) & ((1 << bits) - 1) for j in range(at.shape[1])], -1)  # [..., G, W, F]
    out = torch.empty(*f.shape[:-2], GROUP, dtype=torch.int64, device=words.device)
    out[..., at.reshape(-1).to(words.device)] = f.reshape(*f.shape[:-2], -1)
    return out.reshape(*words.shape[:-1], -1)


def encode_tiled(weights: torch.Tensor) -> TiledExperts:
    """bf16 expert weights [E, N, K] (K a multiple of 64) in the kernel's layout, with torch ops on their device."""
    if weights.dim() != 3 or weights.dtype != torch.bfloat16:
        raise ValueError(f"expert weights bf16 [E, N, K], not {weights.dtype} {tuple(weights.shape)}")
    e, n, k = weights.shape
    if k % GROUP:
        raise ValueError(f"fixed-rate tiles need K a multiple of {GROUP}, not {k}")
    bits = weights.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    exp = (bits >> 7) & 0xFF
    sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
    hist = torch.zeros(e, 256 + 15, dtype=torch.int64, device=weights.device)
    hist.scatter_add_(1, exp.view(e, -1).long(), torch.ones_like(exp.view(e, -1), dtype=torch.int64))
    window = hist.cumsum(1)
    covered = window[:, 14:256] - torch.nn.functional.pad(window, (1, 0))[:, :256 - 14]  # base 0..241
    base = covered.argmax(1).to(torch.int32)
    code = exp - base.view(e, 1, 1)
    escaped = (code < 0) | (code > 14)
    code = torch.where(escaped, ESCAPE, code)
    groups = escaped.view(e, n, k // GROUP, GROUP).any(-1)
    raw_at = torch.where(groups, groups.view(-1).cumsum(0).view(groups.shape) - 1, -1).to(torch.int32)
    picked = exp.view(e, n, k // GROUP, GROUP)[groups]  # [R, 64]
    raw = _pack(picked, SM_AT, 8) if picked.numel() else torch.zeros(0, WORDS, dtype=torch.int32,
                                                                     device=weights.device)
    return TiledExperts(n, k, _pack(sm, SM_AT, 8).contiguous(), _pack(code, CODE_AT, 4).contiguous(),
                        base.contiguous(), raw_at.contiguous(), raw.view(-1, WORDS).contiguous())


def decode_tiled_reference(t: TiledExperts) -> torch.Tensor:
    """The bf16 weights [E, N, K], in plain PyTorch."""
    sm = _unpack(t.sm, SM_AT, 8)
    exp = _unpack(t.codes, CODE_AT, 4) + t.base.view(-1, 1, 1).long()
    at = t.raw_at.long()
    if t.raw.numel():
        raw = _unpack(t.raw, SM_AT, 8).reshape(-1, GROUP)[at.clamp(min=0)]  # [E, N, K / 64, 64]
        exp = torch.where((at >= 0)[..., None], raw, exp.view(raw.shape)).view(exp.shape)
    bits = ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


def moe_align_reference(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """vLLM's `moe_align_block_size` in plain PyTorch (its CUDA op is not in vLLM's CPU build): (sorted_token_ids,
    expert_ids, num_tokens_post_padded) with the same sizes and meaning, each expert's pairs in pair order, padded
    with the pair count to a multiple of block_m."""
    flat = topk_ids.reshape(-1).long().cpu()
    pad = flat.numel()
    size = pad + num_experts * (block_m - 1)
    if pad < num_experts:
        size = min(pad * block_m, size)
    sorted_ids = torch.full((size,), pad, dtype=torch.int32)
    expert_ids = torch.zeros(-(-size // block_m), dtype=torch.int32)
    at = 0
    for e in range(num_experts):
        pairs = (flat == e).nonzero().reshape(-1)
        blocks = -(-pairs.numel() // block_m)
        sorted_ids[at:at + pairs.numel()] = pairs.to(torch.int32)
        expert_ids[at // block_m:at // block_m + blocks] = e
        at += blocks * block_m
    device = topk_ids.device
    return sorted_ids.to(device), expert_ids.to(device), torch.tensor([at], dtype=torch.int32, device=device)


def fused_moe_tiled_reference(a: torch.Tensor, experts: TiledExperts, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, mul_routed_weight: bool, top_k: int,
                              block_k: int) -> torch.Tensor:
    """What the kernel computes, in plain PyTorch: [pairs, N] bf16, for each (token, choice) pair p (topk_ids
    flattened) input row p // top_k times its expert's decoded weights, in fp32 summed tile by tile over K, times
    the pair's routed weight in fp32 if asked, cast once. Bit for bit the kernel's wherever fp32 sums are exact
    (the tests' exact inputs); elsewhere within fp32 rounding (the GPU's MMA orders its sums its own way)."""
    w = decode_tiled_reference(experts.to("cpu")).to(a.device)
    ids = topk_ids.reshape(-1).long()
    x = a[torch.arange(ids.numel(), device=a.device) // top_k].float()
    rows = w[ids].float()
    acc = torch.zeros(ids.numel(), experts.n, dtype=torch.float32, device=a.device)
    for k0 in range(0, experts.k, block_k):
        acc += (rows[:, :, k0:k0 + block_k] @ x[:, k0:k0 + block_k, None]).squeeze(-1)
    if mul_routed_weight:
        acc *= topk_weights.reshape(-1, 1).float()
    return acc.to(a.dtype)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def fused_moe_tiled_kernel(
            a_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
            sm_ptr, codes_ptr, base_ptr, raw_at_ptr, raw_ptr,
            N, K, EM, num_valid_tokens, stride_am, stride_ak, stride_cm, stride_cn,
            naive_block_assignment: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
            BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
            top_k: tl.constexpr, compute_type: tl.constexpr, EVEN_K: tl.constexpr):
        # The tile of C this program computes: vLLM's grouped ordering, unchanged.
        pid = tl.program_id(axis=0)
        num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
        num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
        num_pid_in_group = GROUP_SIZE_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_SIZE_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        # Its (token, choice) pairs: from moe_align_block_size, or one pair a block (vLLM's naive assignment).
        offs = tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
        if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
            return
        if not naive_block_assignment:
            offs_token = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_SIZE_M + offs)
        else:
            offs_token = tl.where(offs == 0, pid_m, num_valid_tokens)
        offs_token = offs_token.to(tl.int64)
        token_mask = offs_token < num_valid_tokens
        offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
        c_mask = token_mask[:, None] & (offs_cn[None, :] < N)

        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if expert == -1:  # an expert of another expert-parallel rank: zeros, as vLLM writes
            tl.store(c_ptrs, tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=compute_type), mask=c_mask)
            return

        offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N  # wrapped, as vLLM's
        rows = expert * N + offs_bn
        sm_rows = rows * (K // 4)  # [BLOCK_N]: each weight row's first sign-mantissa word
        code_rows = rows * (K // 8)
        group_rows = rows * (K // 64)
        base = tl.load(base_ptr + expert)
        base2 = base | (base << 16)  # the window's base in both halves of a word
        offs_w = tl.arange(0, 8)
        offs_q = tl.arange(0, 16)
        a_rows = a_ptr + (offs_token[:, None] // top_k) * stride_am
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
            for g in tl.static_range(BLOCK_SIZE_K // 64):
                k0 = k * BLOCK_SIZE_K + g * 64
                sm_at = sm_rows[None, :] + (k0 // 4 + offs_w)[:, None]  # [8, BLOCK_N]: words 0-7 of the group
                code_at = code_rows[None, :] + (k0 // 8 + offs_w)[:, None]
                if EVEN_K:
                    sm_lo = tl.load(sm_ptr + sm_at)
                    sm_hi = tl.load(sm_ptr + sm_at + 8)
                    codes = tl.load(codes_ptr + code_at)
                    at = tl.load(raw_at_ptr + group_rows + k0 // 64)
                else:  # a group past K: zeros, as vLLM's masked B load
                    inside = (offs_w * 0 + k0 < K)[:, None]  # [8, 1]
                    sm_lo = tl.load(sm_ptr + sm_at, mask=inside, other=0)
                    sm_hi = tl.load(sm_ptr + sm_at + 8, mask=inside, other=0)
                    codes = tl.load(codes_ptr + code_at, mask=inside, other=0)
                    at = tl.load(raw_at_ptr + group_rows + k0 // 64, mask=offs_bn * 0 + k0 < K, other=-1)
                raw = (at >= 0)[None, :]
                # A group with an escape: its exponents whole (a load that moves no bytes elsewhere).
                raw_at = at.to(tl.int64)[None, :] * 16 + offs_w[:, None]
                raw_lo = tl.load(raw_ptr + raw_at, mask=raw, other=0)
                raw_hi = tl.load(raw_ptr + raw_at + 8, mask=raw, other=0)
                for q in tl.static_range(4):
                    # Two K-adjacent values a 32-bit lane (k0 + 16 q + 2 i and the next, in its two halves): each
                    # byte twice in 16 bits puts its sign at bit 15 and its mantissa at bits 0-6, the exponent goes
                    # between; every operation here builds two values.
                    words = sm_lo if q < 2 else sm_hi
                    pair = (words >> (8 * (q % 2))) & 0x00FF00FF
                    sign_mantissa = (pair * 0x101) & -0x7F807F81  # 0x807F807F as an int32
                    exp = ((codes >> (4 * q)) & 0x000F000F) + base2
                    exp = tl.where(raw, ((raw_lo if q < 2 else raw_hi) >> (8 * (q % 2))) & 0x00FF00FF, exp)
                    pairs = sign_mantissa | (exp << 7)
                    if not EVEN_K:
                        pairs = tl.where(inside, pairs, 0)
                    # [8, BLOCK_N] pairs -> [16, BLOCK_N] values in K order (the pair's halves stay in one thread)
                    values = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))  # [8, BLOCK_N, 2]
                    values = tl.reshape(tl.permute(values, (0, 2, 1)), (16, BLOCK_SIZE_N))
                    b = values.to(tl.bfloat16, bitcast=True)
                    ks = k0 + 16 * q + offs_q
                    if EVEN_K:  # every K index inside: the tokens' mask alone
                        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=token_mask[:, None], other=0.0)
                    else:
                        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=token_mask[:, None] & (ks[None, :] < K),
                                    other=0.0)
                    # vLLM's `accumulator += tl.dot(a, b)` over its K tile, as it compiles: the same MMA steps
                    accumulator = tl.dot(a, b, accumulator)

        if MUL_ROUTED_WEIGHT:  # in fp32, before the one cast, as vLLM
            moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)
            accumulator *= moe_weight[:, None]
        tl.store(c_ptrs, accumulator.to(compute_type), mask=c_mask)

except ImportError:
    triton = None


def padded_pairs(m: int, top_k: int, block_m: int, sorted_token_ids: torch.Tensor | None) -> int:
    """EM, the pairs a launch covers in blocks of `block_m` rows, as vLLM's launch bounds them: the aligned list's
    length (at most m x top_k blocks' worth below one block of tokens), or one block per pair (naive)."""
    if sorted_token_ids is None:
        return m * top_k * block_m
    em = sorted_token_ids.numel()
    return min(em, m * top_k * block_m) if m < block_m else em


def invoke_fused_moe_tiled(a: torch.Tensor, experts: TiledExperts, c: torch.Tensor, topk_weights: torch.Tensor | None,
                           sorted_token_ids: torch.Tensor | None, expert_ids: torch.Tensor,
                           num_tokens_post_padded: torch.Tensor, mul_routed_weight: bool, top_k: int,
                           config: dict[str, Any], *, warmup: bool = False):
    """One expert GEMM, as vLLM's `invoke_fused_moe_triton_kernel` launches its kernel for unquantized bf16 (same
    arguments, `experts` in place of B): c[m, j, :] for every pair = a's row (pair // top_k) times its expert's
    weights (times its routed weight if asked). Same EM, grid and config handling. `experts` checked once before
    (`check`), on a's device. warmup: compile only and return the compiled kernel (Triton's `warmup`)."""
    if triton is None:
        raise RuntimeError("the fused fixed-rate kernel needs Triton")
    if a.dtype != torch.bfloat16 or c.dtype != torch.bfloat16:
        raise ValueError(f"bf16 activations and output, not {a.dtype} and {c.dtype}")
    if a.dim() != 2 or a.shape[1] != experts.k or c.dim() != 3 or c.shape[2] != experts.n:
        raise ValueError(f"a [M, {experts.k}] and c [M, top_k, {experts.n}], not {tuple(a.shape)} and "
                         f"{tuple(c.shape)}")
    if mul_routed_weight and (topk_weights is None or topk_weights.stride(1) != 1):
        raise ValueError("the routed weights: [M, top_k] with unit stride")
    if sorted_token_ids is not None and sorted_token_ids.stride(0) != 1:
        raise ValueError("sorted_token_ids with unit stride")
    config = dict(config)
    if config.pop("SPLIT_K", 1) != 1:
        raise ValueError("SPLIT_K must be 1 (vLLM sets it so)")
    block_k = config.pop("BLOCK_SIZE_K")
    if block_k % GROUP:
        raise ValueError(f"BLOCK_SIZE_K of {block_k}: a multiple of {GROUP}")
    m = a.shape[0]
    em = padded_pairs(m, top_k, config["BLOCK_SIZE_M"], sorted_token_ids)
    grid = (triton.cdiv(em, config["BLOCK_SIZE_M"]) * triton.cdiv(experts.n, config["BLOCK_SIZE_N"]),)
    raw = experts.raw if experts.raw.numel() else experts.base  # a real address even with no raw group
    launch = fused_moe_tiled_kernel[grid] if not warmup else \
        (lambda *args, **kwargs: fused_moe_tiled_kernel.warmup(*args, grid=grid, **kwargs))
    return launch(
        a, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        experts.sm, experts.codes, experts.base, experts.raw_at, raw,
        experts.n, experts.k, em, m * top_k, a.stride(0), a.stride(1), c.stride(1), c.stride(2),
        naive_block_assignment=sorted_token_ids is None, BLOCK_SIZE_K=block_k, MUL_ROUTED_WEIGHT=mul_routed_weight,
        top_k=top_k, compute_type=tl.bfloat16, EVEN_K=experts.k % block_k == 0, **config)
