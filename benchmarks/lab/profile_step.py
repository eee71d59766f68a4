"""Profile of a decode step on the GPU: the base alone vs 1 adapter vs 20 adapters at batch 1, 4 and 8 (issue 29.2).

At 4 requests/s TPOT was 0.99 / 1.15 / 1.29x the base's for base / 1 / 20 adapters (H200) while the bytes model
predicts almost no extra rows at such batches; this says where a step's time goes (step_profile.py:
MoE kernel, reroute, router, attention, dense products, sampling, copies, scheduler, LoRA mapping, esftctl's
worker manager, host gaps). The model is DeepSeek-V2-Lite-shaped with `--layers` layers (default 4: 1 dense + 3
MoE, 4.3 GB; widths, experts, vocabulary as the real one), enough for the fixed per-step costs; per-layer
components scale with the layer count (the real model has 26 MoE layers). Adapters are DeepSeek-sized (at most 9
experts per layer); 20 are loaded (two distinct files, as `bench serve` does: each name its own slot and copy).

Every configuration runs in its own process with vLLM's in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), so
torch.profiler sees the scheduler, the model runner and the GPU in one trace, with named scopes around vLLM's
methods (esftctl.runtime.vllm.profiling). Passes, in order of importance (each skipped when `--budget` seconds
would run out):
- esft-graphs: esftctl's runtime, CUDA graphs (vLLM's default), one set of graphs (esftctl.runtime.vllm.graphs);
- plain-graphs: plain vLLM, the base alone (no LoRA), CUDA graphs;
- esft-eager / plain-eager: the same eagerly, where every kernel is launched by name (the per-kernel split if the
  profiler does not trace graph nodes; and what graphs save);
- esft-vllm-graphs (`--capture-ab`): esftctl with vLLM's own LoRA graph sets (two), for the capture time and graph
  memory vLLM logs, against esft-graphs;
- unfolded-graphs (only when named in `--passes`): esft-graphs without the reroute folded into vLLM's compiled
  top-k (ESFTCTL_FOLD_REROUTE=0, esftctl.runtime.vllm.topk), so with the reroute's own kernel a layer;
- plain2-graphs (only when named): plain-graphs again. With `--fresh-caches` every pass compiles in a compile cache
  of its own (VLLM_CACHE_ROOT), so Inductor draws its autotuned picks afresh: `--passes plain-graphs,plain2-graphs
  --fresh-caches` measures how far two starts of plain vLLM alone differ by them (kernel diff below).
Beside each table, every esftctl column's kernels that differ most from plain vLLM's, with their launch shapes
where those differ (step_profile.kernel_diff: Inductor's autotuned picks are per process).
Each batch: B requests of 32 prompt tokens, greedy, `--warm` steps, `--timed` steps timed without the profiler
(the step time to believe: the profiler slows the host), then `--steps` profiled. Mixes: base (no adapter; through
esftctl's runtime in the esft passes), 1 adapter (all B on one), 20 adapters (the B requests on B distinct ones).
Then the prefill phase (`--prefill` tokens, 0: none): TTFT in-process, one prompt alone and beside 4 decoding
requests, on the base or on an adapter beside decoders on other adapters, timed and then profiled (prefill_runs).
Writes OUT/results.json, OUT/<pass>.log and OUT/<pass>-<mix>-b<B>.json.gz (the decode traces), prints rich tables.

A smoke run on vLLM's CPU build (no GPU rows there): `--small --layers 3 --batches 1,4 --warm 1 --timed 3 --steps 2
--passes esft-eager,plain-eager`, 47 s on 2 cores. Run on the GPU machine (at most `--budget` 330 s):
  PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 \
  python3 benchmarks/lab/profile_step.py --out /tmp/profile; tar -czf $OUT/profile.tgz -C /tmp profile
(one tarball: a device call brings back at most 8 files, and the traces alone are more; 2026-11-27 lost the
passes' JSON that way).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

PASSES = {  # name -> (esftctl's runtime, eager, esftctl's one set of graphs); the order is the run order
    "esft-graphs": (True, False, True),
    "plain-graphs": (False, False, True),
    "esft-eager": (True, True, True),
    "plain-eager": (False, True, True),
    "unfolded-graphs": (True, False, True),  # esft-graphs with the reroute's own kernel (FOLD_ENV=0)
    "plain2-graphs": (False, False, True),  # plain-graphs again (with --fresh-caches: its own picks)
    "esft-vllm-graphs": (True, False, False),
}
# A pass's seconds at the default steps, with a margin: on an H200 (2026-11-29) esft-graphs took 105 s and
# plain-graphs 86 at batches 1,2 (the engine's start is most of it); a pass started with less left is cut.
PASS_SECONDS = {"esft-graphs": 120, "plain-graphs": 100, "esft-eager": 60, "plain-eager": 50, "unfolded-graphs": 120,
                "plain2-graphs": 100, "esft-vllm-graphs": 110}
OPT_IN_PASSES = ("esft-vllm-graphs", "unfolded-graphs", "plain2-graphs")  # run only when named (or --capture-ab)
ADAPTERS, PROMPT = 20, 32
LOG_PATTERNS = {"graph_capture_s": r"Graph capturing finished in ([\d.]+) secs", "graph_gib":
                r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB", "init_engine_s":
                r"init engine .*? took ([\d.]+) s", "v2_runner": r"(Using V2 Model Runner)"}


# --small: a tiny DeepSeek-V2 (FACTS.md's) for a smoke run of the script on vLLM's CPU build (eager passes)
SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, qk_nope_head_dim=32, v_head_dim=64,
             bos_token_id=1000, eos_token_id=1001, pad_token_id=1002)


def prepare(work: Path, layers: int, small: bool) -> tuple[Path, list[Path]]:
    import torch

    from esftctl.bench.synthetic_model import deepseek_v2_lite_config, write_adapter, write_model
    from esftctl.formats.checkpoint import MoECheckpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tag = f"{layers}{'-small' if small else ''}"
    base = work / f"base-{tag}"
    if not base.exists():
        write_model(base, deepseek_v2_lite_config(num_hidden_layers=layers, **(SMALL if small else {})), device=device)
    bundles = []
    for k in range(2):
        path = work / f"adapter-{tag}-{k}"
        if not path.exists():
            write_adapter(MoECheckpoint(base), path, f"d{k}", most=9 if not small else 3, mean=4.5 if not small else 2,
                          seed=k + 1, device=device)
        bundles.append(path)
    if device == "cuda":
        torch.cuda.empty_cache()
    return base, bundles


def stepper(engine, tokens: dict[str, int]):
    """One engine step as a function: it records each tracked request's output tokens in `tokens`."""
    def step() -> None:
        for o in engine.step():  # vLLM may suffix the ids it was given
            rid = o.request_id if o.request_id in tokens else o.request_id.rsplit("-", 1)[0]
            if rid in tokens:
                tokens[rid] = len(o.outputs[0].token_ids)
    return step


