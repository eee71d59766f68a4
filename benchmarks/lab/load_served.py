"""`esftctl adapters load` through a served esftctl on the GPU, cold and warm (bench.serve.adapter_load_times,
what `bench serve`'s microbenchmark slice times): the DeepSeek-V2-Lite-shaped base, two DeepSeek-sized adapters,
`bench serve`'s engine arguments (CUDA graphs). Why: 2026-11-27's warm load took 2.98 s, 61x its floor, the load
middleware hashing a bundle the engine held staged (fixed in a9c504b); this shows the fix on the device without
a whole microbenchmark slice. Prints the result as JSON.
Usage (device, after ../shared/gpu/README.md's install):
  PYTHONPATH=/tmp/site python3 benchmarks/lab/load_served.py [--work /dev/shm/bench] [--scratch /tmp/bench/scratch]
"""

import argparse
import json
from pathlib import Path

from esftctl.bench import serve_models
from esftctl.bench.serve import PROFILES, adapter_load_times
from esftctl.serve import Server, free_port, plan

args = argparse.ArgumentParser()
args.add_argument("--work", type=Path, default=Path("/dev/shm/bench"))
args.add_argument("--scratch", type=Path, default=Path("/tmp/bench/scratch"))
args.add_argument("--repeats", type=int, default=3)
a = args.parse_args()
served = serve_models.prepare_base("deepseek-v2-lite", a.work, print)
serve_models.write_adapters(served, "deepseek-v2-lite", a.scratch, 2, distinct=10, shape="deepseek", on_step=print)
server = plan(served.base, [f"{n}={p}" for n, p in served.bundles.items()], name="base",
              adapter_memory=serve_models.adapter_bytes(served.base, served.bundles.values()),
              state_dir=a.work / "state" / "load_served", port=free_port(),
              vllm_args=list(PROFILES["deepseek-v2-lite"].engine_args))
with Server(server) as running:
    print("starting esftctl serve")
    running.wait_ready(timeout=1200)
    print(json.dumps(adapter_load_times(server.url, served, a.repeats, print), indent=1))
