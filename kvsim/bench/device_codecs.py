"""The device path of a codec timed on its GPU: kernels alone and with the host copy, each
against a copy of the same bytes timed in the same run.

For a codec with a device path (Codec.has_device_path) on a CUDA cache, with CUDA events on
the current stream (median of `repeats` after `warmup`):
- encode kernel: Codec.encode_device (its launches, the input's checks left on the device);
- encode + host copy: that, then every stream buffer into reused pinned host memory
  (device_wire.PinnedStaging, one asynchronous copy per stream), until the copy ends;
- decode kernel: Codec.decode_device from device-resident wire buffers, into the cache's
  dtype; decode + host copy: pinned host -> device (one copy per stream), then the kernels;
- baselines: the device-to-device copy of the input (kv.clone()) and the pinned
  device-to-host / host-to-device copies of the wire bytes.
Ratios compare times of the same bytes: kernel vs the input's device copy (both read the
cache once), with host copy vs the pinned copy of the wire bytes alone.

CacheGen has no device path: its split into quantizer and host coder is
kvsim.bench.coder_split's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import Codec
from kvsim.kernels.device_wire import PinnedStaging


def cuda_times_s(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Seconds of each of `repeats` runs of fn() between two CUDA events on the current
    stream, after `warmup` untimed runs (fn must make the current stream wait for any side
    stream it uses)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def device_timing(codec: Codec, kv: torch.Tensor, repeats: int, warmup: int) -> dict | None:
    """Report columns of the device path (module docstring), or None where kv is not on a
    CUDA device or the codec has no device path for it."""
    shape = KVShape.of(kv)
    if kv.device.type != "cuda" or not codec.has_device_path(kv.device, shape):
        return None
    staging = PinnedStaging(kv.device)
    current = torch.cuda.current_stream(kv.device)
    dw = codec.encode_device(kv)  # verified once: the timed runs leave the checks on device
    buffers = dw.buffers
    out_dtype = kv.dtype

    def encode_and_copy() -> None:
        staging.to_host(codec.encode_device(kv, verify=False).buffers)
        current.wait_stream(staging.stream)

    def copy_to_host() -> None:
        staging.to_host(buffers)
        current.wait_stream(staging.stream)

    # the received wire bytes in pinned host memory of their own (the staging's slots are
    # rewritten by every copy_to_host)
    host = [torch.empty(b.numel(), dtype=torch.uint8, pin_memory=True).copy_(b)
            for b in buffers]

    def copy_and_decode() -> None:
        codec.decode_device(staging.to_device(host), shape, out_dtype)

    def copy_to_device() -> None:
        staging.to_device(host)

    timed = {
        "kernel_encode": lambda: codec.encode_device(kv, verify=False),
        "encode_with_copy": encode_and_copy,
        "kernel_decode": lambda: codec.decode_device(buffers, shape, out_dtype),
        "decode_with_copy": copy_and_decode,
        "d2d_copy": kv.clone,
        "pinned_d2h": copy_to_host,
        "pinned_h2d": copy_to_device,
    }
    seconds = {name: statistics.median(cuda_times_s(fn, repeats, warmup))
               for name, fn in timed.items()}
    gb = shape.bf16_bytes / 1e9  # bf16-equivalent input, as every bench column
    row = {f"{name}_s": s for name, s in seconds.items()}
    row.update({
        "wire_bytes": dw.nbytes,
        "kernel_encode_gbps": gb / seconds["kernel_encode"],
        "kernel_decode_gbps": gb / seconds["kernel_decode"],
        "encode_with_copy_gbps": gb / seconds["encode_with_copy"],
        "decode_with_copy_gbps": gb / seconds["decode_with_copy"],
        "d2d_copy_gbps": gb / seconds["d2d_copy"],
        # the same input through the kernel vs through a plain device copy
        "kernel_encode_vs_d2d": seconds["d2d_copy"] / seconds["kernel_encode"],
        "kernel_decode_vs_d2d": seconds["d2d_copy"] / seconds["kernel_decode"],
        # the same wire bytes reaching the host (device) with and without the codec
        "encode_with_copy_vs_pinned": seconds["pinned_d2h"] / seconds["encode_with_copy"],
        "decode_with_copy_vs_pinned": seconds["pinned_h2d"] / seconds["decode_with_copy"],
        "pinned_d2h_gbps": dw.nbytes / 1e9 / seconds["pinned_d2h"],  # GB/s of wire bytes
        "device_name": torch.cuda.get_device_name(kv.device),
    })
    return row
