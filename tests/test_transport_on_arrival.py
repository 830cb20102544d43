"""The receiver's on-arrival dequantization (kvsim.transport.layer_dequantizer): the same cache
as on demand, usable streams as the decode loop sees them, refused bytes raised where the
decoder asks, a layer-dependent codec on demand, the worker gone once the request ends."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import CodecError, make_codec
from kvsim.kernels.wire import WireError
from kvsim.kv.synthetic import generate_kv
from kvsim.transport import protocol as P
from kvsim.transport.assembly import Assembly

SHAPE = KVShape(layers=4, kv_heads=2, tokens=600, head_dim=64)


def _frames(enc, rid: int):
    """Every chunk of `enc` as the receiver's I/O thread gets it, per stream in seq order."""
    out = []
    for s, chunks in enumerate(enc.streams):
        for seq, c in enumerate(sorted(chunks, key=lambda c: (c.layer, c.page))):
            out.append(P.ChunkFrame(rid, s, c.layer, c.page, seq,
                                    memoryview(np.ascontiguousarray(c.payload).tobytes())))
    return out


def _assembly(codec, mode: str, anchor: bool, rid: int = 7) -> Assembly:
    asm = Assembly(rid, codec, SHAPE, codec.size_table(SHAPE), {}, dequantize=mode,
                   anchor_needed=anchor)
    asm.start()
    return asm


def _feed(asm: Assembly, frames) -> None:
    for f in frames:
        assert asm.add(f, f.payload.nbytes) == "ok"


def _workers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvsim-dequantize-")]


@pytest.mark.parametrize("name", ["uniform", "lynx"])
def test_on_arrival_gives_the_on_demand_cache(name: str):
    codec = make_codec(name)
    enc = codec.encode(generate_kv(SHAPE, seed=5))
    frames = _frames(enc, 7)
    n = codec.num_streams
    want = {k: codec.decode(enc, streams=k, dtype=torch.float32) for k in (1, n)}
    asm = _assembly(codec, "on_arrival", anchor=n > 1)
    assert asm.dequantize == "on_arrival" and asm.streams_ready() == 0
    anchor = [f for f in frames if f.stream == 0]
    _feed(asm, anchor)
    if n > 1:
        assert asm.wait_streams(1, timeout_s=30)
        assert asm.streams_ready() == 1  # the anchor is dequantized, the residual missing
        assert torch.equal(asm.kv(1), want[1])
        assert not asm.wait_streams(n, timeout_s=0.05)
        _feed(asm, [f for f in frames if f.stream > 0])
    assert asm.wait_streams(n, timeout_s=30)
    assert asm.streams_ready() == n
    assert torch.equal(asm.kv(n), want[n])
    spans = asm.dequantizer.spans
    assert len(spans) == SHAPE.layers * (2 if n > 1 else 1)
    asm.close()


