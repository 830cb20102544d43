"""An encode that ends on the device, laid out as the wire sends it, and the copies that
move it between the device and the host.

A codec with a device path (`Codec.has_device_path`) encodes a whole cache with a fixed,
small number of kernel launches into one flat uint8 buffer per stream on the tensor's
device: the payloads of the stream's chunks end to end in (layer, page) order, exactly the
bytes `Codec.encode` gives each Chunk (frame headers are the transport's). Where each chunk
starts follows from the size table alone (`stream_offsets`). Nothing is synchronized until
the caller asks: the input's checks (NaN / Inf, fp16 range) are flagged on the device in
`status` and read by `DeviceWire.verify`.

`PinnedStaging` is the host side of a timed pipeline (the bench's): page-locked buffers
reused from one encode to the next, filled by one asynchronous copy per stream on a side
CUDA stream (two slots, so the copy of one cache overlaps the encode of the next), and the
reverse copy for decode. `Codec.encode` on a CUDA device (the transport's sender, whose
chunks may wait long for the link) copies each stream once into ordinary host memory;
`Codec.decode` onto one joins the chunks straight into a block of torch's pinned pool and
copies it over (`pinned_to_device`; the block goes back to the pool once copied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsim.core.layout import KVShape, check_finite
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels.encoded import Chunk, Encoded

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

NONFINITE, BEYOND_FP16 = 0, 1  # indices of DeviceWire.status


def stream_offsets(payload_bytes: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """payload_bytes [streams, layers, pages] (negative = no such chunk) -> per stream
    (start [layers, pages], size [layers, pages], total bytes) of its chunks laid end to
    end in (layer, page) order; an absent chunk has size 0."""
    out = []
    for sizes in np.asarray(payload_bytes, dtype=np.int64):
        size = np.maximum(sizes, 0)
        end = np.cumsum(size.reshape(-1)).reshape(size.shape)
        out.append((end - size, size, int(end[-1, -1]) if end.size else 0))
    return out


@dataclass
class DeviceWire:
    """One cache encoded on its device. buffers[s]: uint8 [total bytes of stream s], the
    stream's chunk payloads end to end in (layer, page) order. status: int32 [2], non-zero
    where some input is non-finite, resp. beyond fp16's range (the second only where the codec
    stores fp16 metadata computed from the values), or None where the codec checked first."""

    codec: str
    params: dict
    shape: KVShape
    page_tokens: int
    stream_names: list[str]
    buffers: list[torch.Tensor]
    payload_bytes: np.ndarray  # [streams, layers, pages], negative = absent (size table)
    status: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self.buffers)

    def verify(self, kv: torch.Tensor) -> None:
        """Raise the error Codec.encode raises for this input (ValueError) when the device
        flagged a non-finite value or one beyond fp16's range; synchronizes with the device
        (reads 8 bytes)."""
        if self.status is None:
            return
        nonfinite, beyond = (int(v) for v in self.status.tolist())
        if nonfinite:
            check_finite(kv)  # counts them and names the first bad index
            raise ValueError("KV tensor contains non-finite values (NaN/Inf); refusing to "
                             "encode")
        if beyond:
            peak = float(kv.abs().max())
            raise ValueError(f"{self.codec}: |value| up to {peak:.4g} exceeds the fp16 range "
                             f"({torch.finfo(torch.float16).max}) of the stored scales / "
                             "zero points")

    def to_encoded(self, host: list[np.ndarray] | None = None) -> Encoded:
        """The Encoded whose chunk payloads are views of `host` (host copies of the buffers,
        uint8; default: one copy of each buffer to the host now: ordinary memory, as the
        chunks viewing it may wait long for the link; the CPU's buffers themselves)."""
        if host is None:
            host = [b.cpu().numpy() for b in self.buffers]
        streams = []
        for s, (start, size, total) in enumerate(stream_offsets(self.payload_bytes)):
            flat = host[s]
            if flat.size != total:
                raise AssertionError(f"{self.codec}: stream {s} buffer is {flat.size} bytes, "
                                     f"its size table says {total}")
            present = np.asarray(self.payload_bytes[s]) >= 0
            streams.append([Chunk(s, layer, page, flat[start[layer, page]:
                                                       start[layer, page] + size[layer, page]])
                            for layer in range(self.shape.layers)
                            for page in range(start.shape[1]) if present[layer, page]])
        return Encoded(self.codec, self.params, self.shape, self.page_tokens,
                       list(self.stream_names), streams)


def nonfinite_status(kv: torch.Tensor, fp16_range: bool = False) -> torch.Tensor | None:
    """For a device path whose kernel does not check its input: on CUDA, DeviceWire's status
    from one aminmax pass (no synchronization; non-zero when any value is NaN / Inf); on the
    CPU, where check_finite's aminmax is the fastest check, it runs now (None: nothing left
    to verify; the caller checks the fp16 range there itself). fp16_range: also flag values
    beyond fp16's range (status[BEYOND_FP16]) on CUDA."""
    if kv.device.type != "cuda":
        check_finite(kv)
        return None
    status = torch.zeros(2, dtype=torch.int32, device=kv.device)
    if kv.numel():
        # one read pass (min / max propagate NaN; Inf is the min or the max): a flag; the
        # count and the place come from check_finite in verify()
        lo, hi = torch.aminmax(kv)
        ends = torch.stack([lo, hi]).to(torch.float32)
        status[NONFINITE] = (~torch.isfinite(ends)).sum()
        if fp16_range:  # the codec stores fp16 metadata computed from the values
            status[BEYOND_FP16] = (ends.abs() > torch.finfo(torch.float16).max).sum()
    return status


def stream_buffers(enc: Encoded, streams: int, device: torch.device) -> list[torch.Tensor]:
    """The first `streams` streams of a (checked) Encoded as flat buffers on `device`, chunk
    payloads end to end in (layer, page) order: one host concatenation (none where the
    payloads already lie end to end) and one copy per stream."""
    pages = -(-enc.shape.tokens // enc.page_tokens)
    out = []
    for s in range(streams):
        parts = enc.payloads(s)
        ordered = [parts[(layer, page)] for layer in range(enc.shape.layers)
                   for page in range(pages) if (layer, page) in parts]
        if device.type == "cuda":
            out.append(pinned_to_device(ordered, device))
        else:
            out.append(torch.from_numpy(concat_payloads(ordered)).to(device))
    return out


def pinned_to_device(parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Payloads (1-D uint8) -> one buffer of them end to end on a CUDA `device`: joined
    straight into page-locked memory from torch's pinned pool, then one asynchronous copy
    (the pool keeps the block until the copy has run)."""
    total = sum(int(p.size) for p in parts)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    if total:
        np.concatenate(parts, out=host.numpy())
    return host.to(device, non_blocking=True)


def concat_payloads(parts: list[np.ndarray]) -> np.ndarray:
    """Payloads (1-D uint8) -> one uint8 array of them end to end. Without a copy when they
    already lie end to end in one buffer (chunks of a local encode are slices of the
    kernel's output) and are writeable (torch.from_numpy warns otherwise), else
    np.concatenate. For reading only: the result may alias the parts."""
    if not parts:
        return np.zeros(0, np.uint8)
    first = parts[0]
    if not first.flags.writeable:  # torch.from_numpy wants writeable arrays: copy those
        return np.concatenate(parts)
    addr, total = first.__array_interface__["data"][0], 0
    for p in parts:
        if (p.dtype != np.uint8 or p.ndim != 1 or not p.flags.c_contiguous
                or p.__array_interface__["data"][0] != addr + total):
            return np.concatenate(parts)
        total += p.size
    root = first
    while isinstance(root.base, np.ndarray):
        root = root.base
    lo, hi = np.lib.array_utils.byte_bounds(root)
    if not (lo <= addr and addr + total <= hi):  # pragma: no cover - adjacent but unrelated
        return np.concatenate(parts)
    return np.lib.stride_tricks.as_strided(first, shape=(total,), strides=(1,))


class PinnedStaging:
    """Reused page-locked host buffers for device <-> host copies of wire buffers.

    `to_host(buffers)` copies each device buffer into slot k's pinned buffer (grown on demand,
    never shrunk) on this object's side stream, after the current stream's work, and returns
    the host tensors (valid once `wait()` returns, and until the slot comes round again);
    slots alternate, so one cache's copy can run while the next is encoded. `to_device`
    is the mirror, for decode."""

    def __init__(self, device: torch.device, slots: int = 2) -> None:
        if device.type != "cuda":
            raise ValueError(f"pinned staging needs a CUDA device, got {device}")
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._host: list[list[torch.Tensor]] = [[] for _ in range(slots)]
        self._slot = 0
        self._done: torch.cuda.Event | None = None

    def _pinned(self, slot: int, i: int, nbytes: int) -> torch.Tensor:
        bufs = self._host[slot]
        while len(bufs) <= i:
            bufs.append(torch.empty(0, dtype=torch.uint8, pin_memory=True))
        if bufs[i].numel() < nbytes:
            bufs[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return bufs[i][:nbytes]

    def to_host(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        slot, self._slot = self._slot, (self._slot + 1) % len(self._host)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        out = []
        with torch.cuda.stream(self.stream):
            for i, b in enumerate(buffers):
                dst = self._pinned(slot, i, int(b.numel()))
                dst.copy_(b, non_blocking=True)
                b.record_stream(self.stream)
                out.append(dst)
            self._done = torch.cuda.Event()
            self._done.record(self.stream)
        return out

    def to_device(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host buffers -> device buffers, on the side stream; the current stream
        waits for them before its next kernel."""
        out = []
        with torch.cuda.stream(self.stream):
            for h in host:
                d = torch.empty(h.numel(), dtype=torch.uint8, device=self.device)
                d.copy_(h, non_blocking=True)
                out.append(d)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for d in out:
            d.record_stream(torch.cuda.current_stream(self.device))
        return out

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()