def mixes(esft: bool, batch: int) -> dict[str, list[int | None]]:
    """Mix name -> the adapter index of each of the batch's requests (None: the base)."""
    out = {"base": [None] * batch}
    if esft:
        out |= {"1 adapter": [0] * batch, f"{ADAPTERS} adapters": [i % ADAPTERS for i in range(batch)]}
    return out


def run_pass(args) -> None:
    """One engine, every batch and mix: OUT/<pass>.json."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CUSTOM_SCOPES_FOR_PROFILING="1")
    esft, eager, one_set = PASSES[args.run_pass]
    out, base = Path(args.out), Path(args.base)
    bundles = [Path(p) for p in args.bundles.split(",")]
    names = [f"a{i}" for i in range(ADAPTERS)]
    lora = {}
    if esft:
        from esftctl.serve import free_port, plan

        served = plan(base, [f"{n}={bundles[i % len(bundles)]}" for i, n in enumerate(names)], port=free_port(),
                      state_dir=out / f"state-{args.run_pass}")
        os.environ.update(served.config().to_env())
        lora = dict(enable_lora=True, max_loras=served.slots, max_cpu_loras=served.slots)
        if not one_set:  # vLLM's own LoRA graph sets, for the capture A/B: the plugin looks install() up when it runs
            from esftctl.runtime.vllm import graphs

            graphs.install = lambda: None
    import torch
    from step_profile import STEP, step_components
    from torch.profiler import ProfilerActivity, profile, record_function
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from esftctl.runtime.vllm.profiling import install_scopes

    scopes = install_scopes()
    started = time.perf_counter()
    llm = LLM(model=str(base), dtype="bfloat16", enforce_eager=eager, gpu_memory_utilization=0.6, max_model_len=2048,
              seed=0, **lora)
    engine = llm.llm_engine
    requests = [LoRARequest(n, i + 1, str(bundles[i % len(bundles)])) for i, n in enumerate(names)] if esft else []
    for r in requests:
        engine.add_lora(r)
    result = {"pass": args.run_pass, "esft": esft, "eager": eager, "one_graph_set": one_set, "scopes": scopes,
              "engine_s": time.perf_counter() - started, "vllm": __import__("vllm").__version__,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "layers": args.layers,
              "runs": []}
    params = SamplingParams(max_tokens=args.warm + args.timed + args.steps + 16, ignore_eos=True, temperature=0)
    serial = 0
    for batch in (int(b) for b in args.batches.split(",")):
        for mix, adapters in mixes(esft, batch).items():
            ids = []
            for a in adapters:
                serial += 1
                ids.append(f"r{serial}")
                engine.add_request(ids[-1], {"prompt_token_ids": [(serial * 7919 + t) % 1000 for t in range(PROMPT)]},
                                   params, lora_request=requests[a] if a is not None else None)
            tokens = dict.fromkeys(ids, 0)

            step = stepper(engine, tokens)
            for _ in range(100):  # every request past its prefill
                if min(tokens.values()) >= 2:
                    break
                step()
            else:
                raise RuntimeError(f"batch {batch} {mix}: the requests did not reach decoding in 100 steps")
            for _ in range(args.warm):
                step()
            before, t0 = sum(tokens.values()), time.perf_counter()
            for _ in range(args.timed):
                step()
            decode_steps = (sum(tokens.values()) - before) / batch
            timed_ms = (time.perf_counter() - t0) * 1e3 / max(decode_steps, 1)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities) as prof:
                for _ in range(args.steps):
                    with record_function(STEP):
                        step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            trace_file = out / f"{args.run_pass}-{mix.replace(' ', '')}-b{batch}.json"
            prof.export_chrome_trace(str(trace_file))
            trace = json.loads(trace_file.read_text())
            with gzip.open(f"{trace_file}.gz", "wt") as f:
                json.dump(trace, f)
            trace_file.unlink()
            split = step_components(trace)
            result["runs"].append({"batch": batch, "mix": mix, "step_ms_unprofiled": timed_ms, **split})
            print(f"{args.run_pass} b{batch} {mix}: {timed_ms:.3f} ms/step unprofiled, {split['step_ms']:.3f} profiled",
                  flush=True)
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
    if args.prefill:
        result["runs"] += prefill_runs(engine, requests, args, out, esft)
    (out / f"{args.run_pass}.json").write_text(json.dumps(result, indent=1))


def prefill_runs(engine, requests: list, args, out: Path, esft: bool) -> list[dict]:
    """TTFT in-process: one `--prefill`-token prompt, added alone or beside B requests decoding (B in
    `--prefill-beside`), timed from its add_request to its first token (`--timed-prefills` times), then profiled
    (3 more, each step in a STEP scope). Mixes: the prompt on the base, or on adapter 0 with the decoders on
    adapters 1..B (esft passes). Why: 2026-11-27's protocol grid (H100) put esftctl's median TTFT at 20 adapters at
    1.14x plain vLLM's at 1 request/s and 2.4x at 2, while TPOT was 1.03x at 1 request/s (most of it was later
    traced to the base's prefix-cache hits: esftctl.bench.serve.NO_PREFIX_CACHE)."""
    import torch
    from step_profile import STEP, step_components
    from torch.profiler import ProfilerActivity, profile, record_function
    from vllm import SamplingParams

    first, long = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=4000, ignore_eos=True,
                                                                               temperature=0)
    runs, serial = [], 10_000
    for beside in (int(b) for b in args.prefill_beside.split(",")):
        for mix in ("base", "1 adapter") if esft else ("base",):
            on = requests if mix != "base" else []  # the prompt on on[0], decoder i on on[1 + i]
            decoders = [f"d{serial + i}" for i in range(beside)]
            for i, rid in enumerate(decoders):
                engine.add_request(rid, {"prompt_token_ids": [(i * 31 + t) % 1000 for t in range(PROMPT)]}, long,
                                   lora_request=on[1 + i] if on else None)
            tokens: dict[str, int] = dict.fromkeys(decoders, 0)

            step = stepper(engine, tokens)
            while decoders and min(tokens[d] for d in decoders) < 2:
                step()

            def one_prefill(scoped: bool) -> tuple[float, int]:
                nonlocal serial
                serial += 1
                rid = f"p{serial}"
                tokens[rid] = 0
                engine.add_request(rid, {"prompt_token_ids": [(serial * 7919 + t) % 1000 for t in range(args.prefill)]},
                                   first, lora_request=on[0] if on else None)
                t0, steps = time.perf_counter(), 0
                while tokens[rid] < 1:
                    with record_function(STEP) if scoped else contextlib.nullcontext():
                        step()
                    steps += 1
                return (time.perf_counter() - t0) * 1e3, steps

            one_prefill(False)  # warm: this prompt length's first prefill
            timed = sorted(one_prefill(False) for _ in range(args.timed_prefills))
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities) as prof:
                profiled = [one_prefill(True) for _ in range(3)]
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            trace_file = out / f"{args.run_pass}-prefill-{mix.replace(' ', '')}-b{beside}.json"
            prof.export_chrome_trace(str(trace_file))
            trace = json.loads(trace_file.read_text())
            trace_file.unlink()
            ms = [t for t, _ in timed]
            runs.append({"phase": "prefill", "batch": beside, "mix": mix, "prompt": args.prefill,
                         "ttft_ms_median": ms[len(ms) // 2], "ttft_ms_min": ms[0], "ttft_ms_max": ms[-1],
                         "steps_per_prefill": sum(n for _, n in profiled) / len(profiled),
                         "step_ms_unprofiled": ms[len(ms) // 2] / max(1, timed[len(ms) // 2][1]),
                         **step_components(trace)})
            print(f"{args.run_pass} prefill {args.prefill} beside {beside} {mix}: TTFT {ms[len(ms) // 2]:.2f} ms "
                  f"(min {ms[0]:.2f}, max {ms[-1]:.2f}), {runs[-1]['steps_per_prefill']:.1f} steps", flush=True)
            engine.abort_request(decoders)
            while engine.has_unfinished_requests():
                engine.step()
    return runs


def from_log(text: str) -> dict:
    found = {}
    for key, pattern in LOG_PATTERNS.items():
        matches = re.findall(pattern, text)
        if matches:
            found[key] = True if key == "v2_runner" else sum(float(m) for m in matches)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/profile-step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--timed", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8, help="profiled decode steps per batch and mix")
    parser.add_argument("--passes", default=",".join(p for p in PASSES if p not in OPT_IN_PASSES),
                        help="of " + ", ".join(PASSES) + " (unfolded-graphs: esft-graphs with ESFTCTL_FOLD_REROUTE=0; "
                             "plain2-graphs: plain-graphs again)")
    parser.add_argument("--fresh-caches", action="store_true",
                        help="each pass compiles in its own new cache (Inductor's autotuned picks drawn afresh)")
    parser.add_argument("--capture-ab", action="store_true", help="also esft-vllm-graphs (vLLM's two graph sets)")
    parser.add_argument("--budget", type=float, default=330, help="seconds for everything; later passes are skipped")
    parser.add_argument("--small", action="store_true", help="a tiny model: a smoke run on vLLM's CPU build")
    parser.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill phase (0: none)")
    parser.add_argument("--prefill-beside", default="0,4", help="requests decoding beside each timed prefill")
    parser.add_argument("--timed-prefills", type=int, default=10, help="timed prefills per mix (their median)")
    parser.add_argument("--run-pass", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--bundles", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.run_pass:
        return run_pass(args)
    started = time.monotonic()
    base, bundles = prepare(Path(args.work), args.layers, args.small)
    print(f"model and adapters ready in {time.monotonic() - started:.0f} s", flush=True)
    from esftctl.runtime.vllm.topk import FOLD_ENV

    passes = args.passes.split(",") + (["esft-vllm-graphs"] if args.capture_ab else [])
    results, skipped = {}, []
    for name in passes:
        left = args.budget - (time.monotonic() - started)
        if left < PASS_SECONDS[name]:
            skipped.append(name)
            continue
        cmd = [sys.executable, __file__, "--out", str(out), "--run-pass", name, "--base", str(base),
               "--bundles", ",".join(map(str, bundles)), "--layers", str(args.layers), "--batches", args.batches,
               "--warm", str(args.warm), "--timed", str(args.timed), "--steps", str(args.steps),
               "--prefill", str(args.prefill), "--prefill-beside", args.prefill_beside,
               "--timed-prefills", str(args.timed_prefills)]
        log = out / f"{name}.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            try:
                env = dict(os.environ)
                if name.startswith("unfolded"):
                    env[FOLD_ENV] = "0"
                if args.fresh_caches:
                    env["VLLM_CACHE_ROOT"] = str(Path(args.work).resolve() / f"cache-{name}-{os.getpid()}")
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=left, env=env).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = log.read_text(errors="replace")
        done = out / f"{name}.json"
        results[name] = {**(json.loads(done.read_text()) if done.exists() else {}), "rc": rc,
                         "wall_s": time.monotonic() - t0, **from_log(text)}
        print(f"{name}: rc {rc}, {results[name]['wall_s']:.0f} s, {from_log(text)}", flush=True)
        if rc != 0:
            print("\n".join(text.splitlines()[-25:]), flush=True)
    summary = {"passes": results, "skipped": skipped, "layers": args.layers, "total_s": time.monotonic() - started}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    report(results)
    print(f"skipped for the budget: {skipped}" if skipped else "every pass ran", f"; {summary['total_s']:.0f} s")


def diff_table(title: str, plain: dict, other: dict, label: str):
    """The kernels whose time differs most from plain vLLM's (step_profile.kernel_diff); `label`
    names the other column."""
    from rich.table import Table
    from step_profile import kernel_diff

    table = Table(title=f"{title} (us per step; the kernels that differ most)")
    for c in ("kernel", "plain", label, "delta", "launch shapes, where they differ"):
        table.add_column(c, justify="left" if c in ("kernel", "launch shapes, where they differ") else "right")
    for d in kernel_diff(plain, other, limit=6):
        shapes = f"{d['base_shape']} / {d['other_shape']}" if d["shapes_differ"] else ""
        table.add_row(d["name"][:70], f"{d['base_ms'] * 1e3:.1f}", f"{d['other_ms'] * 1e3:.1f}",
                      f"{d['delta_ms'] * 1e3:+.1f}", shapes)
    return table


def report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    from step_profile import ROWS, row_value

    console = Console(width=200)
    for mode in ("graphs", "eager"):
        runs = [(name.split("-")[0], r) for name, res in results.items() if name.endswith(f"-{mode}")
                for r in res.get("runs", [])]
        for phase, batch in sorted({(r.get("phase", "decode"), r["batch"]) for _, r in runs}):
            cols = [(f"{who} {r['mix']}", r) for who, r in runs
                    if r["batch"] == batch and r.get("phase", "decode") == phase]
            title = (f"decode step, batch {batch}" if phase == "decode" else
                     f"prefill of {cols[0][1]['prompt']} tokens beside {batch} decoding")
            table = Table(title=f"{title}, {mode} (ms per step)")
            table.add_column("component")
            for label, _ in cols:
                table.add_column(label, justify="right")
            if phase == "prefill":
                table.add_row("TTFT in-process, median (min-max)", *(
                    f"{r['ttft_ms_median']:.2f} ({r['ttft_ms_min']:.2f}-{r['ttft_ms_max']:.2f})" for _, r in cols))
                table.add_row("steps to the first token", *(f"{r['steps_per_prefill']:.1f}" for _, r in cols))
            table.add_row("step (unprofiled)", *(f"{r['step_ms_unprofiled']:.3f}" for _, r in cols))
            for label, key in ROWS:
                table.add_row(label, *(f"{v:.3f}" if (v := row_value(r, key)) is not None else "-" for _, r in cols))
            table.add_row("graph kernels seen", *(str(r["graph_kernels_seen"]) for _, r in cols))
            console.print(table)
            plain = next((r for label, r in cols if label.startswith("plain ") and r.get("kernels")), None)
            for label, r in cols:
                if plain is not None and r is not plain and r.get("kernels"):
                    console.print(diff_table(f"{title}, {mode}: {label} against plain vLLM", plain, r, label))
    capture = Table(title="engine start-up (vLLM's log)")
    for c in ("pass", "capture s", "graph GiB", "V2 runner", "rc"):
        capture.add_column(c)
    for name, res in results.items():
        capture.add_row(name, str(res.get("graph_capture_s", "-")), str(res.get("graph_gib", "-")),
                        str(res.get("v2_runner", False)), str(res["rc"]))
    console.print(capture)


if __name__ == "__main__":
    main()
