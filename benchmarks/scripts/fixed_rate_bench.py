"""The fixed-rate decoder's block size and warps on one DeepSeek-V2-Lite layer (64 trained-like experts), on a
GPU: decode ms (do_bench median) and the fraction of its bound (bytes read + written over the copy bandwidth).
Usage: python benchmarks/scripts/fixed_rate_bench.py [--experts 64]"""

import argparse

import torch
import triton.testing

from esftctl.bench.reroute import copy_bandwidth
from esftctl.bench.shapes import DEEPSEEK_V2_LITE
from esftctl.bench.synthetic_model import trained_like_expert
from esftctl.kernels.fixed_rate import decode, encode

parser = argparse.ArgumentParser()
parser.add_argument("--experts", type=int, default=64)
args = parser.parse_args()
values = torch.cat([t.reshape(-1) for x in range(args.experts)
                    for t in trained_like_expert(DEEPSEEK_V2_LITE, x).values()])
bandwidth = copy_bandwidth(torch.device("cuda"))
out = torch.empty(values.numel(), dtype=torch.bfloat16, device="cuda")
print(f"{values.numel() / 1e6:.0f}M values; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
print(" block warps      ms  of bound  exact")
for block in (1024, 2048, 4096, 8192):
    code = encode(values, block=block)
    code.check()
    on_gpu = code.to("cuda")
    bound_ms = (code.nbytes + 2 * code.count) / bandwidth * 1e3
    for warps in (4, 8, 16):
        out.zero_()
        decode(on_gpu, out, num_warps=warps)
        exact = torch.equal(out.cpu().view(torch.int16), values.view(torch.int16))
        ms = float(triton.testing.do_bench(lambda: decode(on_gpu, out, num_warps=warps), warmup=10, rep=200,
                                           return_mode="median"))
        print(f"{block:6d} {warps:5d} {ms:7.3f} {bound_ms / ms:9.0%}  {exact}")
