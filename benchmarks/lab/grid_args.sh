# Issue 29's protocol grid: the `esftctl bench serve` options that name it (benchmarks/serve-bench/README.md).
# Sourced by gpu_pending.sh (one card) and gpu_cards.sh (one bench per card), so both run the same grid.
# Since 2026-11-29 the servers capture CUDA graphs up to 512 tokens (bench serve's --capture-size default for
# deepseek-v2-lite): grid deepseek-n1.5.10.20-r1.2.5-a1-6781c246; the older 5434421a is --capture-size 0.
GRID_ARGS=(--adapter-shape deepseek --adapters 1,5,10,20 --rates 1,2,5 --alphas 1 --duration 60 --repeats 3)
