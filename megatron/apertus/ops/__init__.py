"""Operators: PyTorch references, autograd functions and dispatch to our C++/CUDA kernels.

This layer imports only torch and our own extensions, never megatron-core.
"""
