"""`uniform` codec: format and torch reference (codec.py), numba CPU kernels (cpu.py), Triton
kernels (triton.py)."""
