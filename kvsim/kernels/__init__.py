"""Codecs (torch references, numba CPU kernels, Triton kernels) that turn KV caches into wire
bytes: the interface and registry (codec.py), encoded streams (encoded.py), the wire format
(wire.py), presets (presets.py), and one module or subpackage per codec family."""
