"""`esftctl train`: ESFT fine-tuning from task data to an adapter bundle, without writing a whole model.

1. Data: JSONL of {"prompt", "completion"} lines, or of {"messages": [{"role", "content"}, ...]} lines rendered with
   the base's chat template (the last turn, the assistant's, is the completion: the loss is on it alone; earlier
   turns are context). A seeded share is held out for evaluation. With `replay`, a share of every batch comes from
   general data instead (retention: the selected experts serve general text too).
2. Experts: an expert config (`--config`, DeepSeek's or esftctl's, 0- or 1-based as `pack` reads it), or relevance on
   the training data's completions and selection at threshold p (`esftctl relevance` + `esftctl select`).
3. Fine-tuning of the selected routed experts only. transformers holds a layer's experts as one tensor per projection
   ([E, 2I, H] and [E, H, I]); the selected rows become float32 master parameters of their own (AdamW's state is kept
   for them alone, never for a frozen row), and before each forward of the layer a pre-hook writes them, in the
   model's dtype, into the frozen tensor in place (`_RowsInto`: no copy of the layer's experts). The experts' forward
   is transformers' grouped one with weight gradients for the selected experts alone, straight to their masters
   (esftctl.train_experts: not the whole layer's, a third of its experts' compute).
   Everything else is frozen and stays in the base's dtype, but what ESFT's switches say to train as whole tensors
   (TrainedTensors): the shared experts (`shared_experts`), every tensor outside the experts (`non_expert_modules`).
   An FP8 base loads dequantized (bf16) and its experts are stored quantized again. AdamW with linear warm-up and
   cosine decay, gradient clipping at 1, batches (and torch's generator) seeded by (seed, step): a run is
   reproducible, and one resumed from a checkpoint takes the same batches. `pack_length` packs a batch's short
   examples into rows with a block-diagonal mask (the same loss).
4. Checkpoints every `save_every` steps (the masters and AdamW's moments, safetensors; the step and the run's
   identity, JSON), written atomically beside the output; the same command run again resumes from the last one.
5. The bundle: the trained rows in the checkpoint's orientation and dtype (an FP8 base's block scheme), and the whole
   tensors trained, written and verified as `pack` writes them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from esftctl.errors import EsftError
from esftctl.formats.architectures import EXPERT_WEIGHTS, memory_name
from esftctl.formats.checkpoint import TORCH_DTYPES, ExpertWeights, MoECheckpoint, unfuse
from esftctl.formats.fp8 import SCALE_SUFFIX
from esftctl.jsonl import Example, read_records
from esftctl.selection import ExpertConfig
from esftctl.train_experts import use_selected_rows


@dataclass(frozen=True)
class TrainSettings:
    """How a run trains; with the data and the experts, what a checkpoint must match to be resumed."""

    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-4
    seed: int = 0
    eval_share: float = 0.05  # of the examples, held out (at least one, where there are two or more)
    save_every: int = 50  # steps between checkpoints (0: none)
    warmup: float = 0.1  # share of the steps the learning rate ramps up over
    replay_share: float = 0.0  # of every batch, drawn from general data mixed back in (`replay`), for retention
    gradient_checkpointing: bool = False  # recompute each layer's activations in the backward pass: less memory
    pack_length: int = 0  # tokens a row holds when short examples are packed into rows (0: one example a row, padded)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0 or self.save_every < 0 or self.pack_length < 0:
            raise EsftError("--steps and --batch-size must be at least 1, --lr above 0, --save-every and "
                            "--pack-length at least 0")
        if not 0 <= self.eval_share < 1 or not 0 <= self.warmup < 1 or not 0 <= self.replay_share < 1:
            raise EsftError(f"--eval-share {self.eval_share} / --replay-share {self.replay_share}: give shares in "
                            "[0, 1)")

    def lr_at(self, step: int) -> float:
        warm = max(1, round(self.steps * self.warmup))
        return self.lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(step, self.steps) /
                                                                             self.steps))


@dataclass
class TrainReport:
    name: str
    out: Path
    experts_per_layer: dict[int, int]
    trained_parameters: int
    model_parameters: int
    steps: int
    resumed_from: int
    train_examples: int
    eval_examples: int
    losses: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    eval_exact: float | None = None
    seconds: float = 0.0
    tokens: int = 0  # trained on (padding excluded), this run's steps
    tokens_per_second: float = 0.0

    def to_json(self) -> dict:
        return asdict(self) | {"out": str(self.out), "experts_per_layer": {str(k): v for k, v in
                                                                          self.experts_per_layer.items()}}


def read_examples(path: Path, tokenizer) -> list[Example]:
    """Prompt/completion examples of a JSONL file of prompt/completion or chat `messages` lines (one shape or the
    other per line); refuses a line of neither shape, naming the file and line."""
    out = []
    for number, record in read_records(path):
        if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            out.append({"prompt": record["prompt"], "completion": record["completion"]})
        elif "messages" in record:
            out.append(_chat_example(record["messages"], tokenizer, path, number))
        else:
            raise EsftError(f"line {number} needs string fields 'prompt' and 'completion', or 'messages'", path)
    if not out:
        raise EsftError("no examples", path)
    return out


def _chat_example(messages: object, tokenizer, path: Path, number: int) -> Example:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok or messages[-1]["role"] != "assistant":
        raise EsftError(f"line {number}: 'messages' must be a list of {{role, content}} strings ending with the "
                        "assistant's turn", path)
    if not getattr(tokenizer, "chat_template", None):
        raise EsftError(f"line {number} holds chat messages, but the base's tokenizer has no chat template: give "
                        "prompt/completion lines", path)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    return {"prompt": prompt, "completion": messages[-1]["content"]}


def held_out(examples: Sequence[Example], share: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples: a seeded shuffle's last `share` (at least one, where there are two or more)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n = min(len(examples) - 1, max(1, round(share * len(examples)))) if share > 0 and len(examples) > 1 else 0
    keep, held = sorted(order[:len(order) - n]), sorted(order[len(order) - n:])
    return [examples[i] for i in keep], [examples[i] for i in held]


class _RowsInto(torch.autograd.Function):
    """The frozen fused tensor with the master rows written into it in place, as the layer's weight: neither a copy
    of the tensor per forward (a layer's experts, over a GB at DeepSeek-V2-Lite's size, kept for the backward of
    every layer) nor a gradient for its frozen rows; the rows' gradient is the weight's at them."""

    @staticmethod
    def forward(ctx, frozen: torch.Tensor, ids: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        frozen.index_copy_(0, ids, master.detach().to(frozen.dtype))
        ctx.save_for_backward(ids)
        ctx.master_dtype = master.dtype
        return frozen.view_as(frozen)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return None, None, grad.index_select(0, ids).to(ctx.master_dtype)


class TrainedRows:
    """The selected experts of every MoE layer as float32 master rows (parameters of a module of their own in the
    experts' module, `esft_rows`, which FSDP2 shards with their layer), written into the layer's frozen fused tensors
    (in place) before each of its forwards: the forward reads the fused parameter through _RowsInto (an instance
    attribute over the parameter), whose gradient goes to the masters alone."""

    def __init__(self, model, base: MoECheckpoint, experts: dict[int, list[int]]):
        self.layout = base.arch.in_memory().fused
        self.modules: dict[int, tuple[torch.nn.Module, list[str]]] = {}
        self.ids: dict[int, torch.Tensor] = {}
        self.handles = []
        for layer, chosen in sorted(experts.items()):
            if not chosen:
                continue
            names = self.layout.tensors(layer)
            module = model.get_submodule(names[0].rpartition(".")[0])
            attrs = [n.rpartition(".")[2] for n in names]
            device = getattr(module, attrs[0]).device
            ids = torch.tensor(sorted(chosen), dtype=torch.long, device=device if device.type != "meta" else "cpu")
            module.esft_rows = torch.nn.Module()
            for a in attrs:
                module.esft_rows.register_parameter(a, torch.nn.Parameter(getattr(module, a).detach()[ids].float()))
            self.ids[layer], self.modules[layer] = ids, (module, attrs)
            module.esft_ids = sorted(chosen)  # for esftctl.train_experts' backward, on the host
            self.handles.append(module.register_forward_pre_hook(self._writer(layer)))
        if self.modules:
            use_selected_rows(model)

    def _writer(self, layer: int) -> Callable:
        attrs = self.modules[layer][1]

        def write(module, args):
            for a in attrs:  # in the instance's __dict__, over the parameter (FSDP2 may swap in its gathered one)
                module.__dict__[a] = _RowsInto.apply(module._parameters[a], self.ids[layer],
                                                     getattr(module.esft_rows, a))
        return write

    def to(self, device: torch.device) -> None:
        self.ids = {layer: ids.to(device) for layer, ids in self.ids.items()}

    def parameters(self) -> list[torch.nn.Parameter]:
        return [getattr(m.esft_rows, a) for layer in sorted(self.modules) for m, attrs in [self.modules[layer]]
                for a in attrs]

    def sync(self) -> None:
        """The masters written into the fused parameters' shards where FSDP2 holds them (a sharded layer's backward
        gathers its weights again from there; one process needs nothing). Every process calls it."""
        from esftctl.train_fsdp import full, write_rows

        for layer, (module, attrs) in self.modules.items():
            for a in attrs:
                write_rows(module._parameters[a], self.ids[layer], full(getattr(module.esft_rows, a).detach()))

    def experts(self, dtype: torch.dtype) -> dict[int, dict[int, ExpertWeights]]:
        """{layer: {expert: weights}} of the trained rows, in the checkpoint's orientation and `dtype` (gathered where
        sharded: every process calls it)."""
        from esftctl.train_fsdp import full

        out = {}
        for layer, ids in self.ids.items():
            module, attrs = self.modules[layer]
            rows = [full(getattr(module.esft_rows, a).detach()).to(dtype).cpu() for a in attrs]
            out[layer] = {int(e): unfuse(self.layout, [r[k] for r in rows]) for k, e in enumerate(ids.tolist())}
        return out


class TrainedTensors:
    """Whole tensors trained (shared experts, non-expert modules), by their checkpoint names, as float32 masters.
    One process: each is written in the model's dtype into its module (transformers' name for it: memory_name)
    before each of its forwards, as TrainedRows writes rows. Sharded: each is its module's own float32 parameter,
    which FSDP2's mixed precision gathers in the model's dtype (esftctl.train_fsdp.shard, over `owners`)."""

    def __init__(self, model, names: list[str], *, sharded: bool = False):
        self.owned: dict[str, tuple[torch.nn.Module, str]] = {}
        self.owners: list[torch.nn.Module] = []
        self.handles = []
        for name in names:
            owner_name, _, attr = memory_name(name).rpartition(".")
            try:
                owner = model.get_submodule(owner_name)
                frozen = getattr(owner, attr).detach()
            except AttributeError:
                raise EsftError(f"transformers holds no tensor {name!r} in this model: esftctl cannot train it") \
                    from None
            master = torch.nn.Parameter(frozen.float())
            if sharded:
                setattr(owner, attr, master)
                self.owners += [owner] if not any(o is owner for o in self.owners) else []
                self.owned[name] = (owner, attr)
                continue
            delattr(owner, attr)
            self.owned[name] = (self, f"master_{len(self.owned)}")
            setattr(self, self.owned[name][1], master)
            self.handles.append(owner.register_forward_pre_hook(
                lambda module, args, attr=attr, master=master, dtype=frozen.dtype: setattr(module, attr,
                                                                                           master.to(dtype))))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [getattr(*self.owned[n]) for n in sorted(self.owned)]

    def tensors(self, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """{name: tensor} in `dtypes` (gathered where sharded: every process calls it)."""
        from esftctl.train_fsdp import full

        return {n: full(getattr(*self.owned[n]).detach()).to(dtypes[n]).cpu() for n in sorted(self.owned)}


def train_adapter(base_dir: Path, data: Path, out: Path, name: str, settings: TrainSettings = TrainSettings(), *,
                  config_file: Path | None = None, metric: str = "token", threshold: float = 0.2,
                  layer_base: int | None = None, shared_experts: bool = False, non_expert_modules: bool = False,
                  replay: Path | None = None,
                  overwrite: bool = False,
                  checkpoints: Path | None = None,
                  on_step: Callable[[int, float, float], None] = lambda step, loss, tps: None,
                  log: Callable[[str], None] = lambda msg: None) -> TrainReport:
    """Train an ESFT adapter of `base_dir` on `data` and write it as bundle `out` named `name`; `shared_experts` (or
    the config's switch) trains every MoE layer's shared experts too, and `non_expert_modules` (or its switch) every
    weight outside the experts (attention, norms, routers, dense MLPs, embeddings, output head), which the bundle
    carries as non-expert tensors (served per request: esftctl.runtime.vllm.shared_experts and module_copies)."""
    from esftctl.atomic import check_output
    from esftctl.formats.bundle import Bundle, write_bundle
    from esftctl.names import check_name
    from esftctl.relevance import open_model
    from esftctl.train_fsdp import empty_model, fill_from_first, finish, first_only, ranks, shard

    check_name(name)
    check_output(out, overwrite=overwrite)
    r = ranks()
    if settings.batch_size < r.size:
        raise EsftError(f"a batch of {settings.batch_size} examples leaves some of the {r.size} processes without one: "
                        f"give --batch-size {r.size} or more")
    if not r.first:  # one process reports
        log, on_step = (lambda msg: None), (lambda step, loss, tps: None)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (`deterministic`)
    base = MoECheckpoint(base_dir, fp8=True)
    tokenizer = training_tokenizer(base_dir)
    examples = read_examples(data, tokenizer)
    train, evaluation = held_out(examples, settings.eval_share, settings.seed)
    general = read_examples(replay, tokenizer) if replay is not None and settings.replay_share else []
    experts, shared, modules = first_only(r, lambda: _experts(base, train, config_file, metric, threshold, layer_base,
                                                              log))
    shared, modules = shared or shared_experts, modules or non_expert_modules
    if not any(experts.values()) and not shared and not modules:
        raise EsftError("the expert config selects no expert: nothing to train", config_file)
    whole_names = (_shared_names(base) if shared else []) + (_module_names(base) if modules else [])
    _check_fp8_trainable(base, whole_names)
    checkpoints = checkpoints or out.with_name(out.name + ".ckpt")
    identity = _identity(base, data, experts, settings) | {"shared_experts": shared, "replay_sha256": _sha256(replay)}
    if modules:  # (a key only where set: checkpoints of runs without it stay resumable)
        identity["non_expert_modules"] = True
    log(f"loading {base.path.name}")
    if r.sharded and not r.first:  # the first process loads the weights; the others get their shards from it
        model = empty_model(base.path, _train_dtype(base))
    else:
        model = open_model(base, _train_dtype(base))
    if not r.sharded:  # sharded: moved once FSDP2 has cut it
        model.to(r.device)
    if modules:
        _check_untied(model, base)
    if settings.pack_length:
        _check_packable(model, base)
    for p in model.parameters():
        p.requires_grad_(False)
    if settings.gradient_checkpointing:  # non-reentrant: the frozen inputs need no gradient of their own
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    total = sum(p.numel() for p in model.parameters())  # before the trained tensors leave the module
    rows, whole = TrainedRows(model, base, experts), TrainedTensors(model, whole_names, sharded=r.sharded)
    if r.sharded:
        log(f"sharding over {r.size} processes")
        state = dict(model.state_dict()) if r.first else None  # its whole weights, the masters included
        shard(model, whole.owners, _train_dtype(base))
        fill_from_first(model, state, r)
        del state
        rows.to(r.device)
    params = rows.parameters() + whole.parameters()
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    start = _resume(checkpoints, identity, params, opt, log)
    rows.sync()
    report = TrainReport(name, out, {l: len(e) for l, e in experts.items() if e}, sum(p.numel() for p in params),
                         total, settings.steps, start, len(train),
                         len(evaluation))
    began = time.perf_counter()
    model.train()
    with deterministic():
        _steps(model, tokenizer, (train, general), settings, start, (params, rows), opt, r, report, checkpoints,
               identity, on_step)
    report.seconds = round(time.perf_counter() - began, 3)
    report.tokens_per_second = round(report.tokens / max(report.seconds, 1e-9), 1)
    model.eval()
    if evaluation:  # every process runs it (a sharded forward gathers from all), on the same examples
        report.eval_loss, report.eval_exact = _evaluate(model, tokenizer, evaluation, r.device)
    experts_out = _stored_experts(base, rows)
    tensors_out = whole.tensors({n: TORCH_DTYPES[base.tensors[n].dtype] for n in whole_names})
    if r.first:
        write_bundle(out, name, base, experts_out, tensors_out, overwrite=overwrite)
        Bundle.open(out).check_base(base)
        _remove_checkpoints(checkpoints)
    finish(r)
    return report


def _steps(model, tokenizer, pools: tuple[list[Example], list[Example]], settings: TrainSettings, start: int,
           trained: tuple[list, TrainedRows], opt, r, report: TrainReport, checkpoints: Path, identity: dict,
           on_step) -> None:
    """The optimizer steps from `start`: each batch the task's examples and `replay_share` of it from the general
    ones (pools: task, general), as draw_batch draws them; with several processes (r: esftctl.train_fsdp.Ranks),
    each takes every r.size-th example of it and weighs its loss by its share of the batch's loss tokens."""
    from esftctl.train_fsdp import summed

    train, general = pools
    params, rows = trained
    began = time.perf_counter()
    for step in range(start, settings.steps):
        batch = draw_batch(train, general, settings, step)[r.rank::r.size]
        enc, tokens = (_encode_packed(tokenizer, batch, settings.pack_length, model.dtype) if settings.pack_length
                       else _encode_counted(tokenizer, batch))
        scored = int((enc["labels"][:, 1:] != -100).sum())
        all_scored, all_tokens = summed([scored, tokens], r)
        weight = scored * r.size / max(all_scored, 1)  # the averaged gradient: the whole batch's
        loss = optimizer_step(model, {k: v.to(r.device) for k, v in enc.items()}, params, opt, settings.lr_at(step),
                              weight)
        rows.sync()
        report.tokens += int(all_tokens)
        report.losses.append(round(summed([loss.item() * weight], r)[0] / r.size, 6))
        on_step(step, report.losses[-1], report.tokens / max(time.perf_counter() - began, 1e-9))
        if settings.save_every and (step + 1) % settings.save_every == 0 and step + 1 < settings.steps:
            _save(checkpoints, identity, step + 1, params, opt, r.first)


def training_tokenizer(base_dir: Path):
    """The base's tokenizer as training encodes with it: padded on the right, with EOS for padding where it has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def draw_batch(train: Sequence[Example], general: Sequence[Example], settings: TrainSettings, step: int
               ) -> list[Example]:
    """Step `step`'s batch: the task's examples and `replay_share` of it from `general`, drawn with replacement by a
    generator seeded with (seed, step); torch's generator is seeded the same way (dropout or router noise, where a
    model has them). A run resumed at `step` draws what an uninterrupted one does."""
    replayed = round(settings.batch_size * settings.replay_share) if general else 0
    rng = random.Random(settings.seed * 1_000_003 + step)
    batch = rng.choices(train, k=settings.batch_size - replayed)
    batch += rng.choices(general, k=replayed) if replayed else []
    torch.manual_seed(settings.seed * 1_000_003 + step)
    return batch


def optimizer_step(model, inputs: dict[str, torch.Tensor], params: list, opt, lr: float,
                   weight: float = 1.0) -> torch.Tensor:
    """One step on a batch: the backward pass of the loss times `weight` (a process's share, where several average
    their gradients), gradients clipped at norm 1, AdamW at `lr`; the loss."""
    loss = model(**inputs).loss
    (loss * weight if weight != 1.0 else loss).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


@contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels while training: without them, a resumed run of a tiny model on the CPU parted from an
    uninterrupted one in the last bits. On CUDA, ops without a deterministic kernel warn instead of failing (and
    cuBLAS needs CUBLAS_WORKSPACE_CONFIG, set before its first use: `train_adapter`)."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _experts(base: MoECheckpoint, train: list[Example], config_file: Path | None, metric: str, threshold: float,
             layer_base: int | None, log) -> tuple[dict[int, list[int]], bool, bool]:
    """(the experts to train, {layer: ids}; whether the config asks for the shared experts too; and for the non-expert
    modules)."""
    from esftctl.relevance import compute_relevance
    from esftctl.selection import select_experts

    if config_file is not None:
        config, _ = ExpertConfig.read_for(config_file, base.moe_layers, base.num_experts, layer_base=layer_base)
        return {l: sorted(ids) for l, ids in config.experts.items()}, config.shared_experts, config.non_expert_modules
    if metric not in ("token", "gate"):
        raise EsftError(f"--metric {metric}: choose token or gate")
    log(f"expert relevance on {len(train)} examples")
    scores = compute_relevance(base.path, train, scored="completion").scores[metric]
    return select_experts(scores, threshold), False, False


def _shared_names(base: MoECheckpoint) -> list[str]:
    """The shared-expert tensors of every MoE layer (ESFT's `shared_experts: true`); refuses a base without them."""
    names = sorted(n for n in base.tensors if any(base.arch.is_shared_expert_tensor(n, l) for l in base.moe_layers))
    if not names:
        raise EsftError("this base has no shared experts to train", base.path)
    return names


def _module_names(base: MoECheckpoint) -> list[str]:
    """Every tensor outside the routed and shared experts (ESFT's `non_expert_modules: true`), but the router's
    score-correction bias, which no gradient reaches (the balancing rule moves it)."""
    return sorted(n for n in base.tensors if not base.is_routed_expert_tensor(n)
                  and not any(base.arch.is_shared_expert_tensor(n, l) for l in base.moe_layers)
                  and not n.endswith("e_score_correction_bias"))


def _check_untied(model, base: MoECheckpoint) -> None:
    """Refuse a base whose output head is its embedding matrix: training the one as a tensor of its own would part it
    from the other, which the merged model (one tensor) cannot hold."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        raise EsftError("this base ties its output head to its embeddings: esftctl cannot train its non-expert "
                        "modules (train without non_expert_modules)", base.path)


def _check_packable(model, base: MoECheckpoint) -> None:
    """Refuse packing where a block-diagonal mask does not keep packed examples apart: linear attention (Qwen3-Next's
    Gated DeltaNet carries a state along the row) and sliding-window layers (GPT-OSS: one mask for every layer would
    drop the window)."""
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise EsftError(f"--pack-length: this base has {' and '.join(sorted(kinds - {'full_attention'}))} layers, "
                        "across which a mask cannot keep packed examples apart; train without packing", base.path)


def _check_fp8_trainable(base: MoECheckpoint, names: list[str]) -> None:
    """An FP8 base's adapters replace routed experts (quantized as `pack` quantizes them); a whole tensor trained
    beside them that the base holds in FP8 would need requantizing, which no bundle carries (as `pack` refuses)."""
    fp8 = [n for n in names if base.fp8 is not None and n + SCALE_SUFFIX in base.tensors]
    if fp8:
        raise EsftError(f"{fp8[0]!r} is an FP8 weight of this base: an adapter of an FP8 base trains routed experts "
                        "(and bf16 tensors) only", base.path)


def _stored_experts(base: MoECheckpoint, rows: TrainedRows) -> dict[int, dict[int, ExpertWeights]]:
    """The trained experts as the bundle stores them: in the base's dtype, or for an FP8 base quantized with its block
    scheme, as `pack` stores a bf16 fine-tune of it (a weight equal to the base's dequantized one keeps the base's
    bytes); a weight that is not finite (a run that diverged) is refused."""
    from esftctl.formats.architectures import EXPERT_SCALES

    trained = {l: e for l, e in rows.experts(_dtype(base)).items() if e}
    for layer, experts in trained.items():
        for e, w in experts.items():
            if not all(bool(torch.isfinite(t).all()) for _, t in w.items()):
                raise EsftError(f"training diverged: expert {e} of layer {layer} holds values that are not finite "
                                "(lower --lr)")
    if base.fp8 is None:
        return trained
    out = {}
    for layer, experts in trained.items():
        out[layer] = {}
        for e, plain in experts.items():
            stored, parts = base.read_expert(layer, e), {}
            for w, s in zip(EXPERT_WEIGHTS, EXPERT_SCALES):
                q, scale = getattr(stored, w), getattr(stored, s)
                same = torch.equal(base.fp8.dequantize(q, scale, torch.bfloat16).view(torch.int16),
                                   getattr(plain, w).view(torch.int16))
                parts[w], parts[s] = (q, scale) if same else base.fp8.quantize(getattr(plain, w))
            out[layer][e] = ExpertWeights(**parts)
    return out


def _train_dtype(base: MoECheckpoint) -> torch.dtype:
    """The frozen weights' dtype: the base's (bf16 for an FP8 one, dequantized) on a GPU; float32 on the CPU (its bf16
    matmuls are slow)."""
    return _dtype(base) if torch.cuda.is_available() else torch.float32


def _dtype(base: MoECheckpoint) -> torch.dtype:
    """The experts' dtype in training and before storing: the base's, or bf16 for an FP8 base."""
    from esftctl.formats.checkpoint import TORCH_DTYPES

    return torch.bfloat16 if base.fp8 is not None else TORCH_DTYPES[base.expert_dtype]


def _encode(tokenizer, batch: Sequence[Example]) -> dict[str, torch.Tensor]:
    from esftctl.world.training import encode_batch

    return encode_batch(tokenizer, batch, completion_only=True)


def _encode_counted(tokenizer, batch: Sequence[Example]) -> tuple[dict[str, torch.Tensor], int]:
    enc = _encode(tokenizer, batch)
    return enc, int(enc["attention_mask"].sum())


def _encode_packed(tokenizer, batch: Sequence[Example], length: int, dtype: torch.dtype
                   ) -> tuple[dict[str, torch.Tensor], int]:
    """The batch's examples packed into rows of at most `length` tokens (first fit, in the batch's order), and its
    tokens: each example keeps its own positions (position_ids from 0) and attends to itself alone (a block-diagonal
    causal mask, additive, in the model's dtype), and its first token is no label (the one before it is another
    example's), so the loss is the unpacked batch's, over fewer padded positions."""
    enc = _encode(tokenizer, batch)
    lengths = enc["attention_mask"].sum(dim=1).tolist()
    if max(lengths) > length:
        raise EsftError(f"--pack-length {length}: an example has {max(lengths)} tokens; give at least that")
    rows: list[list[int]] = []
    fill: list[int] = []
    for i, n in enumerate(lengths):
        r = next((r for r, f in enumerate(fill) if f + n <= length), None)
        if r is None:
            rows.append([]), fill.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        fill[r] += n
    width, low = max(fill), torch.finfo(dtype).min
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=enc["input_ids"].dtype)
    labels = torch.full((len(rows), width), -100, dtype=enc["labels"].dtype)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.full((len(rows), 1, width, width), low, dtype=dtype)
    causal = lambda n: torch.zeros(n, n, dtype=dtype).masked_fill(  # noqa: E731
        ~torch.ones(n, n, dtype=torch.bool).tril(), low)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = lengths[i]
            ids[r, at:at + n] = enc["input_ids"][i, :n]
            labels[r, at + 1:at + n] = enc["labels"][i, 1:n]
            positions[r, at:at + n] = torch.arange(n)
            mask[r, 0, at:at + n, at:at + n] = causal(n)
            at += n
        mask[r, 0, range(at, width), range(at, width)] = 0  # padding attends to itself: no row of the softmax is empty
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}, sum(lengths)


@torch.no_grad()
def _evaluate(model, tokenizer, examples: Sequence[Example], device, batch_size: int = 32) -> tuple[float, float]:
    """(mean loss per completion token, exact match): a greedy completion equals the reference exactly when the
    model's argmax is the reference's next token at every completion position (teacher forced, one pass)."""
    hits, nll, count = 0, 0.0, 0
    for start in range(0, len(examples), batch_size):
        enc = {k: v.to(device) for k, v in _encode(tokenizer, examples[start:start + batch_size]).items()}
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, :-1].float()
        target = enc["labels"][:, 1:]
        scored = target != -100
        hits += int(((logits.argmax(dim=-1) == target) | ~scored).all(dim=1).sum())
        logp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        nll -= float((logp * scored).sum())
        count += int(scored.sum())
    return round(nll / max(count, 1), 6), round(hits / len(examples), 6)


# ---- checkpoints ------------------------------------------------------------------------------------------------

STATE, META = "state.safetensors", "state.json"


def _identity(base: MoECheckpoint, data: Path, experts: dict[int, list[int]], settings: TrainSettings) -> dict:
    """What a checkpoint belongs to: the base (its identity), the data (its bytes' hash), the experts, the settings."""
    from esftctl.formats.bundle import base_identity

    return {"base": base_identity(base), "data_sha256": _sha256(data),
            "experts": {str(l): e for l, e in experts.items()}, "settings": _settings_identity(settings)}


def _settings_identity(settings: TrainSettings) -> dict:
    """The settings a checkpoint must match: not how often it is saved, and packing only where on (a run without it
    resumes from a checkpoint written before packing existed)."""
    out = asdict(settings) | {"save_every": None}
    if not settings.pack_length:
        del out["pack_length"]
    return out


def _sha256(path: Path | None) -> str | None:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path is not None else None


def _save(folder: Path, identity: dict, step: int, params: list, opt, write: bool = True) -> None:
    """The masters and AdamW's moments (gathered where sharded: every process calls it; `write`: this one writes)."""
    from safetensors.torch import save_file

    from esftctl.atomic import atomic_dir
    from esftctl.train_fsdp import full

    tensors = {f"master.{i}": full(p.detach()).cpu().contiguous() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        state = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"adam.{i}.{key}"] = full(state[key].detach()).cpu().contiguous()
    adam_steps = [float(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0.0 for p in params]
    if not write:
        return
    with atomic_dir(folder, overwrite=True) as tmp:
        save_file(tensors, tmp / STATE)
        (tmp / META).write_text(json.dumps({"identity": identity, "step": step, "adam_steps": adam_steps}))


def _resume(folder: Path, identity: dict, params: list, opt, log) -> int:
    """The step a checkpoint in `folder` of this very run resumes from (its masters and AdamW's moments restored),
    or 0; refuses a checkpoint of another run."""
    from safetensors.torch import load_file

    if not (folder / META).is_file():
        return 0
    try:
        meta = json.loads((folder / META).read_text())
        tensors = load_file(folder / STATE)
    except (OSError, ValueError) as e:
        raise EsftError(f"the checkpoint cannot be read ({e}); remove it to start over", folder) from None
    if meta.get("identity") != identity:
        raise EsftError("the checkpoint is of another run (base, data, experts or settings differ); remove it to "
                        "start over", folder)
    from esftctl.train_fsdp import load_into

    def placed(p, t):  # `t` placed as `p` is (its shard, where sharded)
        out = torch.zeros_like(p)
        load_into(out, t.to(out.dtype))
        return out

    for i, p in enumerate(params):
        load_into(p, tensors[f"master.{i}"])
        if f"adam.{i}.exp_avg" in tensors:
            opt.state[p] = {"step": torch.tensor(meta["adam_steps"][i]),
                            "exp_avg": placed(p, tensors[f"adam.{i}.exp_avg"]),
                            "exp_avg_sq": placed(p, tensors[f"adam.{i}.exp_avg_sq"])}
    log(f"resuming from step {meta['step']}")
    return int(meta["step"])


def _remove_checkpoints(folder: Path) -> None:
    import shutil

    if (folder / META).is_file():
        shutil.rmtree(folder, ignore_errors=True)
