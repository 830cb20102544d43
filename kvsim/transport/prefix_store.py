"""The decode node's prefix store (`kvsim serve` with prefix reuse): the chunks of the prompt
blocks its requests brought, kept by block id, so that a later request whose prompt starts
with them is sent only the rest.

A HELLO may name its prompt's blocks (`prefix`: ids of `block_tokens`-token blocks, as a
Mooncake trace's hash_ids: equal ids, equal prefix). The receiver looks up the leading run
the store holds (at most (tokens - 1) // block_tokens blocks: one token at least is sent),
puts those blocks' chunks into the request's assembly as if received, and tells the sender
in its ACCEPT (`prefix_tokens`; the chunks also as held), which encodes and sends only the
tokens after them. Once all of a request's chunks are in, its full blocks go to the store,
pinned until the request ends (kvsim.scenario.prefix_cache: least recently used idle blocks
give way, a prompt's tail before its head), as the simulator's decode instances do.

Chunks are reusable only where a page's chunk depends on that page alone
(`Codec.pages_encode_alone`), and only between requests of one format: the codec with its
parameters, the per-token shape (layers, kv_heads, head_dim), page and block tokens, and the
sender's variant (each (codec, transfer) variant of an emulation starts from an empty store,
as each of the simulator's runs does). The store's bytes (the chunks' payloads) count
against the receiver's memory budget; its idle blocks are evicted when a request's
admission needs the room.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np

from kvsim.kernels import wire
from kvsim.kernels.encoded import Chunk
from kvsim.scenario.prefix_cache import PrefixCache

Key = str  # a format (see the module doc), as canonical JSON


class PrefixStore:
    def __init__(self, capacity_bytes: float) -> None:
        if not capacity_bytes > 0:
            raise ValueError(f"prefix store capacity must be > 0 bytes, got {capacity_bytes!r}")
        self.capacity_bytes = float(capacity_bytes)
        self._caches: dict[Key, PrefixCache] = {}
        self._chunks: dict[Key, dict[int, list[Chunk]]] = {}

    @property
    def held_bytes(self) -> float:
        return sum(c.held_bytes for c in self._caches.values())

    @property
    def idle_bytes(self) -> float:
        return sum(c.idle_bytes for c in self._caches.values())

    def _cache(self, key: Key, block_bytes: float) -> PrefixCache:
        cache = self._caches.get(key)
        if cache is None:
            chunks: dict[int, list[Chunk]] = {}
            # the store bounds the bytes of every format together (_room), not each cache
            cache = PrefixCache(block_bytes, math.inf, on_evict=chunks.__delitem__)
            self._caches[key], self._chunks[key] = cache, chunks
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
               ) -> tuple[int, list[Chunk]]:
        """The leading blocks (at most `limit`) held for this format, pinned for the caller,
        and their chunks."""
        cache = self._cache(key, block_bytes)
        hit = cache.match(blocks, limit)
        cache.pin(blocks[:hit])
        chunks = self._chunks[key]
        return hit, [c for b in blocks[:hit] for c in chunks[b]]

    def adopt(self, key: Key, block_bytes: float, blocks: Sequence[int],
              chunks_of: Sequence[list[Chunk]]) -> list[int]:
        """A request's blocks (a run of its prompt, in order; chunks_of[i]: block i's chunks)
        are in: each is pinned for it, stored first where not held yet (idle blocks evicted
        for room; the run stops at one that finds none). Returns the blocks pinned for it."""
        cache, chunks = self._cache(key, block_bytes), self._chunks[key]
        adopted = []
        for block, its_chunks in zip(blocks, chunks_of, strict=True):
            if block not in cache:
                over = self.held_bytes + block_bytes - self.capacity_bytes
                if over > 0 and self.evict(over, key) < over:
                    break
                chunks[block] = its_chunks
            cache.adopt([block])
            adopted.append(block)
        return adopted

    def release(self, key: Key, blocks: Sequence[int]) -> None:
        """The request that pinned `blocks` ended."""
        self._caches[key].unpin(blocks)


MAX_PREFIX_BLOCKS = 1 << 16  # block ids a HELLO may name (1M tokens in 16-token blocks)


class PrefixUse:
    """One request's part in the store: its format, block ids and block size, the leading
    blocks it reused (pinned), the blocks it gave (pinned) once all its chunks were in."""

    __slots__ = ("key", "blocks", "block_tokens", "block_bytes", "pages_per_block", "hit",
                 "kept", "given")

    def __init__(self, key: Key, blocks: tuple[int, ...], block_tokens: int,
                 block_bytes: float, pages_per_block: int) -> None:
        self.key, self.blocks, self.block_tokens = key, blocks, block_tokens
        self.block_bytes, self.pages_per_block = block_bytes, pages_per_block
        self.hit = 0
        self.kept: list[int] = []
        self.given = False  # its blocks went to the store

    @property
    def hit_tokens(self) -> int:
        return self.hit * self.block_tokens


def prefix_of(hello: dict, codec, shape, table, page_tokens: int) -> PrefixUse | None:
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
    ppb = bt // page_tokens
    # payload bytes of one full block: its pages' chunks, every stream and layer (a full
    # page's chunks are the same size wherever it sits: pages_encode_alone)
    per_page = (np.asarray(table.chunk_bytes)[:, :, 0] - wire.CHUNK_HEADER_BYTES).sum()
    key = json.dumps({"codec": codec.name, "params": codec.params_dict(),
                      "layers": shape.layers, "kv_heads": shape.kv_heads,
                      "head_dim": shape.head_dim, "page_tokens": page_tokens,
                      "block_tokens": bt, "variant": hello.get("variant")},
                     sort_keys=True, default=str)
    return PrefixUse(key, tuple(blocks), bt, float(per_page * ppb), ppb)


def chunks_by_block(chunks: list[list[Chunk]], first: int, end: int,
                    pages_per_block: int) -> list[list[Chunk]]:
    """[i]: the chunks (every stream) of block first + i, for blocks first..end-1."""
    out: list[list[Chunk]] = [[] for _ in range(first, end)]
    for stream in chunks:
        for c in stream:
            b = c.page // pages_per_block
            if first <= b < end:
                out[b - first].append(c)
    return out
