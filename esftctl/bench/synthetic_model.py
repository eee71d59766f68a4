"""DeepSeek-V2-Lite-shaped checkpoints with trained-like random weights, generated on demand, never downloaded;
the one module that makes the benchmarks' synthetic weights (`trained_like`: compress, paging and these models).

Serving and offline benches need the real model's shapes, not its knowledge: 27 layers (the first dense),
26 MoE layers x 64 routed experts of 2048 x 1408, 2 shared experts, top-6, MLA (16 heads, kv_lora_rank
512), vocab 102400: 15.71 B parameters, 31.4 GB of bf16. Tensor names and shapes come from transformers'
own model class built on the meta device (no memory), so the folder is what `save_pretrained` would write
(the per-expert hub layout; a test checks it at a small size), but it is streamed: one tensor at a time from
a seeded generator (on the GPU when given one), written in shards of `shard_bytes` with an index, so it
needs one shard of host memory. Norm weights are ones; every matrix is `trained_like` (std 0.02 with a
log-normal scale per row), so activations and routing look like a trained model's, not like zeros.

The tokenizer is word-level over the whole vocabulary ("w0" ... "w102399", specials at DeepSeek's ids):
any token id decodes and re-encodes to itself, so a load generator's random prompts keep their lengths.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file

from esftctl.atomic import atomic_dir
from esftctl.bench.shapes import MoEShape, per_layer_counts
from esftctl.formats.architectures import EXPERT_WEIGHTS, architecture_for
from esftctl.formats.bundle import write_bundle
from esftctl.formats.checkpoint import ExpertWeights, MoECheckpoint, write_checkpoint

INDEX_FILE = "model.safetensors.index.json"
BOS, EOS, PAD = "<|begin_of_sentence|>", "<|end_of_sentence|>", "<|pad|>"


def trained_like(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """bf16 weights like trained ones: normal values, a log-normal scale per output row (std 0.02 x e^N(0, 0.25)),
    on the generator's device."""
    device = generator.device
    scale = torch.exp(torch.randn(*shape[:-1], 1, generator=generator, device=device) * 0.5) * 0.02
    return (torch.randn(*shape, generator=generator, device=device) * scale).to(torch.bfloat16)


def trained_like_expert(shape: MoEShape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {w: trained_like(rows_cols, g) for w, rows_cols in (
        ("gate", (shape.intermediate, shape.hidden)), ("up", (shape.intermediate, shape.hidden)),
        ("down", (shape.hidden, shape.intermediate)))}


def deepseek_v2_lite_config(**overrides):
    """DeepSeek-V2-Lite's structure (ESFT-vanilla-lite), without YaRN: its 4096-token pre-YaRN context."""
    from transformers import DeepseekV2Config

    settings = dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
        pad_token_id=100002, rms_norm_eps=1e-6)
    settings.update(overrides)
    return DeepseekV2Config(**settings)


QWEN3_30B_A3B_LAYERS = 48
QWEN3_SERVED_LAYERS = 32  # of the 48: why, in qwen3_30b_a3b_config


def qwen3_30b_a3b_config(**overrides):
    """Qwen3-30B-A3B's structure: 48 layers, every one MoE (128 experts of 2048 x 768, top-8, no shared expert),
    GQA attention (32 query heads, 4 KV heads of 128), vocab 151,936: 30.5 B parameters, 61.1 GB of bf16.
    A KV-heavy model beside MLA's DeepSeek-V2-Lite: 2 x 4 x 128 values per token and layer, 96 KiB per token at
    48 layers (DeepSeek-V2-Lite: 31 KiB).

    The benches generate it with `num_hidden_layers=QWEN3_SERVED_LAYERS` (32; each layer is 1.25 GB, the
    embeddings 1.2 GB), which keeps every layer's shape, so every step's per-layer work is the real model's:
    - served resident, the whole 48 layers (61 GB) do not fit the 48 GB card the memory-bound regime emulates,
      so plain vLLM would have no number at all; 32 layers (41.1 GB, 86% of the card) fill it as the issue asks,
      and leave plain vLLM about 3-5 GiB of KV cache (50-80 K tokens of 64 KiB: some 15 requests of 4 K), while
      paging frees 12 GB (compressed tier) to 38 GB (host tier) of experts for it;
    - the device has a 64 GB disk and 125 GB of host memory: 61 GB plus its 41 GB store fit neither the disk nor,
      with the host tier's 58 GB of pinned copies, the memory; 32 layers (41 GB in /dev/shm, the 26 GB store on
      disk, 39 GB pinned) fit both.
    vLLM's `--load-format dummy` (config only) would not do: `esftctl serve` checks and converts the checkpoint's
    experts, the store is made from real weights, and adapters are checked against them."""
    from transformers import Qwen3MoeConfig

    settings = dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=QWEN3_30B_A3B_LAYERS, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151646)
    settings.update(overrides)
    return Qwen3MoeConfig(**settings)


