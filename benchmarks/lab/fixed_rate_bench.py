"""The fixed-rate decoders on one DeepSeek-V2-Lite layer (64 trained-like experts), on a GPU: decode ms (do_bench
median) and the fraction of its bound (bytes read + written over the copy bandwidth).
- the single-tensor decoder (`decode`): block size x warps;
- the paging tier's row decoder (`decode_rows`, its w13 and w2 rows as the tier keeps them): blocks a program
  (`steps`) x warps, every row and 6 of 64 (batch 1's routed rows; a masked decode's cost is mostly programs that
  end at once).
Usage: python benchmarks/lab/fixed_rate_bench.py [--experts 64]"""

import argparse

import torch
import triton.testing

from esftctl.bench.reroute import copy_bandwidth
from esftctl.bench.shapes import DEEPSEEK_V2_LITE
from esftctl.bench.synthetic_model import trained_like_expert
from esftctl.kernels.fixed_rate import decode, decode_rows, encode, encode_rows

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

experts = [trained_like_expert(DEEPSEEK_V2_LITE, x) for x in range(args.experts)]
tensors = [torch.stack([torch.cat([e["gate"], e["up"]]) for e in experts]).cuda(),
           torch.stack([e["down"] for e in experts]).cuda()]
del experts
codes = [encode_rows(t) for t in tensors]
for c in codes:
    c.check()
outs = [torch.empty_like(t) for t in tensors]
rows = tensors[0].shape[0]
bound_ms = sum(c.nbytes + 2 * c.count * c.rows for c in codes) / bandwidth * 1e3
few = torch.zeros(rows, dtype=torch.int32, device="cuda")
few[torch.randperm(rows)[:6]] = 1
every = torch.ones(rows, dtype=torch.int32, device="cuda")
first_host = torch.full((1,), rows, dtype=torch.int32, device="cuda")
print("rows decoder (w13 + w2 of the layer)")
print(" steps warps  all ms  of bound  6 of 64 ms  exact")
for steps in (1, 2, 4, 8, 16, 32):
    for warps in (4, 8):
        def run(needed):
            for c, o in zip(codes, outs):
                decode_rows(c, o, needed, first_host, num_warps=warps, steps=steps)
        for o in outs:
            o.zero_()
        run(every)
        exact = all(torch.equal(o.view(torch.int16), t.view(torch.int16)) for o, t in zip(outs, tensors))
        ms = [float(triton.testing.do_bench(lambda: run(m), warmup=10, rep=200, return_mode="median"))
              for m in (every, few)]
        print(f"{steps:6d} {warps:5d} {ms[0]:7.3f} {bound_ms / ms[0]:9.0%} {ms[1]:11.3f}  {exact}")
