"""The codec interface and registry.

A codec turns a KV tensor [layers, 2, kv_heads, tokens, head_dim] into an `Encoded`:
ordered streams (anchor first) of (layer x page) chunks, and back. Every codec also
knows the byte size of every chunk for a shape without encoding (`size_table`), which
the simulator uses for 128K-token shapes; tests prove it equal to the serialized size.

Decoding treats the Encoded as untrusted input (it may come from a socket): before any
kernel runs, `Codec.decode` checks the preamble against the codec (page size, stream
names, a plausible shape: limits below, arithmetic only, nothing allocated), then every
chunk of the streams to decode (its coordinates, no duplicate, none missing, and for
exact-size codecs its payload length), then the codec's own content checks
(`_check_content`: finite scales, indices in range...). Anything wrong is a CodecError
naming the chunk. The output is cast to the requested dtype clamped to its finite range,
so finite input never decodes to inf (fp16 at +-65504).
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvsim.core.device import current_device
from kvsim.core.layout import DTYPES, KVShape, check_finite
from kvsim.core.lazy_module import lazy_module
from kvsim.kernels import wire
from kvsim.kernels.device_wire import DeviceWire, stream_buffers, stream_offsets
from kvsim.kernels.encoded import Chunk, Encoded, SizeTable, preamble_meta

if TYPE_CHECKING:
    import torch

    from kvsim.kernels import torch_threads
else:
    torch = lazy_module("torch")
    torch_threads = lazy_module("kvsim.kernels.torch_threads")

ABSENT = -1  # payload_bytes marker: this (stream, layer, page) chunk does not exist

# Largest shape a decoder accepts (a preamble claiming more is refused before anything is
# allocated). Generous for real models: 1M-token contexts, MLA's 576-wide latent heads.
MAX_TOKENS = 1 << 22
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_NUMEL = 1 << 37  # elements of the decoded tensor


class CodecError(ValueError):
    """Bad codec name, parameters, or an Encoded this codec cannot decode."""


class Codec(ABC):
    """Base class. Subclasses set `name`, `Params` (a dataclass with defaults) and implement
    `stream_names`, `page_tokens`, `payload_bytes`, `_encode`, `_decode`."""

    name: ClassVar[str]
    Params: ClassVar[type]
    exact_sizes: ClassVar[bool] = True  # False: payload_bytes is an estimate (entropy coding)
    # True: encoding layer l alone (kv[l:l+1]) gives layer l's chunks of the whole encode, so
    # a sender may encode layer by layer; False where a layer's coding depends on its depth
    layer_independent: ClassVar[bool] = True

    def pages_encode_alone(self) -> bool:
        """Each (layer, page) chunk depends on that page's tokens only, wherever the page
        sits: encoding a cache's later tokens alone (from a page boundary) gives the whole
        encode's chunks of those pages, and an earlier cache's chunks of a shared prefix are
        this cache's. What prefix reuse in the emulator needs (tests/test_prefix_reuse.py
        checks every codec that says so); False unless a codec says so."""
        return False

    def __init__(self, params: Any = None, **overrides: Any) -> None:
        if params is None or isinstance(params, dict):
            merged = {**(params or {}), **overrides}
            self.params = build_params(self.Params, merged, self.name)
        elif isinstance(params, self.Params):
            self.params = dataclasses.replace(params, **overrides) if overrides else params
        else:
            raise CodecError(f"{self.name}: params must be a dict or {self.Params.__name__}")

    # ---- description ----------------------------------------------------------------
    def params_dict(self) -> dict:
        """JSON-safe parameters (what goes in the preamble and in report rows)."""
        return _jsonable(dataclasses.asdict(self.params))

    @property
    def label(self) -> str:
        return self.name

    @abstractmethod
    def stream_names(self) -> list[str]:
        """Ordered stream names; stream i is useful once streams 0..i arrived."""

    @property
    def num_streams(self) -> int:
        return len(self.stream_names())

    @abstractmethod
    def page_tokens(self, shape: KVShape) -> int:
        """Tokens per chunk (the last page of a layer may be shorter)."""

    @abstractmethod
    def payload_bytes(self, shape: KVShape) -> np.ndarray:
        """[streams, layers, pages] int64 payload bytes of each chunk (ABSENT = no chunk),
        computed from the shape alone."""

    # ---- accounting -----------------------------------------------------------------
    def num_pages(self, shape: KVShape) -> int:
        return -(-shape.tokens // self.page_tokens(shape))

    def size_table(self, shape: KVShape) -> SizeTable:
        payload = np.asarray(self.payload_bytes(shape), dtype=np.int64)
        expected = (self.num_streams, shape.layers, self.num_pages(shape))
        if payload.shape != expected:
            raise AssertionError(f"{self.name}.payload_bytes shape {payload.shape} != {expected}")
        chunk = np.where(payload >= 0, payload + wire.CHUNK_HEADER_BYTES, 0)
        meta = preamble_meta(self.name, self.params_dict(), shape, self.page_tokens(shape),
                             self.stream_names())
        return SizeTable(self.stream_names(), self.page_tokens(shape),
                         wire.preamble_size_bytes(meta), chunk, exact=self.exact_sizes,
                         note=self.size_note())

    def calibrate(self, layer_kv: Any, shape: KVShape, source: dict[str, Any],
                  max_chunks: int = 16) -> Any:
        """Codecs whose sizes are estimates (exact_sizes False) measure their size model on a
        sample of the KV at hand (layer_kv(l) -> layer l [2, kv_heads, tokens, head_dim]) and
        return it; exact codecs have nothing to measure."""
        if not self.exact_sizes:
            raise NotImplementedError(f"{self.name} estimates its sizes but cannot calibrate")
        return None

    def size_note(self) -> str:
        """How payload_bytes knows the sizes: '' when exact, else where the estimate's data
        came from and its expected error."""
        return "" if self.exact_sizes else "estimate"

    # ---- encode / decode ------------------------------------------------------------
    def encode(self, kv: torch.Tensor) -> Encoded:
        """kv: [layers, 2, kv_heads, tokens, head_dim] in bf16/fp16/fp32, finite."""
        shape = KVShape.of(kv)
        if self.has_device_path(kv.device, shape):
            return self.encode_device(kv).to_encoded()  # one copy per stream to the host
        if not self._kernel_checks_finite(kv):
            check_finite(kv)
        self.check_shape(shape)
        # numba's kernels would leave torch on every core; Triton's launch on the thread's
        # current device
        with torch_threads.kept(), current_device(kv.device):
            streams = self._encode(kv, shape)
        if len(streams) != self.num_streams:
            raise AssertionError(f"{self.name} produced {len(streams)} streams")
        return Encoded(self.name, self.params_dict(), shape, self.page_tokens(shape),
                       self.stream_names(), streams)

    def decode(self, enc: Encoded, streams: int | None = None,
               dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Reconstruct [layers, 2, kv_heads, tokens, head_dim] from the first `streams`
        streams (all by default), in `dtype` (default: the encoded tensor's dtype)."""
        n = self.num_streams if streams is None else int(streams)
        if enc.codec != self.name:
            raise CodecError(f"cannot decode a {enc.codec!r} cache with codec {self.name!r}")
        if enc.params != self.params_dict():
            raise CodecError(f"{self.name}: Encoded was made with params {enc.params}, "
                             f"this codec has {self.params_dict()}; use codec_for(encoded)")
        if not 1 <= n <= self.num_streams:
            raise CodecError(f"{self.name}: streams must be in 1..{self.num_streams}, got {n}")
        self._check_preamble(enc)
        self._check_complete(enc, n)
        self._check_content(enc, n)
        dtype = dtype or DTYPES[enc.shape.dtype]
        target = torch.device(device) if device else torch.device("cpu")
        # numba's kernels would leave torch on every core; Triton's launch on the thread's
        # current device
        with torch_threads.kept(), current_device(target):
            if self.has_device_path(target, enc.shape):  # one copy per stream, then kernels
                out = self._decode_device(stream_buffers(enc, n, target), enc.shape, dtype)
            else:
                out = self._decode_to(enc, n, target, dtype)
        return cast_finite(out, dtype)

    # ---- the device path (kvsim.kernels.device_wire) --------------------------------
    def has_device_path(self, device: torch.device, shape: KVShape) -> bool:
        """True where this codec, as configured, encodes a cache of `shape` on `device` into
        its wire buffers with a fixed number of kernel launches (encode_device / decode_device)."""
        return False

    def encode_device(self, kv: torch.Tensor, verify: bool = True) -> DeviceWire:
        """kv [layers, 2, kv_heads, tokens, head_dim] -> its wire buffers on kv's device, the
        bytes encode() gives (DeviceWire.to_encoded). verify=False leaves the input's checks
        on the device (call DeviceWire.verify(kv) before using the bytes): nothing waits for
        the device, so the encode can be timed alone and overlapped with copies."""
        shape = KVShape.of(kv)
        if not self.has_device_path(kv.device, shape):
            raise CodecError(f"{self.label}: no device path for {shape.dims} on {kv.device} "
                             "with these params")
        self.check_shape(shape)
        with current_device(kv.device):  # where Triton launches (a thread's is cuda:0)
            buffers, status = self._encode_device(kv, shape)
        dw = DeviceWire(self.name, self.params_dict(), shape, self.page_tokens(shape),
                        self.stream_names(), buffers, self.wire_sizes(shape), status)
        if verify:
            dw.verify(kv)
        return dw

    def decode_device(self, buffers: list[torch.Tensor], shape: KVShape,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
        """Mirror of encode_device: the first len(buffers) streams' wire buffers (on the
        device the result is wanted on; from encode_device, or from an Encoded that decode()
        has checked, device_wire.stream_buffers) -> [layers, 2, kv_heads, tokens, head_dim]
        in `dtype` (default: the encoded dtype), clamped to its finite range."""
        if not buffers or not self.has_device_path(buffers[0].device, shape):
            raise CodecError(f"{self.label}: no device path for these buffers")
        if len(buffers) > self.num_streams:
            raise CodecError(f"{self.label}: {len(buffers)} buffers for {self.num_streams} "
                             "streams")
        sizes = stream_offsets(self.wire_sizes(shape))
        for s, buf in enumerate(buffers):  # the kernels read where the size table says
            want = sizes[s][2]
            if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != want:
                raise CodecError(f"{self.label}: stream {s} buffer must be 1-D uint8 of {want} "
                                 f"bytes, got {buf.dtype} {tuple(buf.shape)}")
        dtype = dtype or DTYPES[shape.dtype]
        with current_device(buffers[0].device):  # where Triton launches
            return cast_finite(self._decode_device(buffers, shape, dtype), dtype)

    def wire_sizes(self, shape: KVShape) -> np.ndarray:
        """payload_bytes(shape), computed once per shape (the device path asks for it around
        every launch; a page loop in Python would sit in front of the kernels)."""
        cache = self.__dict__.setdefault("_wire_sizes", {})
        sizes = cache.get(shape)
        if sizes is None:
            sizes = np.asarray(self.payload_bytes(shape), dtype=np.int64)
            remember(cache, shape, sizes)
        return sizes

    def _encode_device(self, kv: torch.Tensor, shape: KVShape
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """(wire buffer of each stream, status flags or None): see DeviceWire."""
        raise NotImplementedError(f"{self.name} has no device path")

    def _decode_device(self, buffers: list[torch.Tensor], shape: KVShape,
                       dtype: torch.dtype) -> torch.Tensor:
        """Reconstruct from the first len(buffers) streams' wire buffers; may return fp32
        (decode_device casts)."""
        raise NotImplementedError(f"{self.name} has no device path")

    def decode_layer(self, shape: KVShape, layer: int, chunks: list[list[Chunk]],
                     dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """Reconstruct layer `layer` [2, kv_heads, tokens, head_dim] of a cache of `shape` from
        that layer's chunks of streams 0..n-1 (chunks[s]: every page of stream s, n =
        len(chunks)); equal to decode(whole cache, streams=n)[layer]. Only for
        layer_independent codecs (a receiver dequantizes each layer as it arrives). On
        `device` (default: the CPU), as decode(). The chunks are validated as decode()
        validates a whole cache (CodecError)."""
        if not self.layer_independent:
            raise CodecError(f"{self.name}: a layer's coding depends on its depth; decode the "
                             "whole cache")
        if not _is_index(layer, shape.layers):
            raise CodecError(f"{self.name}: layer {layer!r} out of range for {shape.layers} "
                             "layers")
        if not 1 <= len(chunks) <= self.num_streams:
            raise CodecError(f"{self.name}: {len(chunks)} streams given, the codec has "
                             f"{self.num_streams}")
        relabelled: list[list[Chunk]] = []
        for s, stream in enumerate(chunks):
            for c in stream:
                if c.layer != layer:
                    raise CodecError(f"{self.name}: chunk (stream {s}, layer {c.layer}, page "
                                     f"{c.page}) given as layer {layer}")
            relabelled.append([Chunk(c.stream, 0, c.page, c.payload) for c in stream])
        relabelled += [[] for _ in range(self.num_streams - len(chunks))]
        one = dataclasses.replace(shape, layers=1)
        enc = Encoded(self.name, self.params_dict(), one, self.page_tokens(one),
                      self.stream_names(), relabelled)
        return self.decode(enc, streams=len(chunks), dtype=dtype, device=device)[0]

    def _kernel_checks_finite(self, kv: torch.Tensor) -> bool:
        """True where _encode's kernel finds NaN / Inf in `kv` itself (saving encode() a pass
        over the cache); it must then raise check_finite's error (call check_finite(kv))."""
        return False

    def check_shape(self, shape: KVShape) -> None:  # noqa: B027 (optional hook)
        """Refuse shapes this codec cannot handle, with a clear message (override)."""

    # The host path: a codec implements it, its device path (has_device_path,
    # _encode_device, _decode_device), or both; encode() / decode() take the device path
    # wherever has_device_path says it applies.
    def _encode(self, kv: torch.Tensor, shape: KVShape) -> list[list[Chunk]]:
        """Return streams[i] = list of chunks of stream i."""
        raise NotImplementedError(f"{self.name} has no host path on {kv.device}")

    def _decode(self, enc: Encoded, streams: int, device: torch.device) -> torch.Tensor:
        """Reconstruct from the first `streams` streams (presence already checked)."""
        raise NotImplementedError(f"{self.name} has no host path on {device}")

    def _decode_to(self, enc: Encoded, streams: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
        """_decode, then cast (decode() then clamps to `dtype`'s finite range, see
        cast_finite); override where a kernel can write `dtype` directly."""
        return cast_finite(self._decode(enc, streams, device), dtype)

    # ---- validation of untrusted input (all before any kernel runs) -------------------
    def _check_preamble(self, enc: Encoded) -> None:
        """The preamble fields the params do not pin: shape limits, page size, streams."""
        shape = enc.shape
        check_shape_limits(shape, self.name)
        try:
            self.check_shape(shape)
            page_tokens = self.page_tokens(shape)
        except CodecError:
            raise
        except ValueError as exc:
            raise CodecError(f"{self.name}: cannot decode shape {shape.dims}: {exc}") from exc
        if enc.page_tokens != page_tokens:
            raise CodecError(f"{self.name}: preamble says page_tokens {enc.page_tokens}, the "
                             f"codec's params say {page_tokens}")
        if list(enc.stream_names) != self.stream_names():
            raise CodecError(f"{self.name}: preamble names streams {enc.stream_names}, the "
                             f"codec has {self.stream_names()}")

    def chunk_count(self, shape: KVShape) -> list[int]:
        """Chunks per stream (override where payload_bytes marks chunks ABSENT)."""
        return [shape.layers * self.num_pages(shape)] * self.num_streams

    def _check_complete(self, enc: Encoded, n: int) -> None:
        """Every chunk of streams 0..n-1: in its stream, in range, not ABSENT, not twice,
        a 1-D uint8 payload of the exact size (exact-size codecs); none missing."""
        counts = self.chunk_count(enc.shape)
        for s in range(n):  # counting first: a forged preamble costs O(chunks received)
            have = len(enc.streams[s]) if s < len(enc.streams) else 0
            if have < counts[s]:
                raise CodecError(f"{self.name}: stream {s} ({self.stream_names()[s]}) is missing "
                                 f"{counts[s] - have} chunk(s) of {counts[s]}")
        try:
            expected = np.asarray(self.payload_bytes(enc.shape), dtype=np.int64)
        except CodecError:
            raise
        except ValueError as exc:
            raise CodecError(f"{self.name}: cannot size shape {enc.shape.dims}: {exc}") from exc
        layers, pages = expected.shape[1:]
        for s in range(n):
            seen = np.zeros((layers, pages), dtype=bool)
            for c in enc.streams[s]:
                where = f"{self.name}: chunk (stream {s}, layer {c.layer}, page {c.page})"
                if c.stream != s:
                    raise CodecError(f"{where}: filed under stream {s} but says stream "
                                     f"{c.stream}")
                if not (_is_index(c.layer, layers) and _is_index(c.page, pages)):
                    raise CodecError(f"{where}: out of range for {layers} layers x {pages} "
                                     "pages")
                want = int(expected[s, c.layer, c.page])
                if want == ABSENT:
                    raise CodecError(f"{where}: this codec has no such chunk")
                if seen[c.layer, c.page]:
                    raise CodecError(f"{where}: duplicate chunk")
                seen[c.layer, c.page] = True
                p = c.payload
                if not (isinstance(p, np.ndarray) and p.dtype == np.uint8 and p.ndim == 1):
                    raise CodecError(f"{where}: payload must be a 1-D uint8 array")
                if self.exact_sizes and p.size != want:
                    raise CodecError(f"{where}: payload is {p.size} bytes, expected {want}")
            missing = (expected[s] >= 0) & ~seen
            if missing.any():
                first = tuple(int(i) for i in np.argwhere(missing)[0])
                raise CodecError(f"{self.name}: stream {s} ({self.stream_names()[s]}) is missing "
                                 f"{int(missing.sum())} chunk(s), first (layer, page) = {first}")

    def _check_content(self, enc: Encoded, n: int) -> None:  # noqa: B027 (optional hook)
        """Codec-specific checks of the payload contents of streams 0..n-1 (finite scales,
        indices in range), after _check_complete; raise CodecError naming the chunk."""


def check_shape_limits(shape: KVShape, who: str) -> None:
    """Refuse a shape beyond the decoder's limits (MAX_*), from the numbers alone."""
    limits = (("layers", MAX_LAYERS), ("kv_heads", MAX_KV_HEADS), ("tokens", MAX_TOKENS),
              ("head_dim", MAX_HEAD_DIM))
    for field, cap in limits:
        if getattr(shape, field) > cap:
            raise CodecError(f"{who}: shape {field} = {getattr(shape, field)} exceeds the "
                             f"decoder's limit {cap}")
    if shape.numel > MAX_NUMEL:
        raise CodecError(f"{who}: shape {shape.dims} has {shape.numel} elements, more than the "
                         f"decoder's limit {MAX_NUMEL}")


def cast_finite(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out.to(dtype) within dtype's finite range (fp32 / bf16 -> fp16: 65504 + half a
    quantization step must not become inf). The cast rounds what is beyond fp16's range to
    +-inf, the in-place clamp of the fp16 result then brings it to +-65504: the same values
    as clamping before the cast, at the cost of one pass over the fp16 tensor. Only fp16
    needs it: fp32 -> bf16 cannot overflow for values the codecs produce (finite fp16 /
    bf16 metadata keep them far below bf16's 3.4e38; lynx clamps its own)."""
    if out.dtype == dtype:
        return out
    if dtype == torch.float16:
        big = torch.finfo(torch.float16).max
        return out.to(dtype).clamp_(-big, big)
    return out.to(dtype)


def finite_bits(raw: np.ndarray, kind: str) -> bool:
    """raw: uint8 bytes of little-endian floats of `kind` (f16 | bf16 | f32) -> True when
    every value is finite (no NaN / Inf bit pattern). One vectorised pass."""
    view, mask = {"f16": ("<u2", 0x7C00), "bf16": ("<u2", 0x7F80),
                  "f32": ("<u4", 0x7F800000)}[kind]
    if raw.size == 0:
        return True
    u = np.ascontiguousarray(raw).view(view)
    return int(np.bitwise_and(u, mask).max()) != mask


def _is_index(x: object, n: int) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 <= x < n


# ---- registry ---------------------------------------------------------------------------
_REGISTRY: dict[str, type[Codec]] = {}
_DISCOVERED = False


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec available by name (from config and the wire)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise RuntimeError(f"codec name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


# The modules of kvsim.kernels that define codec classes. Their backends (numba *_cpu,
# Triton *_triton, rans) are imported on first use, so knowing the codecs, their streams and
# sizes imports neither numba nor Triton nor torch (tests/test_codec_imports.py checks both
# this list and that).
CODEC_MODULES = ("bf16", "uniform.codec", "kivi.codec", "kivi.gear", "kivi.oscar", "lynx.codec",
                 "cachegen.codec")


def _discover() -> None:
    """Import the codec modules so their @register decorators run."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    for name in CODEC_MODULES:
        importlib.import_module(f"kvsim.kernels.{name}")
    _DISCOVERED = True


def codec_names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def codec_class(name: str) -> type[Codec]:
    _discover()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise CodecError(
            f"unknown codec {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


# shapes a codec keeps its per-shape tables for (a sender's concurrent requests of several
# context lengths share one codec per variant)
SHAPES_REMEMBERED = 16


def remember(cache: dict, key: Any, value: Any) -> None:
    """cache[key] = value, dropping the oldest entries beyond SHAPES_REMEMBERED. Threads may
    share `cache`: each uses the value it made or read, never a lookup after this call."""
    cache[key] = value
    while len(cache) > SHAPES_REMEMBERED:
        try:
            del cache[next(iter(cache))]
        except (KeyError, RuntimeError, StopIteration):  # another thread dropped it first
            break


def make_codec(name: str, params: dict | None = None) -> Codec:
    return codec_class(name)(dict(params or {}))


def codec_for(enc: Encoded) -> Codec:
    """The codec (with the same params) that can decode `enc` (checked_codec)."""
    return checked_codec(enc.codec, enc.params)


def checked_codec(name: Any, params: Any) -> Codec:
    """A codec built from an untrusted name and params (a preamble from a file or the
    wire): numbers must be plain and bounded, and the codec built from them must describe
    itself with exactly those params. Raises CodecError naming what is wrong."""
    if not isinstance(name, str):
        raise CodecError(f"codec name must be a string, got {type(name).__name__}")
    if not isinstance(params, dict):
        raise CodecError(f"codec {name[:64]!r}: params must be an object")
    bad = _unsafe_value(params) or _wrong_type(codec_class(name).Params, params)
    if bad:
        raise CodecError(f"codec {name!r}: parameter {bad[:200]}")
    try:
        codec = make_codec(name, params)
    except (OverflowError, TypeError, ValueError, MemoryError) as exc:
        raise CodecError(f"codec {name!r}: parameters not usable: {str(exc)[:200]}") from None
    if codec.params_dict() != params:
        raise CodecError(f"codec {name!r}: params are not in canonical form (the codec reads "
                         f"them as {str(codec.params_dict())[:200]})")
    return codec


MAX_PARAM_INT = 1 << 31  # |int| bound on a parameter read from the wire


def _wrong_type(params_cls: type, values: dict) -> str:
    """'' if every value has the type of its field's default (int: not bool; float: int or
    float; tuple: a list), else which one does not."""
    for f in dataclasses.fields(params_cls):
        if f.name not in values or f.default is dataclasses.MISSING:
            continue
        v, d = values[f.name], f.default
        if isinstance(d, bool):
            ok = isinstance(v, bool)
        elif isinstance(d, int):
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif isinstance(d, float):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        elif isinstance(d, (tuple, list)):
            ok = isinstance(v, list)
        else:
            ok = isinstance(v, type(d))
        if not ok:
            return f"{f.name} = {v!r:.50} is not a {type(d).__name__}"
    return ""


def _unsafe_value(obj: Any, depth: int = 0) -> str:
    """'' if obj (from JSON) holds only bounded ints, finite floats, strings, bools and
    shallow lists / dicts of them; else what is wrong."""
    if depth > 4:
        return "nests too deep"
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return ""
    if isinstance(obj, int):
        return "" if abs(obj) < MAX_PARAM_INT else f"{obj} is out of range"
    if isinstance(obj, float):
        return "" if np.isfinite(obj) else f"{obj} is not finite"
    if isinstance(obj, (list, tuple)):
        return next((b for b in (_unsafe_value(v, depth + 1) for v in obj) if b), "")
    if isinstance(obj, dict):
        return next((f"{k}: {b}" for k, v in obj.items() if (b := _unsafe_value(v, depth + 1))),
                    "")
    return f"has unsupported type {type(obj).__name__}"


def build_params(params_cls: type, values: dict, codec_name: str) -> Any:
    names = {f.name for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise CodecError(f"codec {codec_name!r}: unknown parameter(s) {unknown}; "
                         f"valid: {sorted(names)}")
    try:
        return params_cls(**values)
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise CodecError(f"codec {codec_name!r}: bad parameters {values}: {exc}") from exc


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
