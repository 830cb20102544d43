"""Codec bench: size, error and speed of every codec on the same KV cache, in one run.

For each codec: encode once, serialize (bits per element from the real bytes), decode every
stream prefix (KV relative MSE and attention-output vNMSE per prefix), then time encode and
full decode (median of `repeats` after `warmup`) against a `torch` clone of the same tensor
timed in the same run, so speeds are quoted as GB/s of bf16-equivalent input *and* as a ratio
to the copy baseline of this machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvsim.core.device import synchronize
from kvsim.core.layout import KVShape
from kvsim.kernels.codec import Codec
from kvsim.kv.attention_error import attention_output, relative_mse, vnmse_from_outputs


@dataclass
class KVSource:
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]
    queries: torch.Tensor  # [layers, q_heads, q_tokens, head_dim]
    description: dict  # where the KV and the queries came from


def synthetic_source(shape: KVShape, q_heads: int, q_tokens: int, seed: int,
                     params_path: str | None = None) -> KVSource:
    from kvsim.kv.synthetic import SyntheticKVParams, generate_kv, generate_queries

    params = SyntheticKVParams.load(params_path) if params_path else SyntheticKVParams()
    kv = generate_kv(shape, params, seed)
    queries = generate_queries(kv, q_heads, q_tokens, seed)
    return KVSource(kv, queries, {"kind": "synthetic", "seed": seed,
                                  "params_file": params_path,
                                  "synthetic_params": params.to_dict(),
                                  "queries": "generated (kvsim.kv.synthetic.generate_queries)"})


def capture_source(name: str, q_heads: int, q_tokens: int, seed: int) -> KVSource:
    """A saved capture; its real queries when it has them, else generated ones (recorded)."""
    from kvsim.kv.capture_file import load_capture, resolve_capture_path
    from kvsim.kv.synthetic import generate_queries

    cap = load_capture(name)
    desc = {"kind": "capture", "path": str(resolve_capture_path(name)), "meta": cap.meta}
    if cap.queries is not None:
        queries = cap.queries.to(torch.float32)
        desc["queries"] = "captured"
    else:
        queries = generate_queries(cap.kv, q_heads, q_tokens, seed)
        desc["queries"] = "generated (capture has none)"
    return KVSource(cap.kv, queries, desc)


def timed_seconds(fn: Callable[[], object], repeats: int, warmup: int,
                  device: torch.device) -> list[float]:
    """Wall seconds of each of `repeats` runs of fn() after `warmup` untimed runs."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    synchronize(device, all_streams=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device, all_streams=True)
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int,
                   device: torch.device) -> float:
    """Median wall seconds of fn() over `repeats` runs after `warmup` untimed runs."""
    return statistics.median(timed_seconds(fn, repeats, warmup, device))


def spread(times: list[float]) -> float:
    """Slowest / fastest of repeated timings of the same work: 1 on a steady machine. A
    shared VM has stretches where a multi-threaded codec's calls take 2-2.5x as long, in the
    page faults of their fresh output, so a bench reports how far its repeats landed apart
    beside their median."""
    return max(times) / min(times) if min(times) > 0 else float("inf")


def copy_baseline_s(kv: torch.Tensor, repeats: int, warmup: int) -> float:
    """Median seconds of kv.clone() on kv's device: the memory-bound reference speed."""
    return median_seconds(kv.clone, repeats, warmup, kv.device)


def bench_codec(label: str, codec: Codec, kv: torch.Tensor, queries: torch.Tensor,
                o_ref: torch.Tensor, copy_s: float, repeats: int, warmup: int) -> dict:
    """One report row. kv on the bench device; o_ref = attention_output(queries, kv)."""
    device = kv.device
    shape = KVShape.of(kv)
    enc = codec.encode(kv)
    wire = enc.to_bytes()
    serialized_bytes = len(wire)
    if serialized_bytes != enc.total_bytes:
        raise AssertionError(f"{label}: serialized {serialized_bytes} B != accounted "
                             f"{enc.total_bytes} B")
    estimate = codec.size_table(shape)
    sizes: dict = {"size_estimate_note": estimate.note}
    if not codec.exact_sizes:
        # an estimating codec is judged twice: with the data it ships with, and calibrated on
        # a sample of this KV (as the simulator does with `size_calibration`)
        model = codec.calibrate(lambda layer: kv[layer], shape, {"kind": "bench KV sample"})
        sizes = {"size_estimate_uncalibrated_note": estimate.note,
                 "size_estimate_uncalibrated_error": estimate.total_bytes / serialized_bytes - 1,
                 "size_estimate_heldout_error": model.expected_error}
        estimate = codec.size_table(shape)
        sizes["size_estimate_note"] = estimate.note
    prefix_bytes = np.cumsum(enc.stream_bytes) + enc.header_bytes
    vnmse_layers, rel_mse = [], []
    for streams in range(1, codec.num_streams + 1):
        kv_hat = codec.decode(enc, streams=streams, dtype=torch.float32, device=device)
        rel_mse.append(relative_mse(kv, kv_hat))
        o_hat = attention_output(queries, kv_hat)
        vnmse_layers.append(vnmse_from_outputs(o_ref, o_hat).tolist())
        del kv_hat, o_hat
    vnmse_prefix = [float(np.mean(v)) for v in vnmse_layers]
    encode_times = timed_seconds(lambda: codec.encode(kv), repeats, warmup, device)
    decode_times = timed_seconds(lambda: codec.decode(enc, device=device), repeats, warmup,
                                 device)
    encode_s, decode_s = statistics.median(encode_times), statistics.median(decode_times)
    gb = shape.bf16_bytes / 1e9  # bf16-equivalent input size, GB
    copy_gbps = gb / copy_s
    return {
        "codec": label,
        "name": codec.name,
        "params": codec.params_dict(),
        "streams": codec.stream_names(),
        "bits_per_element": 8.0 * serialized_bytes / shape.numel,
        "bits_per_element_prefix": [8.0 * float(b) / shape.numel for b in prefix_bytes],
        "serialized_bytes": serialized_bytes,
        "header_bytes": enc.header_bytes,
        "stream_bytes": enc.stream_bytes,
        "compression_vs_bf16": shape.bf16_bytes / serialized_bytes,
        "size_exact": codec.exact_sizes,
        "size_estimate_bytes": estimate.total_bytes,
        "size_estimate_error": estimate.total_bytes / serialized_bytes - 1.0,
        **sizes,
        "rel_mse": rel_mse[-1],
        "rel_mse_prefix": rel_mse,
        "vnmse": vnmse_prefix[-1],
        "vnmse_layers": vnmse_layers[-1],
        "vnmse_prefix": vnmse_prefix,
        "vnmse_anchor": vnmse_prefix[0] if codec.num_streams > 1 else None,
        "encode_s": encode_s,
        "decode_s": decode_s,
        "encode_spread": spread(encode_times),  # slowest / fastest repeat
        "decode_spread": spread(decode_times),
        "timing_spread": max(spread(encode_times), spread(decode_times)),
        "encode_gbps": gb / encode_s,
        "decode_gbps": gb / decode_s,
        "copy_gbps": copy_gbps,
        "encode_vs_copy": (gb / encode_s) / copy_gbps,
        "decode_vs_copy": (gb / decode_s) / copy_gbps,
        "device": str(device),
    }
