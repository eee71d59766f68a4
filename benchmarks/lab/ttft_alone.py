"""TTFT of a prompt that meets an idle server, plain vLLM against esftctl, to the millisecond (issue 29.2).

At 1 request/s on three H200 cards (2026-11-27), prompts prefilled alone took esftctl 34.6-35.0 ms against plain
vLLM's 26.5-28.4 ms on the same card, while beside decodes both took the same; in-process the engine's prefill
step cost the same (profile_step.py). One cost sat exactly there: every serving step first asked whether a second
had passed since the status file was last written, and after a pause the answer was always yes, so the step that
prefilled a prompt arriving at an idle server built the status record (summing the base's 5,291 tensor sizes
twice, 4.2 ms on an H100's host) and wrote it (JSON, fsync, rename) before the forward. Since then the file is
refreshed off the steps (esftctl.runtime.engine_status.StatusFile) and the sum is cached. This measures what is
left, and what the old write cost, with prompts that all meet an idle server (RESULTS.md, 2026-11-27).

Arms, one server start each (DeepSeek-V2-Lite-shaped base, `bench serve`'s engine arguments, CUDA graphs, two
DeepSeek-sized adapters): `plain` (plain vLLM), `esftctl` (its state folder in /tmp, as `esftctl serve` makes it),
`esftctl-step-write` (the write as it was, put back by status_in_step/sitecustomize.py on the server's path, its
state in --work as `bench serve` had it: /dev/shm on the grid's cards). Each prompt (random token ids, so no cache
can help) goes after `--gap` seconds of idle (more than the status file's second), streams `--output` tokens, and
its TTFT is the client's (request sent to first chunk). esftctl's arms send to the base's name and to an adapter's
in turn. Also vLLM's own split from /metrics (queue, scheduled to first token, its TTFT), and each prompt's split
from the engine's step times without a profiler (ESFTCTL_STEP_TIMES, esftctl.runtime.vllm.profiling; in
OUT/steps/ARM): before the engine (sent to the scheduler's first step that schedules the prompt: the API server,
tokenizing, the hop to the engine core), the engine (that step's schedule to the end of the first `update_from_output`
after it: the prefill step and its first token; with the host span of its `execute_model`), and after (the first
token's way back to the client). On one H200 (2026-11-29, the grid's round 2) a lone 256-token prompt's floor was
0.6-1.7 ms later in esftctl than in plain vLLM, of which the reroute explains 0.07 ms; this says where the rest is.
Writes OUT/ttft_alone.json.
Usage (device, after ../shared/gpu/README.md's install; about 2.5 min a start and 1.3 s a prompt):
  PYTHONPATH=/tmp/site python3 benchmarks/lab/ttft_alone.py --out $OUT
A smoke run on vLLM's CPU build: `--model tiny --lengths 16 --prompts 2 --gap 1.1` (the tiny world's base).
"""

import argparse
import bisect
import collections
import http.client
import json
import os
import random
import statistics
import time
import urllib.parse
from pathlib import Path

from esftctl.bench import serve_models
from esftctl.bench.serve import PROFILES
from esftctl.bench.serve_runs import server_means, server_times
from esftctl.runtime.vllm.profiling import STEP_TIMES_ENV
from esftctl.serve import Server, free_port, plan
from esftctl.serve_client import request

SHIM = Path(__file__).resolve().parent / "status_in_step"


