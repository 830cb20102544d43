"""CacheGen's encode and decode split into its quantizer and its entropy coder, timed in the
same run as the whole calls.

CacheGen has no device path: on a CUDA cache its quantizer runs on the device (the torch
reference) and its rANS coder on the host's CPUs; on a CPU cache both are numba kernels.
Encode = every layer quantized with its symbols in host memory (CacheGenCodec.layer_symbols,
timed alone) + the coder (the rest of the whole call). Decode = the rANS decode of every chunk
(CacheGenCodec._decode_symbols, timed alone) + the reconstruction (the rest).
"""

from __future__ import annotations

import torch

from kvsim.bench.codecs import median_seconds
from kvsim.core.layout import KVShape
from kvsim.kernels.cachegen.codec import CacheGenCodec
from kvsim.kernels.codec import Codec

# how a split codec's calls were timed, by the cache's device (its timing-file entry's label)
HOST_CODER_TIMING = ("host coder: encode() / decode() wall clock on a CUDA cache, the "
                     "quantizer on the device (torch), the rANS coder on the host's CPUs")
CPU_CODER_TIMING = ("encode() / decode() wall clock on a CPU cache, the quantizer and the "
                    "rANS coder in numba kernels")


def coder_split(codec: Codec, kv: torch.Tensor, repeats: int, warmup: int, encode_s: float,
                decode_s: float) -> dict | None:
    """Report columns of the split (module docstring), or None for a codec other than
    CacheGen. encode_s, decode_s: the whole calls' median seconds, timed in the same run."""
    if not isinstance(codec, CacheGenCodec):
        return None
    shape = KVShape.of(kv)
    enc = codec.encode(kv)

    def quantize() -> None:
        for layer in range(shape.layers):
            codec.layer_symbols(kv[layer], layer, shape.layers)

    quantize_s = median_seconds(quantize, repeats, warmup, kv.device)
    decode_coder_s = median_seconds(lambda: codec._decode_symbols(enc), repeats, warmup,
                                    kv.device)
    encode_coder_s = max(encode_s - quantize_s, 0.0)
    row = {
        "timing": HOST_CODER_TIMING if kv.device.type == "cuda" else CPU_CODER_TIMING,
        "quantize_s": quantize_s,
        "encode_coder_s": encode_coder_s,
        "decode_coder_s": decode_coder_s,
        "reconstruct_s": max(decode_s - decode_coder_s, 0.0),
        "quantize_gbps": shape.bf16_bytes / 1e9 / quantize_s,
        "coder_share_encode": encode_coder_s / encode_s,
        "coder_share_decode": min(decode_coder_s / decode_s, 1.0),
    }
    if kv.device.type == "cuda":
        row["device_name"] = torch.cuda.get_device_name(kv.device)
    return row
