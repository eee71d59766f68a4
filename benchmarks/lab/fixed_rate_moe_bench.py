"""The tiled fixed-rate expert GEMM (esftctl.kernels.fixed_rate_moe) against vLLM's own fused-MoE kernel, on a GPU.

One MoE layer of trained-like experts at DeepSeek-V2-Lite's shape (64 experts, hidden 2048, intermediate 1408,
top-6) and Qwen3-30B-A3B's (128, 2048, 768, top-8), at 1, 32 and 256 tokens; per step both expert GEMMs (w13:
tokens x hidden into 2 x intermediate; w2: the pairs' intermediate into hidden, times the routed weights), each
with the config vLLM picks (`try_get_optimal_moe_config`: its tuned JSON for this GPU, else its defaults) and
vLLM's own assignment (`_prepare_expert_assignment`: `moe_align_block_size`, or the naive path for tiny
batches). The activation between the GEMMs and the final sum are the same in all three and left out.
- resident: vLLM's `fused_moe_kernel` on the bf16 weights (`invoke_fused_moe_triton_kernel`), plain serving;
- fused:    the tiled kernel on the same weights' tile-ready layout (`encode_tiled`);
- decode:   today's paging tier: `decode_rows` of the step's routed rows into a bf16 window, then vLLM's kernel
            on the window;
- fused0:   the tiled kernel on the same layer with its escapes moved into the window (each escaped value's
            exponent replaced by the window's lowest): what the escaped groups' path costs (2-3% of groups);
- cute:     the CuTe DSL design (esftctl.kernels.fixed_rate_moe_cute: B decoded into the MMA's registers) on the
            same codes, vLLM's BLOCK_SIZE_M and assignment, 4 warps of 2 MMA columns; where nvidia-cutlass-dsl
            imports (else left out).
First the outputs are checked bit for bit (fused and decode against resident; fused0 against vLLM's kernel on
fused0's weights); then each timed variant
is captured as a CUDA graph and replayed --iters times, L2 flushed before each replay (weights come from HBM as in
serving), each replay timed with CUDA events: median and min ms. The bound is the variant's bytes (the routed
experts' weights or codes, the window's write and reread for decode, activations in and out) over the measured
device copy bandwidth: resident 2 bytes a weight, fused about 1.58, decode about 5.5. A config whose K tile is
not a multiple of 64 (the layout's group) is reported and skipped for fused.

With --sweep, each row is followed by the fused kernel's configuration sweep: every config of --sweep-grid, each
with vLLM's block assignment for its BLOCK_SIZE_M, checked bit for bit against vLLM's kernel at vLLM's config and
timed the same way; the five fastest are printed and the fastest exact one marked. vLLM's config suits vLLM's
kernel; the fused kernel decodes B in registers, so it may want other tiles (compiled offline at Qwen3-30B-A3B's 256
tokens, vLLM's 32 x 256 x 128 costs it 255 registers and spills, 32 x 64 x 128 80-84 and none:
`benchmarks/lab/fixed_rate_moe_compile.py --config`).

Usage (device machine, vLLM's CUDA build on PYTHONPATH, see ../shared/gpu/README.md):
    python benchmarks/lab/fixed_rate_moe_bench.py [--iters 200] [--models deepseek-v2-lite,qwen3-30b-a3b]
        [--tokens 1,32,256] [--sweep [--sweep-grid "M=16,32,64 N=32,64,128 K=64,128 warps=4,8 stages=2,3,4"]]
A table to stdout, JSON lines to $OUT/fixed_rate_moe.jsonl if $OUT is set. About 1-2 minutes on an H100; the
sweep's 108 configs add a compile each (a few minutes per row: narrow the grid where time is short).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from esftctl.kernels.fixed_rate_moe_cute import CuteTiles, invoke_fused_moe_tiled_cute

try:
    import cutlass  # noqa: F401

    HAS_CUTE = torch.cuda.is_available()
except ImportError:
    HAS_CUTE = False

MODELS = {  # experts, hidden, intermediate, top_k
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
}


@dataclass
class Batch:
    tokens: int
    config: dict
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    sorted_ids: torch.Tensor | None
    expert_ids: torch.Tensor
    post_padded: torch.Tensor
    needed: torch.Tensor  # int32 [E]: the routed rows (the masked decode's)
    inputs: dict  # product: the GEMM's A


class Layer:
    """One layer's experts as bf16 (resident), in the tiled layout (fused), as the paging tier's rows with a bf16
    window the decode variant decodes into, and the escape-free copy (weights0, tiles0) for fused0."""

    def __init__(self, experts: int, hidden: int, intermediate: int, top_k: int, seed: int = 0,
                 device: str = "cuda"):
        from esftctl.bench.synthetic_model import trained_like
        from esftctl.kernels.fixed_rate import encode_rows
        from esftctl.kernels.fixed_rate_moe import encode_tiled

        self.experts, self.hidden, self.intermediate, self.top_k = experts, hidden, intermediate, top_k
        self.device = device
        g = torch.Generator(device=device).manual_seed(seed)
        self.weights = {"w13": trained_like((experts, 2 * intermediate, hidden), g),
                        "w2": trained_like((experts, hidden, intermediate), g)}
        self.tiles, self.rows = {}, {}
        for name, w in self.weights.items():
            self.tiles[name] = encode_tiled(w)
            self.tiles[name].check()
            self.rows[name] = encode_rows(w.view(experts, -1))
            self.rows[name].check()
        self.weights0 = {name: without_escapes(w, self.tiles[name]) for name, w in self.weights.items()}
        self.tiles0 = {name: encode_tiled(w) for name, w in self.weights0.items()}
        self.cute = {name: CuteTiles.of(t) for name, t in self.tiles.items()} if HAS_CUTE else {}
        assert all(t.raw.shape[0] == 0 for t in self.tiles0.values())
        self.window = {name: torch.empty_like(w) for name, w in self.weights.items()}
        self.first_host = torch.full((1,), experts, dtype=torch.int32, device=device)

    def batch(self, tokens: int, seed: int = 0, config: dict | None = None) -> Batch:
        """A step of `tokens` tokens (inputs and routing drawn from `seed`), assigned to blocks as vLLM assigns
        them for `config` (default: the config vLLM picks)."""
        from vllm.model_executor.layers.fused_moe.fused_moe import (
            _prepare_expert_assignment,
            try_get_optimal_moe_config,
        )

        d = self.device
        g = torch.Generator(device=d).manual_seed(seed)
        logits = torch.randn(tokens, self.experts, generator=g, device=d)
        weights, ids = torch.topk(torch.softmax(logits, -1), self.top_k)
        ids = ids.to(torch.int32)
        config = config or try_get_optimal_moe_config(tuple(self.weights["w13"].shape),
                                                      tuple(self.weights["w2"].shape), self.top_k, None,
                                                      tokens)  # None: vLLM's dtype key for bf16
        sorted_ids, expert_ids, post = _prepare_expert_assignment(ids, config, tokens, self.top_k, self.experts,
                                                                  None, ignore_invalid_experts=True)
        needed = torch.zeros(self.experts, dtype=torch.int32, device=d)
        needed[ids.reshape(-1).long()] = 1
        inputs = {"w13": (torch.randn(tokens, self.hidden, generator=g, device=d) / 4).bfloat16(),
                  "w2": (torch.randn(tokens * self.top_k, self.intermediate, generator=g, device=d) / 4).bfloat16()}
        return Batch(tokens, dict(config), weights.contiguous(), ids, sorted_ids, expert_ids, post, needed, inputs)

    def products(self, b: Batch):
        """(name, A, N, mul_routed_weight, top_k) of the step's two GEMMs, as `fused_experts_impl` calls them."""
        return [("w13", b.inputs["w13"], 2 * self.intermediate, False, self.top_k),
                ("w2", b.inputs["w2"], self.hidden, True, 1)]

    def step(self, b: Batch, variant: str):
        """A function running the step's two GEMMs the `variant` way into fresh outputs, and those outputs."""
        import triton.language as tl
        from vllm.model_executor.layers.fused_moe.fused_moe import invoke_fused_moe_triton_kernel

        from esftctl.kernels.fixed_rate import decode_rows
        from esftctl.kernels.fixed_rate_moe import invoke_fused_moe_tiled

        outs = {name: torch.empty(b.tokens, self.top_k, n, dtype=torch.bfloat16, device=self.device)
                for name, _, n, _, _ in self.products(b)}

        def vllm(a, w, c, mul, top):
            invoke_fused_moe_triton_kernel(a, w, c, None, None, b.topk_weights, b.sorted_ids, b.expert_ids,
                                           b.post_padded, mul, top, b.config, tl.bfloat16, False, False, False,
                                           False, False, None, None)

        def run():
            for name, a, _, mul, top in self.products(b):
                if variant in ("resident", "resident0"):
                    vllm(a, (self.weights if variant == "resident" else self.weights0)[name], outs[name], mul, top)
                elif variant == "cute":
                    invoke_fused_moe_tiled_cute(a, self.cute[name], outs[name], b.topk_weights, b.sorted_ids,
                                                b.expert_ids, b.post_padded, mul, top,
                                                {"BLOCK_SIZE_M": b.config["BLOCK_SIZE_M"]})
                elif variant in ("fused", "fused0"):
                    invoke_fused_moe_tiled(a, (self.tiles if variant == "fused" else self.tiles0)[name],
                                           outs[name], b.topk_weights, b.sorted_ids, b.expert_ids, b.post_padded,
                                           mul, top, b.config)
                else:
                    decode_rows(self.rows[name], self.window[name], b.needed, self.first_host)
                    vllm(a, self.window[name], outs[name], mul, top)
        return run, outs

    def nbytes(self, b: Batch) -> dict[str, int]:
        """Bytes each variant moves in the step: the routed experts' weights (bf16) or codes (fused: the tiled
        layout's words and escape index, the escaped groups' exponents left out; decode: the tier's rows), the
        window's write and reread (decode), activations in and out."""
        rows = int(b.needed.sum())
        weights = sum(rows * w[0].numel() * 2 for w in self.weights.values())
        tiles = sum(rows * (t.sm[0].numel() * 4 + t.codes[0].numel() * 4 + t.raw_at[0].numel() * 4)
                    for t in self.tiles.values())
        codes = sum(rows * (r.count * 3 // 2 + 16 + r.starts.shape[1] * 4) for r in self.rows.values())
        acts = sum(a.numel() * 2 + b.tokens * self.top_k * n * 2 for _, a, n, _, _ in self.products(b))
        return {"resident": weights + acts, "fused": tiles + acts, "cute": tiles + acts,
                "decode": codes + 2 * weights + acts}


def without_escapes(w: torch.Tensor, tiles) -> torch.Tensor:
    """w [E, N, K] bf16 with each exponent outside its expert's window replaced by the window's lowest: the same
    shape and windows, no escapes (a timing diagnostic, not the model's weights)."""
    bits = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    exp, base = (bits >> 7) & 0xFF, tiles.base.view(-1, 1, 1).to(bits.device)
    outside = (exp < base) | (exp > base + 14)
    bits = torch.where(outside, (bits & 0x807F) | (base << 7), bits)
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16)


def graph_times(run, iters: int, flush: torch.Tensor) -> tuple[float, float]:
    """Median and min ms of replaying `run` as a CUDA graph, L2 flushed before each replay."""
    from esftctl.bench.reroute import captured

    graph = captured(run)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = [start.elapsed_time(end) for start, end in events]
    return statistics.median(ms), min(ms)


def sweep_configs(grid: str) -> list[dict]:
    """The configs of a grid "M=16,32 N=64,128 K=64,128 warps=4 stages=2,3" (GROUP_SIZE_M 1 at BLOCK_SIZE_M 64
    and up, else 16, as vLLM's tuned files mostly have it)."""
    import itertools

    axes = dict(part.split("=") for part in grid.split())
    keys = ("M", "N", "K", "warps", "stages")
    if set(axes) != set(keys):
        raise SystemExit(f"--sweep-grid names {', '.join(keys)}, each once: not {grid!r}")
    out = []
    for m, n, k, warps, stages in itertools.product(*([int(v) for v in axes[key].split(",")] for key in keys)):
        if k % 64:
            continue  # the layout's group: the fused kernel takes K tiles of whole groups
        out.append({"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 1 if m >= 64 else 16,
                    "num_warps": warps, "num_stages": stages})
    return out


def sweep(layer: "Layer", tokens: int, want: dict, grid: str, iters: int, flush: torch.Tensor,
          bandwidth: float) -> list[dict]:
    """The fused kernel timed at every config of `grid` (each with vLLM's block assignment for its BLOCK_SIZE_M),
    its outputs compared bit for bit with vLLM's kernel at vLLM's own config (`want`: resident's outputs), and the
    fastest exact one printed: what the fused kernel gets when it picks its own config, as vLLM's tuned files do
    for its kernel."""
    rows = []
    for config in sweep_configs(grid):
        b = layer.batch(tokens, config=config)
        naive = b.sorted_ids is None
        run, outs = layer.step(b, "fused")
        try:
            run()
            torch.cuda.synchronize()
        except Exception as e:  # a config Triton cannot build for this shape (shared memory, say): reported
            rows.append({"config": config, "error": str(e).splitlines()[0][:200]})
            continue
        exact = all(torch.equal(outs[p].view(torch.int16), want[p].view(torch.int16)) for p in want)
        ms, lo = graph_times(run, iters, flush)
        bound = layer.nbytes(b)["fused"] / bandwidth * 1e3
        rows.append({"config": config, "naive": naive, "exact": exact, "ms": [ms, lo], "of_bound": bound / ms})
    done = [r for r in rows if "ms" in r]
    exact = [r for r in done if r["exact"]]
    best = min(exact, key=lambda r: r["ms"][0], default=None)  # none marked where no config is exact
    for r in sorted(done, key=lambda r: r["ms"][0])[:5]:
        c = r["config"]
        print(f"    sweep {c['BLOCK_SIZE_M']},{c['BLOCK_SIZE_N']},{c['BLOCK_SIZE_K']},{c['GROUP_SIZE_M']},"
              f"{c['num_warps']},{c['num_stages']}{' naive' if r['naive'] else ''}: {r['ms'][0]:.3f} ms, "
              f"{r['of_bound']:.0%} of bound, exact {r['exact']}" + ("  <- fastest exact" if r is best else ""))
    failed = len(rows) - len(done)
    print(f"    sweep: {len(done)} configs timed, {len(exact)} exact" + (f", {failed} not built" if failed else ""),
          flush=True)
    return rows


def main() -> None:
    from esftctl.bench.reroute import copy_bandwidth

    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default="1,32,256")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the fused kernel at every config of --sweep-grid (its own config choice)")
    parser.add_argument("--sweep-grid", default="M=16,32,64 N=32,64,128 K=64,128 warps=4,8 stages=2,3,4")
    args = parser.parse_args()
    if args.sweep:
        sweep_configs(args.sweep_grid)  # a bad grid fails before the GPU work
    began = time.time()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # past any L2
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print("variants: resident = vLLM's kernel on bf16; fused = fused kernel on the codes; decode = decode_rows of "
          "the routed rows + vLLM's kernel on the window. ms: median / min of CUDA-graph replays, both GEMMs")
    head = (f"{'model':17s} {'tok':>4s} {'config M,N,K,G,warps,stages':28s} {'exact':5s} {'resident ms':>13s} "
            f"{'fused ms':>13s} {'decode ms':>13s} {'fused0 ms':>13s} {'bound ms res/fus/dec':>22s} "
            f"{'fused/res':>9s} {'dec/fused':>9s} {'fused of bound':>14s}")
    print(head)
    records = []
    for model in args.models.split(","):
        layer = Layer(*MODELS[model])
        for tokens in map(int, args.tokens.split(",")):
            b = layer.batch(tokens)
            if b.config["BLOCK_SIZE_K"] % 64:
                print(f"{model:17s} {tokens:4d} vLLM's K tile {b.config['BLOCK_SIZE_K']} is not a multiple of 64: "
                      "skipped", flush=True)
                records.append({"model": model, "tokens": tokens, "config": b.config, "skipped": "K tile"})
                continue
            steps = {v: layer.step(b, v) for v in ("resident", "fused", "decode", "fused0", "resident0")
                     + (("cute",) if HAS_CUTE else ())}
            for run, _ in steps.values():
                run()
            torch.cuda.synchronize()
            outs = {v: o for v, (_, o) in steps.items()}
            exact = all(torch.equal(outs[v][p].view(torch.int16), outs[want][p].view(torch.int16))
                        for v, want in (("fused", "resident"), ("decode", "resident"), ("fused0", "resident0"))
                        + ((("cute", "resident"),) if HAS_CUTE else ()) for p in outs["resident"])
            times = {v: graph_times(run, args.iters, flush) for v, (run, _) in steps.items() if v != "resident0"}
            bound = {v: n / bandwidth * 1e3 for v, n in layer.nbytes(b).items()}
            c = b.config
            config = (f"{c['BLOCK_SIZE_M']},{c['BLOCK_SIZE_N']},{c['BLOCK_SIZE_K']},{c['GROUP_SIZE_M']},"
                      f"{c.get('num_warps', '-')},{c.get('num_stages', '-')}" + (" naive" if b.sorted_ids is None
                                                                                 else ""))
            t = {v: f"{m:6.3f}/{lo:6.3f}" for v, (m, lo) in times.items()}
            print(f"{model:17s} {tokens:4d} {config:28s} {str(exact):5s} {t['resident']:>13s} {t['fused']:>13s} "
                  f"{t['decode']:>13s} {t['fused0']:>13s} "
                  f"{bound['resident']:6.3f}/{bound['fused']:6.3f}/{bound['decode']:6.3f} "
                  f"{times['fused'][0] / times['resident'][0]:9.2f} {times['decode'][0] / times['fused'][0]:9.2f} "
                  f"{bound['fused'] / times['fused'][0]:14.0%}"
                  + (f"  cute {t['cute']} ({times['cute'][0] / times['resident'][0]:.2f}x resident, "
                     f"{bound['cute'] / times['cute'][0]:.0%} of bound)" if HAS_CUTE else ""), flush=True)
            records.append({"model": model, "tokens": tokens, "config": c, "naive": b.sorted_ids is None,
                            "exact": exact, "ms": times, "bound_ms": bound, "device": torch.cuda.get_device_name(),
                            "rows": int(b.needed.sum())})
            if args.sweep:
                records[-1]["sweep"] = sweep(layer, tokens, outs["resident"], args.sweep_grid, args.iters, flush,
                                             bandwidth)
        del layer
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fixed_rate_moe.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    exact = all(r.get("exact", True) for r in records)
    print(f"{time.time() - began:.0f} s; exact everywhere: {exact}")
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
