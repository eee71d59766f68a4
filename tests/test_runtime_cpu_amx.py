"""esftctl's vLLM plugin asks Linux for the AMX tile registers before vLLM's own CPU kernels use them.

Without it, `esftctl serve` on an AMX CPU lost its engine worker to SIGILL (exit code -4) at the first adapter
request (Qwen2-MoE, OLMoE and GPT-OSS, 2026-11-25 to -27; GPT-OSS in CI); test_serve_adapters's other-architecture cases
cover the serving side.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HAS_AMX = Path("/proc/cpuinfo").exists() and " amx_tile" in Path("/proc/cpuinfo").read_text()

# arch_prctl(ARCH_GET_XCOMP_PERM) reads the process's permitted XSAVE features; bit 18 is AMX's tile data.
PERMITTED = """
import ctypes, sys
def tile_data_permitted():
    mask = ctypes.c_uint64()
    assert ctypes.CDLL(None, use_errno=True).syscall(158, 0x1022, ctypes.byref(mask)) == 0
    return bool(mask.value >> 18 & 1)
before = tile_data_permitted()
from esftctl.runtime.vllm.plugin import allow_amx
allow_amx()
print(before, tile_data_permitted())
"""


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_AMX, reason="the CPU has no AMX")
def test_plugin_asks_for_amx_tiles():
    out = subprocess.run([sys.executable, "-c", PERMITTED], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]
