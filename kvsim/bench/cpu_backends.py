"""CPU encode / decode throughput of the uniform and lynx codecs (full Codec.encode / decode
calls on the numba backend, uniform also on the torch backend), each against a torch clone of
the same bf16 tensor measured in the same run. GB/s = bf16 bytes of the input / seconds (best
of `repeats`). `python -m kvsim.bench.cpu_backends` prints both."""

from __future__ import annotations

import time

import numba
import torch


def _best_s(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn (s)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _bf16_kv(layers: int, kv_heads: int, tokens: int, head_dim: int) -> torch.Tensor:
    """kv: [layers, 2, kv_heads, tokens, head_dim] bf16, standard normal, seed 0."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(layers, 2, kv_heads, tokens, head_dim, generator=g).to(torch.bfloat16)


def uniform_cpu(layers: int = 4, kv_heads: int = 8, tokens: int = 4096, head_dim: int = 128,
                bits: tuple[int, ...] = (8, 4), group: int = 64, repeats: int = 5
                ) -> list[dict]:
    """The uniform codec, cpu against torch backend, per bit width."""
    from kvsim.kernels.uniform.codec import UniformCodec

    kv = _bf16_kv(layers, kv_heads, tokens, head_dim)
    size_gb = kv.numel() * 2 / 1e9
    clone_s = _best_s(kv.clone, repeats)
    rows = []
    for b in bits:
        for backend in ("cpu", "torch"):
            codec = UniformCodec({"bits": b, "group": group, "backend": backend})
            enc = codec.encode(kv)  # compile / warm up
            codec.decode(enc)
            n = repeats if backend == "cpu" else max(1, repeats // 3)  # torch is slow
            encode_s = _best_s(lambda c=codec: c.encode(kv), n)
            decode_s = _best_s(lambda c=codec, e=enc: c.decode(e), n)
            rows.append({"bits": b, "backend": backend, "threads": numba.get_num_threads(),
                         "size_gb": size_gb, "clone_gbps": size_gb / clone_s,
                         "encode_gbps": size_gb / encode_s, "decode_gbps": size_gb / decode_s,
                         "encode_vs_clone": clone_s / encode_s,
                         "decode_vs_clone": clone_s / decode_s})
    return rows


def lynx_cpu(layers: int = 4, kv_heads: int = 8, tokens: int = 4096, head_dim: int = 128,
             split: tuple[int, ...] = (4, 4), repeats: int = 5) -> dict:
    """The lynx codec on its cpu backend."""
    from kvsim.kernels.lynx.codec import LynxCodec

    kv = _bf16_kv(layers, kv_heads, tokens, head_dim)
    codec = LynxCodec({"split": list(split)})
    enc = codec.encode(kv)  # compile / warm up
    codec.decode(enc)
    size_gb = kv.numel() * 2 / 1e9
    clone_s = _best_s(kv.clone, repeats)
    encode_s = _best_s(lambda: codec.encode(kv), repeats)
    decode_s = _best_s(lambda: codec.decode(enc), repeats)
    return {"threads": numba.get_num_threads(), "size_gb": size_gb,
            "clone_gbps": size_gb / clone_s, "encode_gbps": size_gb / encode_s,
            "decode_gbps": size_gb / decode_s, "encode_vs_clone": clone_s / encode_s,
            "decode_vs_clone": clone_s / decode_s}


if __name__ == "__main__":  # python -m kvsim.bench.cpu_backends
    for r in uniform_cpu():
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in r.items()))
    for key, value in lynx_cpu().items():
        print(f"{key:>16}: {value:.3f}")
