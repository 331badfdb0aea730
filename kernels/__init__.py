"""Attention and cache kernels: a pure-torch reference (the CPU path) and Triton kernels (CUDA)."""
