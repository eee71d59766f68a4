# Issue 29's protocol grid: the `esftctl bench serve` options that name it (benchmarks/serve-bench/README.md).
# Sourced by gpu_pending.sh (one card) and gpu_cards.sh (one bench per card), so both run the same grid.
GRID_ARGS=(--adapter-shape deepseek --adapters 1,5,10,20 --rates 1,2,5 --alphas 1 --duration 60 --repeats 3)
