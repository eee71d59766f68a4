"""`esftctl train` on several GPUs: one process per GPU (torchrun), the model sharded by PyTorch's FSDP2.

    torchrun --nproc-per-node 8 -m esftctl train BASE DATA.jsonl --out BUNDLE --name NAME

Every process draws the same seeded batch and trains on its share (every `size`-th example); FSDP2 (`fully_shard`
on every decoder layer, then the model) keeps 1/size of every weight on each GPU, gathers a layer's weights for its
forward and again for its backward, and averages the trained parameters' gradients across the processes. Each
process's loss is weighted by its share of the batch's loss tokens, so the averaged gradient is the one a single
process computes on the whole batch (up to the order of float sums).

ESFT's trained rows are float32 masters in a module of their own inside their layer (`esft_rows`), so FSDP2 shards
them, their gradients and AdamW's state like any parameter. The frozen fused expert tensor stays a sharded parameter;
its forward reads it with the rows written in (esftctl.train._RowsInto). FSDP2 frees a layer's gathered weights after
its forward and gathers them again from the shards for its backward, so the rows are also written into the shards
after every optimizer step (TrainedRows.sync): the backward's weights are the forward's. Whole tensors trained (shared
experts, non-expert modules) are their module's own parameters in float32, computed in the model's dtype (FSDP2's
mixed precision) and sharded with the rest.

The first process loads the model into host memory; the others build it on the meta device (no memory), and once
every process has sharded it, each gets its shards from the first (`fill_from_first`). Relevance and selection run on
the first process alone (`first_only`). Without torchrun (WORLD_SIZE unset or 1) none of this runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from esftctl.errors import EsftError


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes (one per GPU), or the only one."""

    rank: int
    size: int
    device: torch.device

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.size > 1


def ranks() -> Ranks:
    """This process's Ranks: from torchrun's environment (the process group started: NCCL on GPUs, gloo on the CPU),
    or the only process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if size <= 1:
        return Ranks(0, 1, torch.device("cuda" if cuda else "cpu"))
    import torch.distributed as dist

    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise EsftError(f"process {local} of this machine has no GPU of its own ({torch.cuda.device_count()} "
                            "visible): start at most one process per GPU")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), device)


def shard(model: torch.nn.Module, whole_owners: list[torch.nn.Module], compute_dtype: torch.dtype) -> None:
    """FSDP2 over `model`: first every module holding whole trained tensors (float32 parameters, computed in
    `compute_dtype`), then every decoder layer, then the model (embeddings, norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mixed = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for owner in whole_owners:
        fully_shard(owner, mp_policy=mixed)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise EsftError(f"{type(model).__name__} keeps no decoder layers where transformers' models do (model.layers):"
                        " esftctl cannot shard it")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def empty_model(path, dtype: torch.dtype) -> torch.nn.Module:
    """The model's structure on the meta device, holding no memory: what the processes but the first build, since the
    first loads the weights and `fill_from_first` hands each process its shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def fill_from_first(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, r: Ranks) -> None:
    """Once `model` is sharded: its shards on this process's device (the other processes' allocated there, meta until
    now) and filled from `state`, the first process's whole weights (PyTorch's set_model_state_dict, broadcast from
    it); every buffer is sent from the first process too (non-persistent ones, the rotary tables, are in no state
    dict)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if r.first:
        model.to(r.device)
    else:
        model.to_empty(device=r.device)
    set_model_state_dict(model, state if r.first else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def first_only(r: Ranks, work):
    """`work()` run by the first process alone and its result handed to every process; an EsftError it raises is
    raised by every process (none waits for a result that will not come)."""
    if not r.sharded:
        return work()
    import torch.distributed as dist

    box = [None]
    if r.first:
        try:
            box[0] = ("ok", work())
        except EsftError as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (gathered: every process calls it), or `t`."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """The first-dimension range [lo, hi) of `param` this process holds: FSDP2's chunks of ceil(n / size) rows (the
    last ones short or empty), or all of it where `param` is not sharded."""
    if not hasattr(param, "to_local"):
        return 0, param.shape[0]
    import torch.distributed as dist

    per = -(-param.shape[0] // dist.get_world_size())
    lo = min(param.shape[0], dist.get_rank() * per)
    return lo, lo + param.to_local().shape[0]


def load_into(param: torch.Tensor, t: torch.Tensor) -> None:
    """Copy whole tensor `t` into `param`: into its shard where it is sharded (no communication)."""
    lo, hi = shard_rows(param)
    with torch.no_grad():
        (param.to_local() if hasattr(param, "to_local") else param).copy_(t[lo:hi])


def write_rows(param: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Write `rows` (whole, float32) at `ids` into this process's shard of the fused tensor `param` (sharded along its
    first dimension: FSDP2's chunks of ceil(E / size) rows). An unsharded `param` needs nothing: the forward writes
    the rows into it (_RowsInto), and no backward reads it from elsewhere."""
    if not hasattr(param, "to_local"):
        return
    with torch.no_grad():
        local = param.to_local()
        lo, hi = shard_rows(param)
        mine = (ids >= lo) & (ids < hi)
        if bool(mine.any()):
            local.index_copy_(0, ids[mine] - lo, rows[mine].to(local.dtype))


def summed(values: list[float], r: Ranks) -> list[float]:
    """`values` summed over the processes, in one reduction."""
    if not r.sharded:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=r.device)
    dist.all_reduce(t)
    return t.tolist()


def finish(r: Ranks) -> None:
    """Wait for every process (the first has written the bundle), then end the process group `ranks` started."""
    if r.sharded:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
