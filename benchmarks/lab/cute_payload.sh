#!/usr/bin/env bash
# CUTLASS's Python DSL (nvidia-cutlass-dsl 4.8.1, CUDA 12 libraries: the device's driver runs them) for the offline
# GPU machine, in two transfers: the wheels for its Python 3.12 downloaded here, the 92 MB library wheel split in
# two, .cute0 (part 0) and .cute1 (part 1 and the small wheels; protobuf only where the device lacks it), kept out of
# git. Idempotent.
#   bash benchmarks/lab/cute_payload.sh
# Then on the device, each call within 30 s of the last answer:
#   carry .cute0: mkdir -p /tmp/cstage && cp .cute0/* /tmp/cstage/
#   carry .cute1: cp .cute1/* /tmp/cstage/ && bash benchmarks/lab/cute_payload.sh install
#   and export PYTHONPATH=/tmp/site:/tmp/cute-site (after vLLM's install, ../shared/gpu/README.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=4.8.1
if [ "${1:-}" = "install" ]; then  # on the device
  cd /tmp/cstage
  cat libs.part.* > "$(cat libs.name)"
  sha256sum -c libs.sha256 > /dev/null || { echo "cute_payload: the parts do not join: copy them again"; exit 1; }
  wheels=$(ls ./*.whl)
  if PYTHONPATH=/tmp/site python3 -c "import google.protobuf" 2>/dev/null; then  # keep the device's own
    wheels=$(ls ./*.whl | grep -v protobuf)
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cute-site $wheels 2>&1 \
    | grep -v "^WARNING: Target directory" | tail -3
  PYTHONPATH=/tmp/site:/tmp/cute-site python3 -c "import cutlass.cute; print('nvidia-cutlass-dsl', '$VERSION')"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" nvidia-cutlass-dsl==$VERSION nvidia-cutlass-dsl-libs-base==$VERSION \
  nvidia-cutlass-dsl-libs-core==$VERSION nvidia-cutlass-dsl-libs-cu12==$VERSION "protobuf>=4.21.12,<7"
rm -rf .cute0 .cute1 && mkdir -p .cute0 .cute1
libs=$(cd "$tmp" && ls nvidia_cutlass_dsl_libs_cu12-*.whl)
(cd "$tmp" && sha256sum "$libs" > libs.sha256 && echo "$libs" > libs.name && split -b 44M -d "$libs" libs.part.)
[ ! -e "$tmp/libs.part.02" ] || { echo "cute_payload: the library wheel grew past two 44 MiB parts"; exit 1; }
mv "$tmp"/libs.part.00 .cute0/  # each transfer carries the tracked tree too (about 11 MB) within its 64 MiB
mv "$tmp"/libs.part.01 "$tmp"/libs.sha256 "$tmp"/libs.name .cute1/
rm "$tmp/$libs" && mv "$tmp"/*.whl .cute1/
grep -qx '/.cute\*/' .git/info/exclude 2>/dev/null || echo '/.cute*/' >> .git/info/exclude
du -sh .cute0 .cute1
