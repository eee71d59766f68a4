"""Host time of paging a DeepSeek-V2-Lite-sized ESFT layer in and out (driver map calls, 2 MiB pages)."""
import time

import torch

from esftctl.runtime.address_space import CudaAddressSpace, PhysicalPagePool
from esftctl.runtime.moe_layer import VirtualMoELayer

pool = PhysicalPagePool(0)
layer = VirtualMoELayer(64, 2048, 1408, num_slots=4, experts_per_slot=8, dtype=torch.bfloat16,
                        make_space=lambda n: CudaAddressSpace(n, pool))
layer._map(list(range(64)))
layer.load(0, {e: None for e in range(6)})
layer.keep_host_copy()
outs, ins = [], []
for _ in range(5):
    t = time.perf_counter()
    layer.page_out()
    outs.append(time.perf_counter() - t)
    t = time.perf_counter()
    layer.page_in()
    ins.append(time.perf_counter() - t)
print(f"rows {len(layer.held_rows())} bytes {len(layer.held_rows()) * layer.expert_bytes / 2**30:.2f} GiB "
      f"pages {layer.w13.stats().mapped_pages + layer.w2.stats().mapped_pages}")
print("page_out ms", [round(1e3 * x, 2) for x in outs])
print("page_in ms", [round(1e3 * x, 2) for x in ins])
