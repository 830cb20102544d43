"""Prefix reuse in a run (`prefix_cache.enabled`): the prefix caches of the instances, the
routing that reads them, and what a request saves.

What is modelled (kvsim.scenario.prefix_cache holds the cache itself):
- Each decode instance keeps the blocks of the prompts it held, as its decoder holds them
  (bf16 KV, the precision they arrived in: a lossy codec's blocks are reused as decoded),
  in the memory beside the weights that the running requests' caches use too: idle blocks
  are evicted, least recently used first, when an admission needs the room, and at most
  `decode_capacity_gb` are kept. A request's blocks enter the cache once all its streams
  are in and it is admitted (a split-stream request's blocks count once its residual
  arrived) and stay pinned until it finishes.
- A request is routed at its arrival (kv_aware: by the caches then), and its decode
  instance looks its prompt up when the transfer is set up, as the transport's decode node
  does at the request's HELLO: at the prefill's start for the layer-wise policies
  (kvsim.scenario.policy.WITH_PREFILL), at its end for the others. Holding the leading h
  blocks then (pinned from that moment), it is sent the KV of the other tokens only: the
  codec's wire bytes of a cache of context - h x block_tokens tokens (the prefix delta),
  deserialized as such, and its admission asks memory for those tokens and its output only.
- Each prefill instance keeps the blocks it prefilled (at most `prefill_capacity_gb`;
  a block enters when its prefill ends); a request whose leading h' blocks it holds
  prefills the rest after them (TimingModel.prefill_step_s of the new tokens after
  h' x block_tokens cached ones). Its KV still crosses the link unless the decode instance
  holds it: the prefill instance does not fetch from the decode side, nor the reverse.
- With a shared store (`store_capacity_gb` > 0): every prefill writes its full blocks to one
  store (as Mooncake Store does), least recently used evicted first. A request whose
  decode instance lacks blocks the store holds (at the look-up) fetches them (bf16, one
  message per block) over the store's link (`store_gbps`, `store_latency_s`, shared by every
  fetch), from then on; decoding waits for them as for the anchor, and the prefill sends
  the rest only.
  Prefill instances do not fetch from the store (their prefill skips their own blocks only).
- At least one token of each prompt is prefilled and sent (the first token needs the
  last position's forward): a hit covers at most (context - 1) // block_tokens blocks.
The speculative draft on a partial cache is the codec's (the reused prefix, already full,
would only help its acceptance: not modelled).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.scenario.config import PrefixCacheConfig
from kvsim.scenario.prefix_cache import PrefixCache
from kvsim.scenario.workload import Request
from kvsim.sim.nodes import DecodeNode
from kvsim.sim.routing import kv_aware, least_loaded


@dataclass(slots=True)
class Reuse:
    """What one request reuses (blocks of prefix_cache.block_tokens tokens)."""

    decode_hit: int  # leading blocks its decode instance holds (pinned there)
    prefill_hit: int  # leading blocks its prefill instance holds (pinned until its prefill)
    fetched: int = 0  # blocks after decode_hit its decode instance fetches from the store
    # blocks after the hit it gave its decode instance's cache (pinned for it; their bytes
    # are the cache's, no longer its own)
    kept: tuple[int, ...] = ()


class PrefixReuse:
    def __init__(self, cfg: PrefixCacheConfig, routing: str, load_slack: int,
                 block_bytes: float, kv_memory_bytes: float, decode: list[DecodeNode],
                 prefill_nodes: int) -> None:
        self.block_tokens = int(cfg.block_tokens)
        self.block_bytes = float(block_bytes)
        self.kv_aware, self.load_slack = routing == "kv_aware", int(load_slack)
        decode_cap = kv_memory_bytes if cfg.decode_capacity_gb is None else \
            min(kv_memory_bytes, cfg.decode_capacity_gb * 1e9)
        self.decode = decode
        for node in decode:
            node.keep_prefix(PrefixCache(block_bytes, decode_cap))
        prefill_cap = kv_memory_bytes if cfg.prefill_capacity_gb is None else \
            cfg.prefill_capacity_gb * 1e9
        self.prefill = [PrefixCache(block_bytes, prefill_cap)
                        for _ in range(prefill_nodes)] if prefill_cap > 0 else []
        self.store = PrefixCache(block_bytes, cfg.store_capacity_gb * 1e9) \
            if cfg.store_capacity_gb > 0 else None
        # prefilled requests whose blocks enter their prefill cache at their prefill end:
        # seq -> (prefill instance, blocks, its full blocks, leading blocks pinned)
        self._prefilling: dict[int, tuple[int, tuple[int, ...], int, int]] = {}
        self.requests = self.eligible_blocks = 0
        self.decode_hit_blocks = self.prefill_hit_blocks = self.fetched_blocks = 0
        self.wire_bytes_full = self.wire_bytes_sent = 0.0

    def check(self, reqs: list[Request]) -> None:
        """Every request names the blocks of its prompt: ceil(context / block_tokens)."""
        bt = self.block_tokens
        if not any(r.prefix_blocks for r in reqs):
            raise ValueError("prefix_cache.enabled: the workload names no prefix blocks (a "
                             "Mooncake trace's hash_ids, or workload.arrivals_prefix_blocks)")
        for r in reqs:
            want = -(-r.context_tokens // bt)
            if len(r.prefix_blocks) != want:
                raise ValueError(
                    f"request {r.seq}: {len(r.prefix_blocks)} prefix block ids for "
                    f"{r.context_tokens} tokens; blocks of prefix_cache.block_tokens={bt} "
                    f"tokens need {want}")

    def route(self, req: Request, queued: list[int], assigned: list[int],
              p: int, d: int) -> tuple[int, int, Reuse]:
        """At its arrival: the instances the request goes to (kv_aware: by the caches as they
        are now; else p, d as routed) and what its prefill instance holds, pinned."""
        blocks, limit = req.prefix_blocks, (req.context_tokens - 1) // self.block_tokens
        if self.kv_aware:
            d = kv_aware(assigned, [n.prefix.match(blocks, limit)  # type: ignore[union-attr]
                                    for n in self.decode], self.load_slack)
            p = kv_aware(queued, [c.match(blocks, limit) for c in self.prefill],
                         self.load_slack) if self.prefill else least_loaded(queued)
        prefill_hit = 0
        if self.prefill:
            prefill_hit = self.prefill[p].match(blocks, limit)
            self.prefill[p].pin(blocks[:prefill_hit])
        self.requests += 1
        self.eligible_blocks += limit
        self.prefill_hit_blocks += prefill_hit
        return p, d, Reuse(0, prefill_hit)

    def look_up(self, req: Request, d: int, reuse: Reuse) -> None:
        """At its transfer's set-up (when its decode instance learns of it: the transport's
        HELLO): the leading blocks decode instance d holds (reuse.decode_hit) and those after
        them the store holds (reuse.fetched), pinned till it finishes."""
        blocks, limit = req.prefix_blocks, (req.context_tokens - 1) // self.block_tokens
        cache = self.decode[d].prefix
        hit = cache.match(blocks, limit)  # type: ignore[union-attr]
        cache.pin(blocks[:hit])  # type: ignore[union-attr]
        fetched = 0
        if self.store is not None:
            fetched = max(0, self.store.match(blocks, limit) - hit)
            self.store.pin(blocks[hit:hit + fetched])
        reuse.decode_hit, reuse.fetched = hit, fetched
        self.decode_hit_blocks += hit
        self.fetched_blocks += fetched

    def sent_tokens(self, req: Request, reuse: Reuse) -> int:
        return req.context_tokens - (reuse.decode_hit + reuse.fetched) * self.block_tokens

    def wire_bytes(self, full_bytes: float, sent_bytes: float) -> None:
        """A request's codec wire bytes without reuse and as sent."""
        self.wire_bytes_full += full_bytes
        self.wire_bytes_sent += sent_bytes

    def prefill_started(self, req: Request, p: int, reuse: Reuse) -> None:
        if self.prefill or self.store is not None:
            self._prefilling[req.seq] = (p, req.prefix_blocks,
                                         req.context_tokens // self.block_tokens,
                                         reuse.prefill_hit)

    def prefill_ended(self, seq: int) -> None:
        """Its prefill ended: its full blocks enter its prefill instance's cache."""
        entry = self._prefilling.pop(seq, None)
        if entry is None:
            return
        p, blocks, full, hit = entry
        if self.prefill:
            cache = self.prefill[p]
            # the new blocks first, while the reused head is pinned: the head ends up the
            # most recently used, the tail is evicted before it
            cache.insert(blocks[hit:full])
            cache.unpin(blocks[:hit])
        if self.store is not None:  # the prefill writes its blocks to the store, the same way
            held = self.store.match(blocks, full)
            self.store.pin(blocks[:held])
            self.store.insert(blocks[held:full])
            self.store.unpin(blocks[:held])

    def keep(self, req: Request, d: int, reuse: Reuse, now: float) -> None:
        """All its streams are in and it is admitted (now): its full blocks after the hit go
        to its decode instance's cache, pinned for it (reuse.kept); a block the cache got
        meanwhile from another request is shared, and the request's copy of it freed."""
        node = self.decode[d]
        full = req.prefix_blocks[: req.context_tokens // self.block_tokens]
        kept, shared, freed = node.prefix.adopt(  # type: ignore[union-attr]
            full[reuse.decode_hit:])
        reuse.kept = tuple(kept)
        freed += shared * self.block_bytes
        if freed:
            node.admission.release(freed, now, slot=False)

    def release(self, req: Request, d: int, reuse: Reuse) -> None:
        """It finished: the blocks it used go idle (its bytes return by admission)."""
        self.decode[d].prefix.unpin(  # type: ignore[union-attr]
            req.prefix_blocks[: reuse.decode_hit] + reuse.kept)
        if reuse.fetched:
            self.store.unpin(  # type: ignore[union-attr]
                req.prefix_blocks[reuse.decode_hit: reuse.decode_hit + reuse.fetched])

    def row(self) -> dict:
        """The run's reuse figures (blocks of block_tokens tokens; bytes of the codec)."""
        decode = [n.prefix for n in self.decode]
        return {
            "prefix_block_tokens": self.block_tokens,
            "prefix_eligible_blocks": self.eligible_blocks,
            # of the blocks a hit could cover, the share each side held
            "prefix_hit_rate": self.decode_hit_blocks / self.eligible_blocks
            if self.eligible_blocks else 0.0,
            "prefix_prefill_hit_rate": self.prefill_hit_blocks / self.eligible_blocks
            if self.eligible_blocks else 0.0,
            "prefix_bytes_not_sent": self.wire_bytes_full - self.wire_bytes_sent,
            "prefix_bytes_saved_fraction": 1.0 - self.wire_bytes_sent / self.wire_bytes_full
            if self.wire_bytes_full else 0.0,
            "prefix_evicted_blocks": sum(c.evicted_blocks for c in decode),  # type: ignore
            # fetched from the shared store (0 without one): share of the eligible blocks
            "prefix_store_hit_rate": self.fetched_blocks / self.eligible_blocks
            if self.eligible_blocks else 0.0,
            "prefix_store_fetched_bytes": self.fetched_blocks * self.block_bytes,
        }
