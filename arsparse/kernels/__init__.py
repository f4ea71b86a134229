"""Attention kernels: a PyTorch reference (the oracle and CPU path) and Triton kernels for CUDA."""
