"""How far CacheGen's size estimate is from its real bytes, on KV of very different
statistics: the shipped rate file against a sample-encode calibration on the KV itself.

    python -m kvsim.bench.cachegen_estimate [--shape 8,4,2048,128] [--chunks 16]

Prints one row per KV kind: real payload MB, estimate / real with the shipped file, with the
calibrated model, and the held-out error the calibration states. Writes nothing.
"""

from __future__ import annotations

import argparse

import torch

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import make_codec
from kvsim.kv.synthetic import generate_kv


def kv_kinds(shape: KVShape, seed: int = 7) -> dict[str, torch.Tensor]:
    """KV of four kinds, fp32 [layers, 2, kv_heads, tokens, head_dim]: Gaussian, heavy-tailed
    (Student-t with 2 degrees of freedom: infinite variance), constant, kvsim.kv.synthetic."""
    dims = shape.dims
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(dims, generator=gen)
    # Student-t(2) = normal / sqrt(chi-square(2) / 2), all from the same generator
    chi2 = (torch.randn((*dims, 2), generator=gen) ** 2).sum(-1)
    heavy = (torch.randn(dims, generator=gen) * torch.sqrt(2.0 / chi2.clamp_min(1e-6)))
    return {"gaussian": gaussian, "heavy-tailed": heavy.clamp(-1e4, 1e4),
            "constant": torch.full(dims, 0.7),
            "synthetic": generate_kv(shape, seed=seed).to(torch.float32)}


def measure(shape: KVShape, chunks: int) -> list[dict]:
    rows = []
    for kind, kv in kv_kinds(shape).items():
        kv = kv.to(torch.bfloat16)
        codec = make_codec("cachegen", {})
        real = codec.encode(kv).total_bytes
        file_bytes = codec.size_table(shape).total_bytes
        model = codec.calibrate(lambda layer, kv=kv: kv[layer], shape, {"kind": kind}, chunks)
        rows.append({"kv": kind, "real_bytes": real, "file_ratio": file_bytes / real,
                     "calibrated_ratio": codec.size_table(shape).total_bytes / real,
                     "heldout_error": model.expected_error,
                     "sampled_chunks": model.sampled_chunks})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsim.bench.cachegen_estimate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8,4,2048,128",
                        help="layers,kv_heads,tokens,head_dim (bf16)")
    parser.add_argument("--chunks", type=int, default=16, help="chunks the calibration codes")
    args = parser.parse_args(argv)
    dims = [int(v) for v in args.shape.split(",")]
    if len(dims) != 4 or min(dims) < 1:
        parser.error("--shape needs four positive integers layers,kv_heads,tokens,head_dim")
    shape = KVShape(*dims, dtype="bfloat16")
    print(f"cachegen size estimate / real bytes on {shape.to_dict()}")
    print(f"{'KV':14s} {'real MB':>9s} {'file':>7s} {'calibrated':>10s} {'held-out':>9s} "
          f"{'chunks':>6s}")
    for r in measure(shape, args.chunks):
        heldout = "-" if r["heldout_error"] is None else f"{100 * r['heldout_error']:.2f}%"
        print(f"{r['kv']:14s} {r['real_bytes'] / 1e6:9.2f} {r['file_ratio']:7.3f} "
              f"{r['calibrated_ratio']:10.4f} {heldout:>9s} {r['sampled_chunks']:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
