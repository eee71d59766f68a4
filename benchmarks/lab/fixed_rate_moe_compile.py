"""The fused fixed-rate expert GEMM (esftctl.kernels.fixed_rate_moe) and vLLM's fused_moe_kernel compiled for sm_90
without a GPU, side by side.

Triton compiles for a target with no device present once its driver answers three questions (target, device,
stream): `_OfflineDriver`. Both kernels are then warmed up (`JITFunction.warmup`: specialized and compiled exactly
as a launch would, nothing run) with CPU tensors standing in for the GPU ones (same dtypes, 16-byte aligned, the
same integer arguments, so the same divisibility specializations), at the configs vLLM picks on an H200 for the
bench's shapes, and their TTGIR / PTX / cubin are read:
- mma: the TTGIR dot's layout (nvidia_mma versionMajor 2 = mma.sync, 3 = wgmma) and the PTX's instruction shapes;
- the K loop: how many mma / wgmma instructions one loop iteration issues, and B's path (cp.async into shared
  memory, `ttg.local_alloc` of a register tensor, ldmatrix);
- num_stages honoured: the loads' async-copy groups in the loop (cp.async.commit_group) and the TTGIR's
  pipelined buffers (a `ttg.local_alloc` with a leading stage dimension);
- global loads per K step (ld.global in the loop body, by width), local memory (ld.local / st.local), the
  cubin's registers, stack and spills (cuobjdump --dump-resource-usage, ptxas -v), and the kernel's SASS
  instructions in all (`sass`: prologue and pipeline included; the loop dominates).

Usage (CPU only): python benchmarks/lab/fixed_rate_moe_compile.py [--keep DIR] [--only deepseek-v2-lite[:256]]
  [--config qwen3-30b-a3b:256=32,128,128,16,4,2 ...]   (another config than vLLM's for that shape, both kernels)
Prints one row per (model, tokens, product, kernel). The Triton here may be newer than the device's (check the
printed version); the mma choice and pipelining rules compared here are the same in 3.6 and 3.9 for sm_90.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# The configs vLLM 0.25 picked on an H200 (benchmarks/data/paging/2026-11-26-h200-c/fixed_rate_moe_bench.log), per
# model and token count: (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages, naive).
CONFIGS = {
    ("deepseek-v2-lite", 1): (16, 64, 128, 1, 4, 4, True),
    ("deepseek-v2-lite", 32): (16, 64, 128, 1, 4, 4, False),
    ("deepseek-v2-lite", 256): (64, 128, 64, 1, 8, 3, False),
    ("qwen3-30b-a3b", 1): (16, 64, 64, 1, 4, 5, True),
    ("qwen3-30b-a3b", 32): (16, 64, 128, 16, 4, 2, False),
    ("qwen3-30b-a3b", 256): (32, 256, 128, 16, 4, 2, False),
}
MODELS = {"deepseek-v2-lite": (64, 2048, 1408, 6), "qwen3-30b-a3b": (128, 2048, 768, 8)}


class _OfflineDriver:
    """Just enough of Triton's CUDA driver to compile for sm_90 with no device."""

    def __init__(self, capability: int = 90):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def use_offline_driver(capability: int = 90) -> None:
    from triton.runtime.driver import driver

    driver.set_active(_OfflineDriver(capability))


def vllm_kernel():
    """vLLM's `fused_moe_kernel` (with `write_zeros_to_output`) from its installed source, written to a module
    file of its own (Triton's JIT reads a kernel's source from its file; vLLM's CPU build disables its Triton)."""
    import ast
    import importlib.util

    path = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    source = (path / "model_executor/layers/fused_moe/fused_moe.py").read_text()
    lines = source.splitlines()
    parts = ["import triton", "import triton.language as tl", ""]
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in ("write_zeros_to_output", "fused_moe_kernel"):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            parts += lines[first - 1:node.end_lineno] + ["", ""]
    folder = Path(tempfile.mkdtemp())
    (folder / "vllm_fused_moe_kernel.py").write_text("\n".join(parts))
    sys.path.insert(0, str(folder))
    import vllm_fused_moe_kernel

    return vllm_fused_moe_kernel.fused_moe_kernel


