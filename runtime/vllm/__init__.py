"""The one door to vLLM: every module that imports vLLM's internals is here (tests/test_project_layers.py walks the
imports). Importing this package imports no vLLM; its modules do, most of them lazily, so the launcher can read
their limits (moe.KERNEL_MAX_ROWS) without starting an engine."""