def test_refused_layer_bytes_reach_the_decoder_as_an_error():
    codec = make_codec("uniform")
    enc = codec.encode(generate_kv(SHAPE, seed=2))
    frames = _frames(enc, 7)
    bad = frames[0]
    raw = bytearray(bad.payload)
    # the chunk's fp16 scales sit after the int8 codes: make every one of them NaN
    codes = 2 * SHAPE.kv_heads * 256 * SHAPE.head_dim
    raw[codes:] = b"\x00\x7e" * ((len(raw) - codes) // 2)
    frames[0] = P.ChunkFrame(bad.request_id, bad.stream, bad.layer, bad.page, bad.seq,
                             memoryview(bytes(raw)))
    asm = _assembly(codec, "on_arrival", anchor=False)
    _feed(asm, frames)
    assert asm.wait_streams(1, timeout_s=30)  # wakes up: kv() says why
    with pytest.raises((CodecError, WireError)):
        asm.kv(1)
    asm.close()


def test_a_layer_dependent_codec_is_dequantized_on_demand():
    codec = make_codec("cachegen")
    assert not codec.layer_independent
    enc = codec.encode(generate_kv(SHAPE, seed=1))
    asm = _assembly(codec, "on_arrival", anchor=True)
    assert asm.dequantize == "on_demand" and asm.dequantizer is None
    _feed(asm, _frames(enc, 7))
    assert asm.wait_streams(codec.num_streams, timeout_s=5)
    assert torch.equal(asm.kv(codec.num_streams),
                       codec.decode(enc, dtype=torch.float32))


def test_the_worker_ends_with_its_request():
    codec = make_codec("lynx")
    enc = codec.encode(generate_kv(SHAPE, seed=4))
    asm = _assembly(codec, "on_arrival", anchor=True, rid=991)
    _feed(asm, [f for f in _frames(enc, 991) if f.stream == 0])  # the residual never comes
    assert asm.wait_streams(1, timeout_s=30)
    assert f"kvsim-dequantize-{991:032x}" in _workers()
    asm.close()
    deadline = time.monotonic() + 5
    while f"kvsim-dequantize-{991:032x}" in _workers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f"kvsim-dequantize-{991:032x}" not in _workers()


def test_unknown_mode_is_refused():
    codec = make_codec("uniform")
    with pytest.raises(ValueError, match="dequantize must be one of"):
        Assembly(1, codec, SHAPE, codec.size_table(SHAPE), {}, dequantize="eager")


def _llama_config(layers: int, heads: int, dim: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, num_key_value_heads=heads,
                       num_attention_heads=heads, hidden_size=heads * dim, vocab_size=32,
                       intermediate_size=8)


def _same_cache(a, b) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_cache_from_layers_in_any_order_equals_kv_to_cache():
    from kvsim.kv.capture import CacheFromLayers, kv_to_cache

    cfg = _llama_config(SHAPE.layers, SHAPE.kv_heads, SHAPE.head_dim)
    kv = generate_kv(SHAPE, seed=9).float()
    b = CacheFromLayers(cfg, torch.float32)
    for layer in (2, 0, 3):
        b.add(layer, kv[layer])
    with pytest.raises(ValueError, match=r"lacks layers \[1\]"):
        b.cache()
    with pytest.raises(ValueError, match="added twice"):
        b.add(2, kv[2])
    b.add(1, kv[1])
    _same_cache(b.cache(), kv_to_cache(kv, cfg, torch.float32))


def test_on_arrival_builds_the_decoders_caches_layer_by_layer():
    """With the decode loop's cache builder, the worker grows the model's caches (anchor and
    full) as layers arrive; each is taken once, and no fp32 copy is kept."""
    from kvsim.kv.capture import CacheFromLayers, kv_to_cache

    cfg = _llama_config(SHAPE.layers, SHAPE.kv_heads, SHAPE.head_dim)
    codec = make_codec("lynx")
    enc = codec.encode(generate_kv(SHAPE, seed=6))
    asm = Assembly(7, codec, SHAPE, codec.size_table(SHAPE), {}, dequantize="on_arrival",
                   anchor_needed=True)
    asm.start(lambda: CacheFromLayers(cfg, torch.float32))
    _feed(asm, _frames(enc, 7))
    assert asm.wait_streams(2, timeout_s=30) and asm.wait_streams(1, timeout_s=30)
    for n in (1, 2):
        want = kv_to_cache(codec.decode(enc, streams=n, dtype=torch.float32), cfg,
                           torch.float32)
        _same_cache(asm.built_cache(n), want)
        with pytest.raises(RuntimeError, match="taken already"):
            asm.built_cache(n)
    with pytest.raises(RuntimeError, match="built_cache"):
        asm.kv(2)
    asm.close()


def test_a_closed_request_lets_its_caches_go_without_a_garbage_collection():
    """The worker's callback refers back to its assembly (a cycle): close() must drop the
    chunks and the dequantized layers at once, not at the next cyclic collection (the next
    request would page-fault fresh memory meanwhile)."""
    import gc
    import weakref

    codec = make_codec("lynx")
    enc = codec.encode(generate_kv(SHAPE, seed=8))
    gc.disable()
    try:
        asm = _assembly(codec, "on_arrival", anchor=True, rid=992)
        _feed(asm, _frames(enc, 992))
        assert asm.wait_streams(2, timeout_s=30)
        full = weakref.ref(asm.kv(2))
        payload = weakref.ref(asm.chunks[1][0].payload)
        assert full() is not None and payload() is not None
        asm.close()
        deadline = time.monotonic() + 5  # the worker thread ends after its last layer
        while f"kvsim-dequantize-{992:032x}" in _workers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert full() is None and payload() is None
        assert asm.chunks == [[], []]
    finally:
        gc.enable()
