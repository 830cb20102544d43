"""`cachegen` codec: the codec and its torch reference (codec.py), numba CPU kernels (cpu.py),
the rANS entropy coder (rans.py) and the size model (size.py)."""
