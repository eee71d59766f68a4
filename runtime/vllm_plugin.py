"""esftctl's vLLM plugin, loaded by vLLM in every process through the `vllm.general_plugins` entry point.

Today it installs fixes for vLLM's CPU build; the ESFT runtime (virtual weight tensors, rerouting, paging)
hooks in here as it lands.
"""

from __future__ import annotations


def register() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from esftctl.runtime import cpu_rope

        cpu_rope.register()
