"""A block-granular prefix cache of one instance (a decode or prefill instance of the
simulator, a shared store, the emulator's decode node): the KV blocks of prompts it has held, by
block id, kept after their requests end until the room is needed (least recently used
first).

A block is `block_tokens` tokens of one prompt's KV, named by an id that stands for the
block and every token before it (the Mooncake traces' `hash_ids`: equal ids at the same
position mean the same prefix). A request reuses the leading run of its blocks that the
cache holds (`match`); the run stops at the first block missing, as a radix tree's walk
does. Blocks in use by a request are pinned (a count per block) and never evicted; the
others are kept in least-recently-used order, and a request's blocks go back to it deepest
first, so that a prompt's tail is evicted before its head (a radix cache evicts leaves).

Sizes are bytes of the instance's memory per block (`block_bytes`: the bf16 KV of
block_tokens tokens, as the decoder holds it); `capacity_bytes` bounds what the cache holds,
pinned blocks included (a block that cannot get room is not kept).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class PrefixCache:
    __slots__ = ("block_bytes", "capacity_bytes", "_pins", "_idle", "evicted_blocks",
                 "on_evict")

    def __init__(self, block_bytes: float, capacity_bytes: float,
                 on_evict: Callable[[int], None] | None = None) -> None:
        if not block_bytes > 0:
            raise ValueError(f"prefix cache block_bytes must be > 0, got {block_bytes!r}")
        if not capacity_bytes >= 0:
            raise ValueError(f"prefix cache capacity_bytes must be >= 0, got "
                             f"{capacity_bytes!r}")
        self.block_bytes = float(block_bytes)
        self.capacity_bytes = float(capacity_bytes)
        self._pins: dict[int, int] = {}  # every block held -> requests using it (0: idle)
        self._idle: OrderedDict[int, None] = OrderedDict()  # unpinned blocks, LRU first
        self.evicted_blocks = 0
        self.on_evict = on_evict  # called with each evicted block (what it held goes too)

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, block: int) -> bool:
        return block in self._pins

    @property
    def held_bytes(self) -> float:
        return len(self._pins) * self.block_bytes

    @property
    def idle_bytes(self) -> float:
        """Bytes evict() could free now (idle blocks)."""
        return len(self._idle) * self.block_bytes

    def match(self, blocks: Sequence[int], limit: int) -> int:
        """How many of blocks[:limit] lead the prompt and are held (the run stops at the
        first one missing)."""
        pins = self._pins
        n = 0
        for block in blocks[:limit]:
            if block not in pins:
                break
            n += 1
        return n

    def pin(self, blocks: Sequence[int]) -> None:
        """Blocks (all held) are in use by one more request: not evictable until unpinned."""
        pins, idle = self._pins, self._idle
        for block in blocks:
            count = pins[block]
            if count == 0:
                del idle[block]
            pins[block] = count + 1

    def unpin(self, blocks: Sequence[int]) -> None:
        """A request is done with blocks (pinned by it): the last user makes a block idle,
        the most recently used; deepest first, so the head of a prompt outlives its tail."""
        pins, idle = self._pins, self._idle
        for block in reversed(blocks):
            count = pins[block] - 1
            pins[block] = count
            if count == 0:
                idle[block] = None

    def insert(self, blocks: Sequence[int]) -> tuple[list[int], float]:
        """Keep the blocks not held yet, idle, in order, evicting idle blocks for room (a
        block that finds none is not kept, nor are the blocks after it: the cache keeps
        prefixes); the kept ones are the most recently used, head last. Returns (the blocks
        kept, bytes freed by evictions)."""
        pins = self._pins
        kept: list[int] = []
        freed = 0.0
        for block in blocks:
            if block in pins:
                continue
            room, evicted = self._room()
            freed += evicted
            if not room:
                break
            pins[block] = 0
            kept.append(block)
        for block in reversed(kept):
            self._idle[block] = None
        return kept, freed

    def adopt(self, blocks: Sequence[int]) -> tuple[list[int], int, float]:
        """A request holds `blocks` (a run of its prompt, in order) and gives them to the
        cache: a block held already is pinned for it (its own copy is redundant), one not
        held is kept pinned if room can be made (evicting idle blocks), and the run stops at
        the first that finds none (the cache keeps prefixes). Returns (the blocks now pinned
        for it, in order; how many of them were held already; bytes freed by evictions)."""
        pins, idle = self._pins, self._idle
        adopted: list[int] = []
        shared = 0
        freed = 0.0
        for block in blocks:
            count = pins.get(block)
            if count is not None:
                if count == 0:
                    del idle[block]
                pins[block] = count + 1
                shared += 1
            else:
                room, evicted = self._room()
                freed += evicted
                if not room:
                    break
                pins[block] = 1
            adopted.append(block)
        return adopted, shared, freed

    def _room(self) -> tuple[bool, float]:
        """Room for one more block, idle ones evicted for it if need be: (whether there is,
        bytes freed)."""
        over = self.held_bytes + self.block_bytes - self.capacity_bytes
        if over <= 0:
            return True, 0.0
        freed = self.evict(over)
        return self.held_bytes + self.block_bytes <= self.capacity_bytes, freed

    def evict(self, needed_bytes: float) -> float:
        """Drop idle blocks, least recently used first, until `needed_bytes` are freed or
        none is left; returns the bytes freed."""
        freed = 0.0
        pins, idle = self._pins, self._idle
        while freed < needed_bytes and idle:
            block, _ = idle.popitem(last=False)
            del pins[block]
            freed += self.block_bytes
            self.evicted_blocks += 1
            if self.on_evict is not None:
                self.on_evict(block)
        return freed
