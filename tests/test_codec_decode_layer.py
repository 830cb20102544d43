"""Codec.decode_layer: a layer decoded alone equals that layer of the whole cache's decode, for
every layer-independent codec and every stream prefix; bad input is refused."""

from __future__ import annotations

import pytest
import torch

from kvsim.core.layout import KVShape
from kvsim.kernels.codec import CodecError, codec_class, codec_names, make_codec
from kvsim.kv.synthetic import generate_kv

SHAPE = KVShape(layers=3, kv_heads=2, tokens=300, head_dim=64)


def _layer_chunks(enc, layer: int, n: int):
    return [[c for c in enc.streams[s] if c.layer == layer] for s in range(n)]


# kvsim's codecs (other tests register size-only codecs that cannot encode)
KVSIM_CODECS = [n for n in codec_names() if codec_class(n).__module__.startswith("kvsim.")]


@pytest.mark.parametrize("name", KVSIM_CODECS)
def test_decode_layer_equals_whole_decode(name: str) -> None:
    codec = make_codec(name)
    kv = generate_kv(SHAPE, seed=3)
    enc = codec.encode(kv)
    if not codec.layer_independent:
        with pytest.raises(CodecError, match="depth"):
            codec.decode_layer(SHAPE, 0, _layer_chunks(enc, 0, 1))
        return
    for n in range(1, codec.num_streams + 1):
        whole = codec.decode(enc, streams=n, dtype=torch.float32)
        for layer in range(SHAPE.layers):
            one = codec.decode_layer(SHAPE, layer, _layer_chunks(enc, layer, n),
                                     dtype=torch.float32)
            assert one.shape == (2, SHAPE.kv_heads, SHAPE.tokens, SHAPE.head_dim)
            assert torch.equal(one, whole[layer]), (name, n, layer)


def test_decode_layer_refuses_bad_input() -> None:
    codec = make_codec("uniform")
    enc = codec.encode(generate_kv(SHAPE, seed=1))
    chunks = _layer_chunks(enc, 1, 1)
    with pytest.raises(CodecError, match="given as layer 0"):
        codec.decode_layer(SHAPE, 0, chunks)
    with pytest.raises(CodecError, match="out of range"):
        codec.decode_layer(SHAPE, 3, chunks)
    with pytest.raises(CodecError, match="missing"):
        codec.decode_layer(SHAPE, 1, [chunks[0][:-1]])
    with pytest.raises(CodecError, match="streams given"):
        codec.decode_layer(SHAPE, 1, [chunks[0], chunks[0]])
