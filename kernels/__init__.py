"""Triton kernels for the CUDA path (import only torch and triton).

`kernels.paged_attention` holds each kernel with its PyTorch reference. Import it only where CUDA
is in use: importing it decorates the kernels, which fixes whether Triton's CPU interpreter is used.
"""
