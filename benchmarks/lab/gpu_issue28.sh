#!/usr/bin/env bash
# Issue 28's device run, in the background (benchmarks/lab/background.sh start issue28 bash THIS), most
# important first so that a machine taken back early still leaves the key results: the kernels and the paged
# stack (CUDA graphs included), paged serving with CUDA graphs on DeepSeek-V2, the bench, the second
# architecture, the fetch microbenchmark, the engine-level paging tests, then issue 30's last serving tests.
# Logs in /tmp/bgout (copy them to $OUT from the next call). Needs ../shared/gpu/README.md's install and the
# tiny world carried in .world.
set -u
export OUT=/tmp/bgout PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 ESFTCTL_WORLD=$PWD/.world PYTHONUNBUFFERED=1
mkdir -p $OUT
t=benchmarks/lab/gpu_tests.sh
bash $t kernels tests/test_kernel_row_fetch.py tests/test_runtime_paging.py tests/test_kernel_huffman_decode.py
bash $t serve_paged_ds tests/test_serve_adapters.py -k "paging_with_cuda_graphs and deepseek"
python3 -c "from esftctl.cli import main; main()" bench paging --out $OUT/paging --layers 8 --batches 1,4,32,256 2>&1 | tee $OUT/bench_paging.log
bash $t serve_paged_qwen tests/test_serve_adapters.py -k "paging_with_cuda_graphs and qwen2"
python3 benchmarks/lab/row_fetch_bench.py 2>&1 | tail -12 | tee $OUT/row_fetch.log
bash $t engine tests/test_runtime_vllm_model.py tests/test_runtime_cuda.py
bash $t serve_rest tests/test_serve_adapters.py -k "paged_experts or store_tier or cuda_graphs_served or refuses or busy_port or not_ours or temporary"
echo all done
