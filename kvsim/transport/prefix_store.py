"""The decode node's prefix store (`kvsim serve` with prefix reuse): the KV of the prompt
blocks its requests brought, as its decoder holds it (bf16, dequantized), kept by block id,
so that a later request whose prompt starts with them is sent, and dequantizes, only the
rest.

A HELLO may name its prompt's blocks (`prefix`: ids of `block_tokens`-token blocks, as a
Mooncake trace's hash_ids: equal ids, equal prefix). The receiver looks up the leading run
the store holds (at most (tokens - 1) // block_tokens blocks: one token at least is sent),
counts those blocks' pages as received in the request's assembly (`HeldPrefix`: they are
neither sent nor dequantized; each layer the decoder gets is the held tokens, then the
decoded rest) and tells the sender in its ACCEPT (`prefix_tokens`; the pages also as held),
which encodes and sends only the tokens after them. Once a request's cache is dequantized
whole (every stream, every layer: on arrival, or when its decoder loads it on demand), its
full blocks go to the store, pinned until the request ends (kvsim.scenario.prefix_cache:
least recently used idle blocks give way, a prompt's tail before its head), as the
simulator's decode instances keep a request's blocks once it is in and admitted.

Reuse needs a codec whose pages decode alone (`Codec.pages_encode_alone`: the pages after a
prefix are a cache of their own), and stays between requests of one format: the codec with
its parameters, the per-token shape (layers, kv_heads, head_dim), page and block tokens, and
the sender's variant (each (codec, transfer) variant of an emulation starts from an empty
store, as each of the simulator's runs does). The store's bytes (bf16 KV: those the
simulator's decode cache counts) count against the receiver's memory budget; its idle blocks
are evicted when a request's admission needs the room.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import torch

from kvsim.core.layout import KVShape
from kvsim.kernels.encoded import Chunk
from kvsim.scenario.prefix_cache import PrefixCache

Key = str  # a format (see the module doc), as canonical JSON
HELD_DTYPE = torch.bfloat16  # a stored block's KV, as a decoder holds it


class PrefixStore:
    def __init__(self, capacity_bytes: float) -> None:
        if not capacity_bytes > 0:
            raise ValueError(f"prefix store capacity must be > 0 bytes, got {capacity_bytes!r}")
        self.capacity_bytes = float(capacity_bytes)
        self._caches: dict[Key, PrefixCache] = {}
        # block -> its KV [layers, 2, kv_heads, block_tokens, head_dim] (HELD_DTYPE)
        self._kv: dict[Key, dict[int, torch.Tensor]] = {}

    @property
    def held_bytes(self) -> float:
        return sum(c.held_bytes for c in self._caches.values())

    @property
    def idle_bytes(self) -> float:
        return sum(c.idle_bytes for c in self._caches.values())

    def _cache(self, key: Key, block_bytes: float) -> PrefixCache:
        cache = self._caches.get(key)
        if cache is None:
            kv: dict[int, torch.Tensor] = {}
            # the store bounds the bytes of every format together (_room), not each cache
            cache = PrefixCache(block_bytes, math.inf, on_evict=kv.__delitem__)
            self._caches[key], self._kv[key] = cache, kv
        return cache

    def evict(self, needed_bytes: float, key: Key | None = None) -> float:
        """Free up to `needed_bytes` of idle blocks: other formats' first (an earlier variant
        of the run is done with them), then `key`'s own, least recently used first."""
        freed = 0.0
        for k in sorted(self._caches, key=lambda k: k == key):
            if freed >= needed_bytes:
                break
            freed += self._caches[k].evict(needed_bytes - freed)
        return freed

    def lookup(self, key: Key, block_bytes: float, blocks: Sequence[int], limit: int
               ) -> tuple[int, list[torch.Tensor]]:
        """The leading blocks (at most `limit`) held for this format, pinned for the caller,
        and their KV."""
        cache = self._cache(key, block_bytes)
        hit = cache.match(blocks, limit)
        cache.pin(blocks[:hit])
        kv = self._kv[key]
        return hit, [kv[b] for b in blocks[:hit]]

    def adopt(self, key: Key, block_bytes: float, blocks: Sequence[int],
              kv_of: Sequence[torch.Tensor]) -> list[int]:
        """A request's blocks (a run of its prompt, in order; kv_of[i]: block i's KV) are
        dequantized: each is pinned for it, stored first where not held yet (idle blocks
        evicted for room; the run stops at one that finds none). Returns the blocks pinned
        for it."""
        cache, kv = self._cache(key, block_bytes), self._kv[key]
        adopted = []
        for block, its_kv in zip(blocks, kv_of, strict=True):
            if block not in cache:
                over = self.held_bytes + block_bytes - self.capacity_bytes
                if over > 0 and self.evict(over, key) < over:
                    break
                kv[block] = its_kv
            cache.adopt([block])
            adopted.append(block)
        return adopted

    def release(self, key: Key, blocks: Sequence[int]) -> None:
        """The request that pinned `blocks` ended."""
        self._caches[key].unpin(blocks)


