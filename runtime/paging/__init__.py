"""Expert paging: MoE layers whose experts live in host memory (or compressed on the GPU) and come into a few
shared blocks of device memory just before their kernels run, so that the memory goes to the KV cache.

Every paged layer keeps its own stable address range (kernels, decode plans and captured CUDA graphs hold those
addresses); the memory under it is block p mod `window` of the window, shared with the layers at the same
position modulo the window. Before a layer's kernel, the rows the step routes to (or, fetching ahead, all rows of
the next layer) come in from pinned host memory or a Huffman store on the GPU, decided on the GPU from the router's
ids, so that a step runs no host code for paging and captures as CUDA graphs. One idea per module:

- `window`: the shared blocks, aliased under the paged layers' addresses, and what keeps a layer resident;
- `tiers`: where rows come from (host copies, the store) and a layer's fetch (esftctl.kernels.row_fetch);
- `pager`: when and on which stream each layer fetches (routed rows, or the next layer ahead);
- `timing`: the loads' and kernels' times the planner reads (eager steps only);
- `planner`: how many layers stay resident (the policy, on rho = compute / load, within free memory) and its
  driver between engine steps.

On the CPU the same code runs with host address spaces (memfd-backed, so aliases work there too) and the
fetch's PyTorch references: the window, the aliasing and the fetch logic are exercised by CI; the speed question
exists only on a GPU.
"""
