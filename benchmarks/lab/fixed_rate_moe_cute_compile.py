"""The CuTe DSL design of the fixed-rate expert GEMM (esftctl.kernels.fixed_rate_moe_cute) compiled for sm_90a
without a GPU: registers, spills, SASS instructions, and what its K loop issues, per compile-time setting.

CUTLASS's Python DSL compiles with no device present (CUTE_DSL_ARCH names the target); `--keep-ptx` leaves the PTX,
which Triton's ptxas turns into the cubin read here (ptxas -v: registers and spills; cuobjdump -sass: the whole
kernel's instructions). The sizes are run-time arguments, so one compile serves every shape: the rows differ by
BLOCK_SIZE_M (16 pairs per M atom), NA (MMA columns of 8 a warp), WARPS, and the routed weights' product (w2's).
Compare with the Triton design and vLLM's kernel (`benchmarks/lab/fixed_rate_moe_compile.py`: vLLM 64-72 registers
and 824 SASS instructions at DeepSeek-V2-Lite's 1 and 32 tokens).

Usage (PTX and cubins left in CUTE_DSL_DUMP_DIR, default a new temporary folder), in an environment with
nvidia-cutlass-dsl (4.8) beside esftctl's: python benchmarks/lab/fixed_rate_moe_cute_compile.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
KEEP = Path(os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp()))  # where --keep-ptx writes, read at import

SETTINGS = [  # (BLOCK_SIZE_M, NA, WARPS, routed weights, naive)
    (16, 1, 4, False, False), (16, 2, 4, False, False), (16, 4, 4, False, False), (16, 2, 4, True, False),
    (16, 2, 4, False, True), (32, 2, 4, False, False), (64, 2, 4, False, False), (64, 4, 4, False, False),
]


def tools() -> Path:
    return Path(__import__("triton").__file__).parent / "backends/nvidia/bin"


def measure(ptx: Path) -> dict:
    cubin = ptx.with_suffix(".cubin")
    out = subprocess.run([str(tools() / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    sass = subprocess.run([str(tools() / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    text = ptx.read_text()
    loads = re.findall(r"ld\.global(?:\.[a-z]+)*\.(?:(v\d)\.)?[bu](\d+)", text)
    widths = {}
    for vec, bits in loads:
        widths[f"{vec or 'v1'}.{bits}"] = widths.get(f"{vec or 'v1'}.{bits}", 0) + 1
    return {"registers": int(regs.group(1)) if regs else -1,
            "spills": f"{spill.group(1)}/{spill.group(2)}" if spill else "?",
            "sass": len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M)),
            "mma": len(re.findall(r"mma\.sync\.aligned\.m16n8k16", text)),
            "shared": len(re.findall(r"(?:ld|st)\.shared", text)),
            "loads": " ".join(f"{k}:{v}" for k, v in sorted(widths.items()))}


def main() -> None:
    import cutlass

    from esftctl.kernels.fixed_rate_moe_cute import compile_tiled_cute

    print(f"nvidia-cutlass-dsl {cutlass.__version__ if hasattr(cutlass, '__version__') else '?'}, target "
          f"{os.environ['CUTE_DSL_ARCH']} (offline)")
    print(f"{'BLOCK_M':>7s} {'NA':>3s} {'WARPS':>5s} {'routed':>6s} {'naive':>5s} {'regs':>5s} {'spills':>7s} "
          f"{'sass':>6s} {'mma':>4s} {'shared':>6s}  global loads")
    for block_m, na, warps, routed, naive in SETTINGS:
        before = set(KEEP.glob("*.ptx"))
        compile_tiled_cute(top_k=6, mul_routed_weight=routed, naive=naive, options="--keep-ptx",
                           config={"BLOCK_SIZE_M": block_m, "NA": na, "WARPS": warps})
        got = measure(next(iter(set(KEEP.glob("*.ptx")) - before)))
        print(f"{block_m:7d} {na:3d} {warps:5d} {str(routed):>6s} {str(naive):>5s} {got['registers']:5d} "
              f"{got['spills']:>7s} {got['sass']:6d} {got['mma']:4d} {got['shared']:6d}  {got['loads']}", flush=True)


if __name__ == "__main__":
    main()
