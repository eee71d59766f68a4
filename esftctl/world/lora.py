"""LoRA fine-tuning of the tiny world's DeepSeek-V2 base (peft): the baseline ESFT is compared with.

Targets, rank `rank` (8) and alpha 2 x rank on each:
- attention: q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj (nn.Linear, ordinary LoRA layers);
- every routed expert: transformers 5 keeps a layer's experts fused as parameters, `mlp.experts.gate_up_proj`
  [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], not nn.Linear modules. peft (>= 0.17) reaches them
  through `target_parameters`: its ParamWrapper gives each expert its own A and B (A [E*r, in], B [out, E*r])
  and adds B_e A_e to expert e's weight through a parametrization. gate_up_proj is gate_proj and up_proj
  fused, so it gets rank 2 x rank (and alpha 2 x alpha), peft's own convention for fused experts: the same
  capacity as rank `rank` on each of the two;
- the shared experts' and the dense layer's MLP (gate_proj, up_proj, down_proj), also through
  `target_parameters` (their `.weight`): peft 0.21 maps any target_modules entry named gate_proj, up_proj or
  down_proj on a DeepSeek-V2 model to the fused experts (to load adapters trained under transformers 4), so
  naming them as modules would silently leave the shared experts and the dense MLP without LoRA.
Not the router, norms, embeddings or the LM head.

Learning rate: `LR` = 3e-3, chosen on the tiny world v4 (recipe's 250 steps of 16, half replayed; held-out
exact match, task / general; base 6% and 4% / 97.7%):
    lr       arithmetic      translation
    1e-3     62.5% / 91.3%   79.0% / 94.0%
    3e-3     78.5% / 94.3%   85.5% / 95.7%
    1e-2     0% / 0% (diverged)  81.5% / 82.0%
LoRA usually wants a larger step than full-weight tuning, but ESFT's 1e-2 is already large for this tiny model,
and LoRA's updates compound (A and B both move, scaled by alpha / r = 2): at 1e-2 it diverges on arithmetic.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Sequence

import torch

from esftctl.atomic import atomic_dir
from esftctl.jsonl import Example
from esftctl.world.models import save_model
from esftctl.world.training import train

RANK = 8
LR = 3e-3
ATTENTION = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MLP = re.compile(r"^model\.layers\.\d+\.mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight$")


def lora_config(model, rank: int = RANK):
    """peft's LoraConfig for `model` (a transformers DeepSeek-V2): the targets named in the module docstring."""
    from peft import LoraConfig

    params = [n for n, _ in model.named_parameters() if _EXPERTS.match(n) or _MLP.match(n)]
    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", target_modules=list(ATTENTION),
                      target_parameters=params, rank_pattern={r"experts\.gate_up_proj": 2 * rank},
                      alpha_pattern={r"experts\.gate_up_proj": 4 * rank})


def lora_model(base_dir: Path, *, rank: int = RANK, seed: int = 0):
    """The base (float32) wrapped by peft with fresh LoRA weights (B = 0, so it computes the base exactly)."""
    import warnings

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)  # peft draws A at random
    with warnings.catch_warnings():  # peft's notes on patterns it also checks against non-matching modules
        warnings.simplefilter("ignore", RuntimeWarning)
        return get_peft_model(model, lora_config(model, rank))


def lora_parameters(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "lora_" in n]


def lora_finetune(base_dir: Path, examples: Sequence[Example], out_dir: Path, *, general: Sequence[Example] = (),
                  steps: int, batch_size: int, lr: float = LR, replay: float, seed: int = 0, rank: int = RANK,
                  on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train LoRA weights only (everything else frozen); write out_dir/adapter (peft's folder: adapter_config.json
    + adapter_model.safetensors, bf16) and out_dir/merged (base + B A, a bf16 checkpoint like the base's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = lora_model(base_dir, rank=rank, seed=seed)
    params = lora_parameters(model)
    assert params and all(p.requires_grad for p in params)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    losses = train(model, tokenizer, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                   completion_only=True, parameters=params, on_step=on_step, general=general, replay=replay)
    with atomic_dir(out_dir, overwrite=True) as tmp:
        state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if "lora_" in k}
        model.save_pretrained(tmp / "adapter", state_dict=state)
        save_model(model.merge_and_unload(), tmp / "merged", tokenizer)
    return losses
