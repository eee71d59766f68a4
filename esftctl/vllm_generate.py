"""Greedy generation with plain vLLM, in a process of its own: the reference every serving test compares with.

    python -m esftctl.vllm_generate MODEL_DIR[,MODEL_DIR...] REQUEST.json OUT.json

REQUEST.json holds {"prompts": [...], "max_tokens": N, "logprobs": K, "engine": {vLLM engine arguments}}
("engine" is optional: by default eager, max_model_len 256, max_num_seqs 16; a serving test passes the
settings its server runs with, e.g. enforce_eager false for CUDA graphs); OUT.json gets, per prompt, the
generated token ids, the text, and the top-K logprobs of every step (for several models, comma-separated,
an object {model dir: that list}; each model is served alone, one after another, by one plain vLLM
engine at a time). vLLM starts its engine in a spawned process, so this stays a script behind a
`__main__` guard rather than a function imported by tests.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def engine_env() -> dict[str, str]:
    """Environment for a small vLLM engine: on the CPU 1 GiB of KV cache; the engine in this process (it starts
    tens of seconds sooner, once per model); no usage reporting."""
    return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


DEFAULT_ENGINE = {"enforce_eager": True, "max_model_len": 256, "max_num_seqs": 16}


def generate(model_dir: str, prompts: list[str], max_tokens: int, logprobs: int, engine: dict | None = None
             ) -> list[dict]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", seed=0, **(engine if engine is not None else DEFAULT_ENGINE))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
    results = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        results.append({
            "prompt": out.prompt,
            "prompt_token_ids": list(out.prompt_token_ids),
            "token_ids": list(completion.token_ids),
            "text": completion.text,
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in (completion.logprobs or [])],
        })
    return results


def main() -> None:
    model_dir, request_file, out_file = sys.argv[1:4]
    os.environ.update(engine_env())
    request = json.loads(Path(request_file).read_text())
    engine = request.get("engine")
    args = (request["prompts"], request.get("max_tokens", 16), request.get("logprobs", 5), engine)
    models = model_dir.split(",")
    if len(models) == 1:
        results = generate(models[0], *args)
    elif engine is not None and not engine.get("enforce_eager", True):  # CUDA graphs
        results = {m: _generate_apart(m, request_file, out_file) for m in models}
    else:
        results = {m: generate(m, *args) for m in models}
    Path(out_file).write_text(json.dumps(results))


def _generate_apart(model_dir: str, request_file: str, out_file: str) -> list[dict]:
    """One model in a process of its own: engines that capture CUDA graphs do not follow one another in one
    process (on an H100, the fourth of four Qwen3-MoE engines failed vLLM's memory profiler, and after
    `cleanup_dist_env_and_memory` a DeepSeek-V2 engine failed torch's allocator assert in graph capture)."""
    import subprocess

    one = f"{out_file}.{abs(hash(model_dir))}.json"
    subprocess.run([sys.executable, "-m", "esftctl.vllm_generate", model_dir, request_file, one], check=True)
    results = json.loads(Path(one).read_text())
    os.unlink(one)
    return results


if __name__ == "__main__":
    main()