def stand_ins(model: str, tokens: int, product: str, config):
    """The tensors and integers of one product's launch (CPU stand-ins of the GPU tensors)."""
    from esftctl.kernels.fixed_rate_moe import GROUP, WORDS

    experts, hidden, inter, top_k = MODELS[model]
    bm, bn, bk, gm, warps, stages, naive = config
    n, k = (2 * inter, hidden) if product == "w13" else (hidden, inter)
    m, top = (tokens, top_k) if product == "w13" else (tokens * top_k, 1)
    pairs = m * top
    if naive:
        em = pairs * bm
    else:
        em = pairs + experts * (bm - 1)
        if pairs < experts:
            em = min(pairs * bm, em)
        if m < bm:
            em = min(em, pairs * bm)
    t = dict(
        a=torch.empty(m, k, dtype=torch.bfloat16), c=torch.empty(tokens, top_k, n, dtype=torch.bfloat16),
        w=torch.empty(experts, n, k, dtype=torch.bfloat16), topk_weights=torch.empty(tokens, top_k),
        sorted_ids=None if naive else torch.empty(em, dtype=torch.int32),
        expert_ids=torch.empty(max(pairs, -(-em // bm)), dtype=torch.int32), post=torch.empty(1, dtype=torch.int32),
        sm=torch.empty(experts, n, k // 4, dtype=torch.int32), codes=torch.empty(experts, n, k // 8, dtype=torch.int32),
        base=torch.empty(experts, dtype=torch.int32), raw_at=torch.empty(experts, n, k // GROUP, dtype=torch.int32),
        raw=torch.empty(4096, WORDS, dtype=torch.int32))
    return t, dict(n=n, k=k, em=em, pairs=pairs, top=top, mul=product == "w2", bm=bm, bn=bn, bk=bk,
                   gm=gm, warps=warps, stages=stages, naive=naive)


def compile_vllm(kernel, t, s):
    import triton.language as tl

    w = t["w"]
    return kernel.warmup(
        t["a"], w, t["c"], None, None, None, t["topk_weights"], t["sorted_ids"], t["expert_ids"], t["post"],
        s["n"], s["k"], s["em"], s["pairs"], t["a"].stride(0), t["a"].stride(1), w.stride(0), w.stride(2),
        w.stride(1), t["c"].stride(1), t["c"].stride(2), 0, 0, 0, 0, 0, 0, 0, 0, 0,
        MUL_ROUTED_WEIGHT=s["mul"], top_k=s["top"], compute_type=tl.bfloat16, use_fp8_w8a8=False,
        use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False, naive_block_assignment=s["naive"],
        HAS_BIAS=False, BLOCK_SIZE_K=s["bk"], SWAP_AB=False, BLOCK_SIZE_M=s["bm"], BLOCK_SIZE_N=s["bn"],
        GROUP_SIZE_M=s["gm"], SPLIT_K=1, num_warps=s["warps"], num_stages=s["stages"], grid=(1,))


def compile_fused(t, s):
    """The fused kernel as `invoke_fused_moe_tiled` launches it."""
    from esftctl.kernels.fixed_rate_moe import TiledExperts, invoke_fused_moe_tiled

    experts = TiledExperts(s["n"], s["k"], t["sm"], t["codes"], t["base"], t["raw_at"], t["raw"])
    config = dict(BLOCK_SIZE_M=s["bm"], BLOCK_SIZE_N=s["bn"], BLOCK_SIZE_K=s["bk"], GROUP_SIZE_M=s["gm"],
                  num_warps=s["warps"], num_stages=s["stages"])
    return invoke_fused_moe_tiled(t["a"], experts, t["c"], t["topk_weights"], t["sorted_ids"], t["expert_ids"],
                                  t["post"], s["mul"], s["top"], config, warmup=True)


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text, re.M))


def loop_body(ptx: str) -> str:
    """The PTX of the main K loop: the basic block(s) between the loop's label and its backward branch, taken as
    the longest labelled region that ends with a branch back to its own label."""
    best = ""
    for m in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        label = m.group(1)
        back = re.search(rf"^\s*(@%p\d+ )?bra(\.uni)?\s+{re.escape(label)};", ptx[m.end():], re.M)
        if back:
            body = ptx[m.end():m.end() + back.end()]
            if body.count("mma") > best.count("mma") or (body.count("mma") == best.count("mma")
                                                           and len(body) > len(best)):
                best = body
    return best


def resources(cubin: bytes, keep: Path) -> dict:
    path = keep / "k.cubin"
    path.write_bytes(cubin)
    tool = Path(__import__("triton").__file__).parent / "backends/nvidia/bin/cuobjdump"
    out = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout
    got = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"{key}:(\d+)", out)
        got[key] = int(m.group(1)) if m else -1
    return got


def spills(ptx: str, keep: Path) -> tuple[str, int]:
    """(spill stores / loads in bytes, SASS instructions of the whole kernel) from ptxas -v and cuobjdump -sass."""
    path = keep / "k.ptx"
    path.write_text(ptx)
    tools = Path(__import__("triton").__file__).parent / "backends/nvidia/bin"
    out = subprocess.run([str(tools / "ptxas-blackwell"), "-arch=sm_90a", "-v", str(path), "-o",
                          str(keep / "k2.cubin")], capture_output=True, text=True).stderr
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out) or \
        re.search(r"(\d+) bytes stack frame.*?(\d+) bytes spill", out, re.S)
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(keep / "k2.cubin")], capture_output=True,
                          text=True).stdout
    return (f"{m.group(1)}/{m.group(2)}" if m else "?"), len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M))


