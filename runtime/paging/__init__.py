"""Expert paging: a stack of MoE layers whose experts live elsewhere and are streamed in just before use.

Every paged layer has a stable virtual range holding its w13 [E, 2I, H] and w2 [E, H, I] (so kernels, and
the Huffman decoder's plans, see fixed addresses), but physical memory comes from a pool of `window`
blocks, one block = one layer's experts. A sliding window: while layer i computes, layer i+1 is loaded into
the block that layer i-1 held. One idea per module:

- `pager`: the window itself (PagedExperts: ensure / done / prefetch, and its ordering on CUDA streams);
- `blocks`: where a layer's experts live while loaded (HeldRowBlocks: an ESFT layer's own virtual tensors,
  serving's; OwnBlocks: a range of their own per layer, the paging benchmark's);
- `tiers`: where they come from (LayerSource: pinned host memory, and a Huffman store decoded on the GPU for
  the first experts of a layer) and how the two tiers split a layer;
- `timing`: the loads' and kernels' times the planner reads;
- `planner`: how many layers stay resident (the policy, on rho = compute / load) and its driver between
  forward passes.

On the CPU the same code runs with host address spaces and synchronous copies: the window and the
ordering logic are exercised by CI; the speed question exists only on a GPU.
"""
