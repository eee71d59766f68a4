"""vLLM (the CPU build here) loads the tiny base and generates what transformers generates.

This test found that vLLM 0.32's CPU rotary kernel mishandles DeepSeek-V2's 3-D queries (greedy tokens
parted from transformers with gaps of 2.6 nats); esftctl's vLLM plugin (runtime/vllm/cpu_rope.py) fixes it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import plain_vllm

from esftctl.jsonl import read_jsonl
from esftctl.world.tasks import TASKS

# Greedy tokens may part only where transformers itself nearly ties (bf16 kernels differ): a gap under this.
NEAR_TIE = 0.25
# vLLM's bf16 log-probabilities against transformers' float32 ones: bf16 noise is a few hundredths.
LOGPROB_TOLERANCE = 0.1


def hf_greedy(model, tok, prompt_ids: list[int], steps: int):
    """Greedy continuation and, per step, the log-probabilities, with transformers in float32."""
    ids = list(prompt_ids)
    out, logprobs = [], []
    for _ in range(steps):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        token = int(lp.argmax())
        out.append(token)
        logprobs.append(lp)
        ids.append(token)
        if token == tok.eos_token_id:
            break
    return out, logprobs


@pytest.mark.vllm
def test_vllm_greedy_matches_transformers(world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = [e["prompt"] for t in TASKS for e in list(read_jsonl(world.data_file(t.name, "test")))[:2]]
    results = plain_vllm({"base": world.base_dir}, prompts, tmp_path, max_tokens=4, logprobs=5)["base"]

    tok = AutoTokenizer.from_pretrained(world.base_dir)
    model = AutoModelForCausalLM.from_pretrained(world.base_dir, dtype=torch.float32).eval()
    first_tokens_equal = 0
    for r in results:
        assert r["prompt_token_ids"] == tok(r["prompt"])["input_ids"]
        hf_tokens, hf_logprobs = hf_greedy(model, tok, r["prompt_token_ids"], len(r["token_ids"]))
        for step, (mine, theirs) in enumerate(zip(hf_tokens, r["token_ids"])):
            if mine != theirs:
                gap = float(hf_logprobs[step][mine] - hf_logprobs[step][theirs])
                assert gap < NEAR_TIE, (f"{r['prompt']!r} step {step}: vLLM chose {theirs}, transformers {mine} "
                                        f"(gap {gap:.3f})")
                break  # contexts differ from here on
            vllm_logprob = r["logprobs"][step][str(theirs)]
            assert abs(vllm_logprob - float(hf_logprobs[step][mine])) < LOGPROB_TOLERANCE, (r["prompt"], step)
            first_tokens_equal += step == 0
    assert first_tokens_equal >= len(results) - 1
