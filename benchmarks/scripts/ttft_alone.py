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
in turn. Also vLLM's own split from /metrics (queue, scheduled to first token, its TTFT). Writes OUT/ttft_alone.json.
Usage (device, after ../shared/gpu/README.md's install; about 2.5 min a start and 1.3 s a prompt):
  PYTHONPATH=/tmp/site python3 benchmarks/scripts/ttft_alone.py --out $OUT
A smoke run on vLLM's CPU build: `--model tiny --lengths 16 --prompts 2 --gap 1.1` (the tiny world's base).
"""

import argparse
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


def probe(url: str, models: list[str], args, vocab: int) -> dict:
    """Every (length, model) `--prompts` times, interleaved, each after `--gap` s idle: TTFT ms by key."""
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab // 4, vocab) for _ in range(length)]

    for model in models:  # warm-up: each model and length once
        for length in args.lengths:
            first_chunk_ms(url, model, prompt(length), args.output)
    before = server_times([url])
    out: dict[str, list[float]] = {}
    for _ in range(args.prompts):
        for length in args.lengths:
            for model in models:
                time.sleep(args.gap)
                out.setdefault(f"{model} {length}", []).append(first_chunk_ms(url, model, prompt(length), args.output))
    summary = {key: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "n": len(v),
                     "quartiles_ms": quartiles(v),
                     "ttft_ms": [round(t, 3) for t in v]} for key, v in out.items()}
    return {"ttft": summary, "server": server_means(before, server_times([url]))}


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


def arm_plan(served, esft: bool, engine_args: list[str], *, state_dir: Path | None = None):
    """One arm's server: plain vLLM, or esftctl with the adapters and exactly their memory set aside."""
    return plan(served.base, [f"{n}={p}" for n, p in served.bundles.items()] if esft else [], name="base",
                esft=esft, port=free_port(), state_dir=state_dir, vllm_args=engine_args,
                adapter_memory=serve_models.adapter_bytes(served.base, served.bundles.values()) if esft else None)


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
        path = os.environ.get("PYTHONPATH", "")
        if arm == "esftctl-step-write":
            os.environ["PYTHONPATH"] = f"{SHIM}:{path}" if path else str(SHIM)
        try:
            with Server(server) as running:
                start = time.perf_counter()
                running.wait_ready(timeout=1200)
                print(f"{arm}: ready in {time.perf_counter() - start:.0f} s; state {server.state}", flush=True)
                models = ["base", *list(served.bundles)[:1]] if esft else ["base"]
                result["arms"][arm] = probe(server.url, models, args, vocab)
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
        print(f"{arm:20s} server: {result['arms'][arm]['server']}", flush=True)
        (args.out / "ttft_alone.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