def first_chunk_ms(url: str, model: str, prompt: list[int], output: int) -> float:
    """Milliseconds from sending a streamed completion to its first chunk; the rest is read and dropped."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"{model}: HTTP {response.status}: {response.read()[:300]!r}")
    first = None
    for line in response:
        if first is None and line.startswith(b"data: {"):
            first = (time.perf_counter() - start) * 1e3
            if "error" in json.loads(line[len(b"data: "):]):
                raise SystemExit(f"{model}: {line.decode()[:300]}")
    conn.close()
    return first


def quartiles(v: list[float]) -> list[float]:
    """The first and third quartile: TTFT here has two modes (about 22 and 27 ms for 128 tokens on an H100), between
    which a median of 30 can jump."""
    return statistics.quantiles(v, n=4)[::2] if len(v) > 1 else [v[0], v[0]]


def engine_steps(folder: Path) -> dict[str, list[tuple[float, float, int]]]:
    """The engine's step times that ESFTCTL_STEP_TIMES wrote into `folder` (esftctl.runtime.vllm.profiling):
    per part, (start, end, tokens) in time order."""
    parts: dict[str, list[tuple[float, float, int]]] = collections.defaultdict(list)
    for path in folder.glob("steps-*.tsv"):
        for line in path.read_text().splitlines():
            part, start, end, tokens = line.split()
            parts[part].append((float(start), float(end), int(tokens)))
    return {part: sorted(rows) for part, rows in parts.items()}


def steps_so_far(url: str, model: str, prompt: list[int], folder: Path) -> dict[str, list[tuple[float, float, int]]]:
    """engine_steps after a pause and one more request (`prompt`, one token): the engine writes the step times
    before a pause at its next step."""
    time.sleep(0.5)
    first_chunk_ms(url, model, prompt, 1)
    return engine_steps(folder)


def split_ttft(steps: dict, sent: float, ttft_ms: float, length: int) -> dict | None:
    """One lone prompt's TTFT as the engine's step times place it (ms): before the engine (sent to the start of the
    first `schedule` of at least `length` tokens after it), in the engine (that schedule's start to the end of the
    first `update_from_output` after it), the host span of the `execute_model` of those tokens, and after (to the
    client's first chunk). None where the steps do not show the prompt (no step times, or not alone)."""
    def after(part: str, t: float) -> list[tuple[float, float, int]]:  # the part's rows that start at t or later
        rows = steps.get(part, [])
        return rows[bisect.bisect_left(rows, (t,)):]

    first = next((row for row in after("schedule", sent) if row[2] >= length), None)
    if first is None:
        return None
    end = next((e for _, e, _ in after("output", first[0])), None)
    execute = next((e - s_ for s_, e, t in after("execute", first[0]) if t >= length), None)
    arrived = sent + ttft_ms / 1e3
    if end is None or execute is None or end > arrived:
        return None
    return {"before_ms": (first[0] - sent) * 1e3, "engine_ms": (end - first[0]) * 1e3, "execute_ms": execute * 1e3,
            "after_ms": (arrived - end) * 1e3}


def probe(url: str, models: list[str], args, vocab: int, steps_dir: Path | None = None) -> dict:
    """Every (length, model) `--prompts` times, interleaved, each after `--gap` s idle: TTFT ms by key, and with
    `steps_dir` (the server's ESFTCTL_STEP_TIMES) each prompt's split (split_ttft), medians by key."""
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab // 4, vocab) for _ in range(length)]

    for model in models:  # warm-up: each model and length once
        for length in args.lengths:
            first_chunk_ms(url, model, prompt(length), args.output)
    before = server_times([url])
    out: dict[str, list[float]] = {}
    sent: dict[str, list[tuple[float, int]]] = {}
    for _ in range(args.prompts):
        for length in args.lengths:
            for model in models:
                time.sleep(args.gap)
                key = f"{model} {length}"
                sent.setdefault(key, []).append((time.perf_counter(), length))  # the client's clock is the engine's
                out.setdefault(key, []).append(first_chunk_ms(url, model, prompt(length), args.output))
    server = server_means(before, server_times([url]))
    summary = {key: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "n": len(v),
                     "quartiles_ms": quartiles(v),
                     "ttft_ms": [round(t, 3) for t in v]} for key, v in out.items()}
    if steps_dir is not None:
        steps = steps_so_far(url, models[0], prompt(8), steps_dir)
        for key, v in out.items():
            splits = [x for (at, length), t in zip(sent[key], v) if (x := split_ttft(steps, at, t, length))]
            summary[key]["engine_split"] = {part: statistics.median(x[part] for x in splits) for part in
                                            ("before_ms", "engine_ms", "execute_ms", "after_ms")} if splits else None
            summary[key]["engine_split_n"] = len(splits)
    return {"ttft": summary, "server": server}