def checkpoint_tensors(config) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor `save_pretrained` writes for `config`, in the model's order."""
    from transformers import AutoModelForCausalLM

    arch = architecture_for(config.model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        if name.endswith(".experts.gate_up_proj"):  # transformers fuses experts in memory: [E, 2I, H]
            layer = int(name.split(".")[2])
            for e in range(t.shape[0]):
                for w in ("gate", "up"):
                    yield arch.expert_tensor(layer, e, w), (t.shape[1] // 2, t.shape[2])
        elif name.endswith(".experts.down_proj"):  # [E, H, I]
            layer = int(name.split(".")[2])
            for e in range(t.shape[0]):
                yield arch.expert_tensor(layer, e, "down"), tuple(t.shape[1:])
        else:
            yield name, tuple(t.shape)


def _tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16) if "norm" in name else torch.zeros(shape, dtype=torch.bfloat16)
    return trained_like(shape, g).cpu()


def write_model(out: str | Path, config, *, seed: int = 0, device: str = "cpu", shard_bytes: int = 2 << 30,
                overwrite: bool = False, on_progress: Callable[[int, int], None] = lambda done, total: None) -> Path:
    """Write a checkpoint of `config` with trained-like weights to `out` (shards + index + config + tokenizer).

    `on_progress(bytes written, total bytes)` is called after each tensor. The folder appears only once
    complete."""
    specs = list(checkpoint_tensors(config))
    total = sum(2 * _numel(shape) for _, shape in specs)
    g = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    with atomic_dir(out, overwrite=overwrite) as tmp:
        done, size, files = 0, 0, []
        for name, shape in specs:
            nbytes = 2 * _numel(shape)
            if size and size + nbytes > shard_bytes:
                files.append(_flush(tmp, shards.pop(), len(files)))
                shards.append({})
                size = 0
            shards[-1][name] = _tensor(name, shape, g)
            size += nbytes
            done += nbytes
            on_progress(done, total)
        files.append(_flush(tmp, shards.pop(), len(files)))
        weight_map = {}
        for k, (part, names) in enumerate(files):
            final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
            (tmp / part).rename(tmp / final)
            weight_map.update(dict.fromkeys(names, final))
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=1))
        saved = copy.deepcopy(config)
        saved.architectures = [_causal_lm_class(config)]  # vLLM picks its model class (and task) by this
        saved.save_pretrained(tmp)
        write_tokenizer(tmp, config)
    return Path(out)


def _causal_lm_class(config) -> str:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].__name__


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _flush(folder: Path, tensors: dict[str, torch.Tensor], k: int) -> tuple[str, list[str]]:
    part = f"part-{k:05d}.safetensors"
    save_file(tensors, folder / part, metadata={"format": "pt"})
    return part, list(tensors)


def write_tokenizer(out: Path, config) -> None:
    """A word-level tokenizer over the whole vocabulary (decoding joins tokens with spaces); BOS is prepended
    as DeepSeek's tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = {config.bos_token_id: BOS, config.eos_token_id: EOS, config.pad_token_id: PAD}
    vocab = {specials.get(i, f"w{i}"): i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, config.bos_token_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token="w0", model_max_length=config.max_position_embeddings)
    fast.save_pretrained(out)


def random_experts(base: MoECheckpoint, ids: dict[int, list[int]], g: torch.Generator
                   ) -> dict[int, dict[int, ExpertWeights]]:
    """Fresh trained-like weights for the given {layer: expert ids} of `base`."""
    shapes = base.expert_shapes()
    return {layer: {e: ExpertWeights(*(trained_like(shapes[w], g).cpu() for w in EXPERT_WEIGHTS)) for e in per}
            for layer, per in ids.items()}


def adapter_expert_ids(base: MoECheckpoint, most: int, mean: float, seed: int) -> dict[int, list[int]]:
    """Per MoE layer, random expert ids whose counts have the given maximum and mean (as ExpertWeave's Table 1)."""
    import random

    rng = random.Random(seed)
    counts = per_layer_counts(most, mean, len(base.moe_layers), seed)
    return {layer: sorted(rng.sample(range(base.num_experts), n)) for layer, n in zip(base.moe_layers, counts)}


def write_adapter(base: MoECheckpoint, out: str | Path, name: str, *, most: int, mean: float, seed: int,
                  device: str = "cpu") -> Path:
    """A bundle of `name` with trained-like experts, shaped by (most, mean) experts per layer."""
    g = torch.Generator(device=device).manual_seed(seed)
    return write_bundle(Path(out), name, base, random_experts(base, adapter_expert_ids(base, most, mean, seed), g))


def write_finetune(base_dir: str | Path, out: str | Path, *, kind: str, seed: int, experts_per_layer: int = 6,
                   scale: float = 0.5, overwrite: bool = False,
                   on_tensor: Callable[[str], None] = lambda name: None) -> Path:
    """A cheap fine-tune of a generated base, streamed shard by shard (one shard of memory, never the model):
    kind "esft" changes `experts_per_layer` random routed experts per MoE layer (what `pack` takes); kind "full"
    also every non-expert tensor (attention, norms, embeddings, routers, shared experts: what `consolidate` and
    `serve --variants` take). A changed tensor is itself + `scale` x its std x seeded noise."""
    if kind not in ("esft", "full"):
        raise ValueError(f"kind {kind!r}: esft or full")
    base = MoECheckpoint(base_dir)
    g = torch.Generator().manual_seed(seed)
    chosen = {(l, e) for l in base.moe_layers
              for e in torch.randperm(base.num_experts, generator=g)[:experts_per_layer].tolist()}
    changed = {n for l, e in chosen for n in base.expert_tensor_names(l, e).values()}

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in changed and (kind == "esft" or base.is_routed_expert_tensor(name)):
            return t
        noise_g = torch.Generator().manual_seed(seed * 1_000_003 + hash_name(name))
        x = t.float()
        spread = x.std() if x.numel() > 1 and x.std() > 0 else x.abs().mean().clamp_min(1e-3)
        return (x + scale * spread * torch.randn(x.shape, generator=noise_g)).to(t.dtype)

    return write_checkpoint(base, out, overwrite=overwrite, transform=transform, on_tensor=on_tensor)


def hash_name(name: str) -> int:
    """A stable small integer of a tensor name (Python's hash() of a str changes per process)."""
    import zlib

    return zlib.crc32(name.encode())
