#!/usr/bin/env bash
# Copy a device run's results to $OUT (the files that come back): the bench's JSON and PNG (or the partial
# JSON of an unfinished run) and one archive of vLLM's server logs and result files.
out=${OUT:-/tmp}
for f in /tmp/bench/out/serve.json /tmp/bench/out/serve.png /tmp/bench/out/serve.partial.json; do
  [ -f "$f" ] && cp "$f" "$out/"
done
tar -czf "$out/logs.tgz" $(ls -d /dev/shm/bench/state /tmp/bench/work/state /tmp/bench/out/vllm-results 2>/dev/null) \
  2>/dev/null
ls -la "$out"