def probe_parser(doc: str, name: str, *, arms: str) -> argparse.ArgumentParser:
    """The options this probe and mixed_step.py share: the model, where it is built, where results go, the arms."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v2-lite", choices=sorted(PROFILES))
    parser.add_argument("--work", type=Path, default=Path(f"/dev/shm/bench-{name}"))
    parser.add_argument("--scratch", type=Path, default=Path(f"/tmp/bench/scratch-{name}"))
    parser.add_argument("--out", type=Path, default=Path(f"/tmp/{name}"))
    parser.add_argument("--arms", default=arms)
    return parser


def prepare(args) -> tuple:
    """The base and two DeepSeek-sized adapters (`bench serve`'s), and the base's vocabulary size."""
    served = serve_models.prepare_base(args.model, args.work, print)
    serve_models.write_adapters(served, args.model, args.scratch, 2, distinct=2, shape="deepseek", on_step=print)
    return served, json.loads((served.base / "config.json").read_text())["vocab_size"]


def arm_plan(served, esft: bool, engine_args: list[str], *, state_dir: Path | None = None, **serve_settings):
    """One arm's server: plain vLLM, or esftctl with the adapters and exactly their memory set aside (and
    `serve_settings`, ServeSettings' fields such as group_adapters)."""
    return plan(served.base, [f"{n}={p}" for n, p in served.bundles.items()] if esft else [], name="base",
                esft=esft, port=free_port(), state_dir=state_dir, vllm_args=engine_args,
                adapter_memory=serve_models.adapter_bytes(served.base, served.bundles.values()) if esft else None,
                **serve_settings)


def main() -> None:
    parser = probe_parser(__doc__, "ttft", arms="plain,esftctl,esftctl-step-write")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256])
    parser.add_argument("--prompts", type=int, default=15, help="timed prompts per length and model")
    parser.add_argument("--output", type=int, default=4, help="tokens each prompt streams")
    parser.add_argument("--gap", type=float, default=1.3, help="idle seconds before each prompt")
    args = parser.parse_args()
    served, vocab = prepare(args)
    engine_args = list(PROFILES[args.model].engine_args)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "arms": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for arm in args.arms.split(","):
        esft = arm != "plain"
        state = args.work / "state" / arm if arm == "esftctl-step-write" else None  # None: a temporary one in /tmp
        server = arm_plan(served, esft, engine_args, state_dir=state)
        steps_dir = (args.out / "steps" / arm).resolve()
        steps_dir.mkdir(parents=True, exist_ok=True)
        os.environ[STEP_TIMES_ENV] = str(steps_dir)  # the server's processes inherit it
        path = os.environ.get("PYTHONPATH", "")
        if arm == "esftctl-step-write":
            os.environ["PYTHONPATH"] = f"{SHIM}:{path}" if path else str(SHIM)
        try:
            with Server(server) as running:
                start = time.perf_counter()
                running.wait_ready(timeout=1200)
                print(f"{arm}: ready in {time.perf_counter() - start:.0f} s; state {server.state}", flush=True)
                models = ["base", *list(served.bundles)[:1]] if esft else ["base"]
                result["arms"][arm] = probe(server.url, models, args, vocab, steps_dir)
                result["arms"][arm]["state"] = str(server.state)
                if esft:  # the engine's last refresh says which write it ran
                    written = request(server.url, "/esftctl/status").get("status_write", "off the steps")
                    if written != ("in the step" if arm == "esftctl-step-write" else "off the steps"):
                        raise SystemExit(f"{arm}: the engine's status was written {written}")
                    result["arms"][arm]["status_write"] = written
        finally:
            os.environ["PYTHONPATH"] = path
        for key, s in result["arms"][arm]["ttft"].items():
            q1, q3 = s["quartiles_ms"]
            print(f"{arm:20s} {key:14s} median {s['median_ms']:7.2f} ms  quartiles {q1:7.2f} {q3:7.2f}  "
                  f"min {s['min_ms']:7.2f}  max {s['max_ms']:7.2f}", flush=True)
            if s.get("engine_split"):
                print(f"{'':20s} {'':14s} medians of {s['engine_split_n']}: " + ", ".join(
                    f"{part[:-3]} {ms:.2f}" for part, ms in s["engine_split"].items()) + " ms", flush=True)
        print(f"{arm:20s} server: {result['arms'][arm]['server']}", flush=True)
        (args.out / "ttft_alone.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
