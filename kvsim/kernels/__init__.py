"""Codecs (torch references + Triton kernels) that turn KV caches into wire bytes."""

from kvsim.kernels.codec import (
    Codec,
    CodecError,
    codec_class,
    codec_for,
    codec_names,
    make_codec,
    register,
)
from kvsim.kernels.encoded import Chunk, Encoded, SizeTable

__all__ = [
    "Chunk",
    "Codec",
    "CodecError",
    "Encoded",
    "SizeTable",
    "codec_class",
    "codec_for",
    "codec_names",
    "make_codec",
    "register",
]
