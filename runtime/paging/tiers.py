"""Where a paged layer's experts come from: pinned host memory (asynchronous copies) or, for the first
`store_experts` experts of a layer, a Huffman-coded store already in GPU memory (esftctl.kernels.huffman_decode,
decoding straight into the mapped block; its plan is built once per layer, since the addresses never change);
and how many experts each tier delivers so that both finish together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class LayerSource:
    """Where one layer's experts come from: pinned host tensors, and optionally a decode plan that writes
    experts [0, store_experts) into given destinations (built with the layer's stable w13/w2)."""

    w13: torch.Tensor  # [E, 2I, H], pinned host memory on CUDA
    w2: torch.Tensor  # [E, H, I]
    store_experts: int = 0
    make_decoder: Callable[[torch.Tensor, torch.Tensor], Callable[[], None]] | None = None



def store_decoder(store, names: Sequence[dict[str, str]]):
    """A LayerSource.make_decoder over an ExpertStore: expert e of the layer is names[e]["gate"|"up"|"down"].

    On CUDA one DecodePlan (one launch) writes every expert; on the CPU the vectorized decoder does."""
    def make(w13: torch.Tensor, w2: torch.Tensor) -> Callable[[], None]:
        inter = w2.shape[-1]
        targets = []
        for e in range(w13.shape[0]):
            targets += [(names[e]["gate"], w13[e, :inter]), (names[e]["up"], w13[e, inter:]),
                        (names[e]["down"], w2[e])]
        if w13.is_cuda:
            return store.plan(targets).run

        def decode_on_cpu() -> None:
            for name, out in targets:
                store.decode_tensor(name, out)

        return decode_on_cpu

    return make



def tier_split(num_experts: int, host_bytes_per_s: float, store_bytes_per_s: float) -> int:
    """How many of a layer's experts to take from the store so that both tiers finish together: each tier's
    share in proportion to its measured bandwidth (bytes of experts delivered per second)."""
    share = store_bytes_per_s / (store_bytes_per_s + host_bytes_per_s)
    return min(num_experts, max(0, round(num_experts * share)))