def summarize(kernel, keep: Path) -> dict:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    body = loop_body(ptx)
    mma_v = sorted(set(re.findall(r"#ttg\.nvidia_mma<\{versionMajor = (\d+)", ttgir)))
    mma_re = r"(wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+|mma\.sync\.aligned\.m\d+n\d+k\d+)"
    shapes = sorted(set(re.findall(mma_re, ptx)))
    stage_bufs = re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x", ttgir)
    loads = re.findall(r"ld\.global(?:\.[a-z]+)*\.(?:v(\d)\.)?[bu](\d+)", body)
    kwidth = sorted(set(re.findall(r"dot_op<\{opIdx = 1, parent = #mma\d*, kWidth = (\d+)\}>", ttgir)))
    return dict(
        mma="v" + "/".join(mma_v) if mma_v else "none", kW=",".join(kwidth) or "-",
        loop_ptx=len([x for x in body.splitlines() if x.strip() and not x.strip().startswith(("$", "//", "{", "}"))]),
        shapes=",".join(s.split(".")[-1] for s in shapes),
        loop_mma=_count(r"^\s*(?:@%p\d+ )?(?:wgmma\.mma_async|mma\.sync)", body),
        cp_async=_count(r"cp\.async\.(?:ca|cg)", body), commit=_count(r"cp\.async\.commit_group", body),
        tma=_count(r"cp\.async\.bulk", ptx),
        ldg=len(loads), ldg_bytes=sum((int(v or 1) * int(w)) // 8 for v, w in loads),
        lds=_count(r"ld\.shared", body), sts=_count(r"st\.shared", body), ldmatrix=_count(r"ldmatrix", body),
        stages="x".join(stage_bufs) or "-",
        local=_count(r"(?:ld|st)\.local", ptx), **resources(kernel.asm["cubin"], keep),
        **dict(zip(("spill", "sass"), spills(ptx, keep))))


def main() -> None:
    import triton

    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", help="write each kernel's ttgir and ptx here")
    parser.add_argument("--only", default="")
    parser.add_argument("--config", action="append", default=[], metavar="MODEL:TOKENS=BM,BN,BK,GM,WARPS,STAGES",
                        help="compile both kernels at this config instead of vLLM's (repeatable; naive as vLLM's)")
    args = parser.parse_args()
    configs = dict(CONFIGS)
    for spec in args.config:
        key, values = spec.split("=")
        model, tokens = key.split(":")
        if (model, int(tokens)) not in CONFIGS or len(values.split(",")) != 6:
            raise SystemExit(f"--config {spec}: one of {sorted(CONFIGS)} = six integers")
        configs[(model, int(tokens))] = (*map(int, values.split(",")), CONFIGS[(model, int(tokens))][-1])
    use_offline_driver()
    vllm = vllm_kernel()
    keep = Path(args.keep or tempfile.mkdtemp())
    keep.mkdir(parents=True, exist_ok=True)
    print(f"triton {triton.__version__}, target sm_90 (offline)")
    cols = ("mma", "kW", "shapes", "loop_ptx", "loop_mma", "cp_async", "commit", "tma", "ldg", "ldg_bytes", "lds",
            "sts", "ldmatrix",
            "stages", "local", "REG", "STACK", "spill", "sass")
    print(f"{'model':17s} {'tok':>3s} {'prod':4s} {'kernel':6s} {'config':>18s} " + " ".join(f"{c:>9s}" for c in cols))
    for (model, tokens), config in configs.items():
        if args.only and args.only not in f"{model}:{tokens}":
            continue
        for product in ("w13", "w2"):
            t, s = stand_ins(model, tokens, product, config)
            for name in ("vllm", "fused"):
                kernel = compile_vllm(vllm, t, s) if name == "vllm" else compile_fused(t, s)
                got = summarize(kernel, keep)
                if args.keep:
                    stem = f"{model}-{tokens}-{product}-{name}"
                    (keep / f"{stem}.ttgir").write_text(kernel.asm["ttgir"])
                    (keep / f"{stem}.ptx").write_text(kernel.asm["ptx"])
                print(f"{model:17s} {tokens:3d} {product:4s} {name:6s} {'x'.join(map(str, config[:6])):>18s} "
                      + " ".join(f"{str(got[c]):>9s}" for c in cols), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())
    main()