class HeldPrefix:
    """The leading blocks of a request's prompt its decode node holds (their KV, each
    [layers, 2, kv_heads, block_tokens, head_dim]): their pages are not sent and not
    dequantized; the pages after them, renumbered from 0, are a cache of their own
    (`rest_shape`, `rest_chunks`: pages that decode alone), and each layer of the request's
    cache is the held tokens, then that cache's."""

    def __init__(self, blocks: list[torch.Tensor], block_tokens: int, page_tokens: int) -> None:
        self.blocks, self.block_tokens = blocks, block_tokens
        self.tokens = len(blocks) * block_tokens
        self.pages = self.tokens // page_tokens

    def rest_shape(self, shape: KVShape) -> KVShape:
        return dataclasses.replace(shape, tokens=shape.tokens - self.tokens)

    def rest_chunks(self, chunks: list[list[Chunk]]) -> list[list[Chunk]]:
        """chunks[s]: stream s's chunks of the pages after the held ones, renumbered."""
        return [[Chunk(c.stream, c.layer, c.page - self.pages, c.payload) for c in stream]
                for stream in chunks]

    def layer(self, layer: int, rest: torch.Tensor) -> torch.Tensor:
        """Layer `layer` [2, kv_heads, tokens, head_dim] of the request's cache, in rest's
        dtype, from its decoded rest [2, kv_heads, tokens - held, head_dim]."""
        out = rest.new_empty(rest.shape[0], rest.shape[1], self.tokens + rest.shape[2],
                             rest.shape[3])
        bt = self.block_tokens
        for i, block in enumerate(self.blocks):
            out[:, :, i * bt:(i + 1) * bt].copy_(block[layer])
        out[:, :, self.tokens:].copy_(rest)
        return out

    def whole(self, rest: torch.Tensor) -> torch.Tensor:
        """The request's cache [layers, 2, kv_heads, tokens, head_dim] from its decoded rest
        [layers, 2, kv_heads, tokens - held, head_dim]."""
        return torch.stack([self.layer(layer, rest[layer]) for layer in range(rest.shape[0])])


MAX_PREFIX_BLOCKS = 1 << 16  # block ids a HELLO may name (1M tokens in 16-token blocks)


class PrefixUse:
    """One request's part in the store: its format, block ids and block size, the leading
    blocks it reused (pinned), and the blocks it gives (pinned) once its cache is
    dequantized whole."""

    __slots__ = ("key", "blocks", "block_tokens", "block_bytes", "layers", "hit", "kept",
                 "ended", "full", "given", "_giving")

    def __init__(self, key: Key, blocks: tuple[int, ...], block_tokens: int,
                 block_bytes: float, layers: int, tokens: int) -> None:
        self.key, self.blocks, self.block_tokens = key, blocks, block_tokens
        self.block_bytes, self.layers = block_bytes, layers
        self.hit = 0
        self.kept: list[int] = []
        self.ended = False  # the request ended: what it gives after that is not kept
        self.given = False  # every layer was given (once: a later load gives nothing)
        self.full = tokens // block_tokens  # its full blocks (a partial last one is not kept)
        self._giving: dict[int, torch.Tensor] = {}  # layer -> its blocks after the hit

    @property
    def hit_tokens(self) -> int:
        return self.hit * self.block_tokens

    def give_layer(self, layer: int, kv_layer: torch.Tensor) -> list[torch.Tensor] | None:
        """One layer [2, kv_heads, tokens, head_dim] of the request's cache dequantized with
        every stream (called once per layer, from its dequantizer's thread): the KV of its full
        blocks after the hit, each [layers, 2, kv_heads, block_tokens, head_dim], once every
        layer was given; None before that (and for a request with no block to give)."""
        bt, first = self.block_tokens, self.hit * self.block_tokens
        if self.given or self.full <= self.hit or layer in self._giving:
            return None
        self._giving[layer] = kv_layer[:, :, first:self.full * bt].to(HELD_DTYPE)
        if len(self._giving) < self.layers:
            return None
        giving, self._giving, self.given = self._giving, {}, True
        return [torch.stack([giving[layer][:, :, i * bt:(i + 1) * bt]
                             for layer in range(self.layers)])
                for i in range(self.full - self.hit)]


def prefix_of(hello: dict, codec, shape, page_tokens: int) -> PrefixUse | None:
    """The HELLO's `prefix` ({"blocks": [int, ...], "block_tokens": int}; absent: None),
    checked against its cache (untrusted: every field bounded). Raises ValueError naming
    what is wrong."""
    doc = hello.get("prefix")
    if doc is None:
        return None
    if not isinstance(doc, dict) or set(doc) != {"blocks", "block_tokens"}:
        raise ValueError("prefix must be an object of blocks and block_tokens")
    bt, blocks = doc["block_tokens"], doc["blocks"]
    if isinstance(bt, bool) or not isinstance(bt, int) or not 1 <= bt <= 1 << 20:
        raise ValueError("prefix block_tokens must be an integer in 1..2^20")
    if bt % page_tokens:
        raise ValueError(f"prefix block_tokens {bt} is not a multiple of the codec's "
                         f"{page_tokens}-token pages")
    if not isinstance(blocks, list) or len(blocks) > MAX_PREFIX_BLOCKS or \
            len(blocks) != -(-shape.tokens // bt) or any(
                isinstance(b, bool) or not isinstance(b, int) or not -2**63 <= b < 2**63
                for b in blocks):
        raise ValueError(f"prefix blocks must be {-(-shape.tokens // bt)} integer ids (one "
                         f"per {bt}-token block of {shape.tokens} tokens)")
    if not codec.pages_encode_alone():
        raise ValueError(f"prefix reuse needs a codec whose pages encode alone; "
                         f"{codec.name} {codec.params_dict()} does not")
    # one block's KV as the store holds it (HELD_DTYPE)
    block_bytes = shape.layers * 2 * shape.kv_heads * bt * shape.head_dim * \
        HELD_DTYPE.itemsize
    key = json.dumps({"codec": codec.name, "params": codec.params_dict(),
                      "layers": shape.layers, "kv_heads": shape.kv_heads,
                      "head_dim": shape.head_dim, "page_tokens": page_tokens,
                      "block_tokens": bt, "variant": hello.get("variant")},
                     sort_keys=True, default=str)
    return PrefixUse(key, tuple(blocks), bt, float(block_bytes), shape.layers, shape.tokens)

