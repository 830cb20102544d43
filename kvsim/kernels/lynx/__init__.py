"""`lynx` codec: wire format and tables (format.py), torch reference (reference.py), numba CPU
kernels (cpu.py), Triton kernels (triton.py), the codec class that dispatches to them
(codec.py). Backends import the format, never the codec class."""
