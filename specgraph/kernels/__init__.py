"""Kernels: each op has reference.py (plain PyTorch, the definition) and triton.py (the fast path)
with the same signature."""
