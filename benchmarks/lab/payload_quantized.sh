#!/usr/bin/env bash
# Add to the GPU payload (../shared/gpu/build_payload.sh, whose wheel list stops at what unquantized serving
# imports) the wheels vLLM 0.25 imports as soon as a model has a quantization_config: compressed-tensors 0.17.0
# (vLLM pins it; quantization/__init__ imports it for every method) and loguru (compressed-tensors needs it).
# Without them the FP8 serving test died at start-up on the H100 (2026-11-25, fourth session). Run once after
# build_payload.sh, from the repository root: bash benchmarks/lab/payload_quantized.sh
set -euo pipefail
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .vllm2/whl compressed-tensors==0.17.0 loguru==0.7.3
ls .vllm2/whl | grep -E "compressed|loguru"
