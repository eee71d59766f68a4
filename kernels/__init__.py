"""Triton kernels, each beside the plain PyTorch reference it is tested against (imported as esftctl.kernels)."""
