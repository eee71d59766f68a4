#!/usr/bin/env bash
# After `bash ../shared/gpu/build_payload.sh .` on a new checkout: make its payload fit the device's transfers.
# build_payload.sh splits vLLM's tar into two 60 MiB parts, but a transfer carries the tracked tree too (7.6 MB
# on 2026-11-29) and takes at most 64 MiB, so this re-splits it into three 40 MiB parts, in .vllm0, .vllm1 and
# .vllm3, checks them against .vllm2/vllm.sha256, points .vllm2/install.sh's import check at the plugin's module
# (esftctl.runtime.vllm.plugin since issue 30), adds two wheels build_payload.sh's list lacks (vLLM's Gated
# DeltaNet layer, Qwen3-Next's, imports compressed-tensors through its AWQ config, and that imports loguru: without
# them vLLM cannot inspect the model, seen on an H100 2026-12-06) and the two `esftctl bench train`'s LoRA arm needs
# (peft, and accelerate, which peft imports), and keeps the folders and .world out of git.
# Idempotent.
# Then on the device, each call within 30 s of the last answer:
#   carry .vllm0: mkdir -p /tmp/stage && cp .vllm0/part.* /tmp/stage/
#   carry .vllm1: cp .vllm1/part.* /tmp/stage/
#   carry .vllm3: cp .vllm3/part.* /tmp/stage/
#   carry .vllm2 (and .world for the serving tests): bash .vllm2/install.sh > /tmp/install.log 2>&1 && <work>
# .vllm3 and .vllm2 together (54.5 MB on 2026-12-08) fit one transfer while the tracked tree stays under about
# 12.5 MB (11.1 MB then): carry both, copy and install in one call, then .world in the next.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat .vllm0/part.* .vllm1/part.* $(ls .vllm3/part.* 2>/dev/null) > "$tmp/vllm.tar.xz"
[ "$(sha256sum "$tmp/vllm.tar.xz" | cut -d' ' -f1)" = "$(cat .vllm2/vllm.sha256)" ] \
  || { echo "payload_split: the parts do not join to .vllm2/vllm.sha256: run build_payload.sh again"; exit 1; }
(cd "$tmp" && split -b 40M -d vllm.tar.xz part.)
[ ! -e "$tmp/part.03" ] || { echo "payload_split: vLLM's tar grew past three 40 MiB parts: add a folder"; exit 1; }
rm -rf .vllm0/part.* .vllm1/part.* .vllm3
mkdir -p .vllm3
mv "$tmp/part.00" .vllm0/ && mv "$tmp/part.01" .vllm1/ && mv "$tmp/part.02" .vllm3/
sed -i 's/esftctl\.runtime\.vllm_plugin/esftctl.runtime.vllm.plugin/' .vllm2/install.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .vllm2/whl \
  compressed-tensors==0.17.0 loguru==0.7.3 peft==0.21.2 accelerate==1.16.0
mkdir -p .git/info
for line in '/.vllm*/' '/.world/'; do
  grep -qxF "$line" .git/info/exclude 2>/dev/null || echo "$line" >> .git/info/exclude
done
du -sh .vllm0 .vllm1 .vllm3 .vllm2
