"""A real-decode continuous batch: one forward of the model per step over every member.

Each request's `RealDecodeLoop` posts the tokens it feeds this step (one while it drafts or
decodes, first token + n drafts when it verifies) with the cache it feeds them on
(`ModelWork`); the step (kvsim.transport.decode_batch.ContinuousBatch) runs ONE forward of
the model over all members and hands each its greedy tokens, so a decode node's concurrent
requests share a forward per step as a serving engine's continuous batch does, and the
step's time is the batched forward's, measured, not modelled.

The batch keeps the members' caches as one batched transformers DynamicCache
(`_Rows`), member i a row of it:

  keys / values  [members, kv_heads, S, head_dim] per layer; a row's entries are its
                 request's cache in order, with gaps (masked) where it holds fewer than S
  valid          [members, S] bool: which entries of each row are the request's
  next position  valid.sum(row): the request's own length, where its next token goes
                 (RoPE positions are the request's own, whatever slot an entry sits in)

A step feeds ids [members, n_max] (a member with fewer tokens padded, those slots masked),
position ids from each member's own length, and the attention mask [members, S + n_max]
(the valid entries plus the step's own); the forward appends n_max entries to every row.
Membership changes (a member joins with a fresh cache, leaves, or comes back with another
cache: drafting ends on the anchor-only cache, verification begins on the full one) rebuild
the rows between steps: each kept row's valid entries packed to the left, the new ones
added, everyone padded to the longest, layer by layer into the new batch's tensors (the old
batch and the new one are both alive while it is made, once per change; each step's
forward also extends every row by concatenation, as a transformers cache always does). A
verification's rejected drafts are masked out of its row (`crop`). A member that joins an
empty batch steps on its own cache object with no mask, cropped for real: exactly the
batch-1 forwards of an unbatched decode loop, for as long as it stays alone.

A member whose row went while it still decoded on that cache (the stall guard dropped it,
kvsim.transport.decode_batch) is refused when it posts that cache again: its row held
entries its own cache object lacks.

Greedy tokens from a padded batched forward equal the member's unbatched ones up to float
rounding (the same sums in another order), so near-ties may break differently; the tests
hold the logits to 1e-4 of the unbatched forward's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from kvsim.model.forward import lm_forward
from kvsim.transport.decode_batch import ContinuousBatch


@dataclass(frozen=True)
class ModelWork:
    """One member's post: the cache it decodes on (a transformers DynamicCache of batch 1,
    as loaded: its identity says which cache the member is on) and the token ids it feeds
    this step."""

    cache: Any
    token_ids: tuple[int, ...]


@dataclass
class _Row:
    member: Hashable
    source: Any  # the member's own cache object the row began from (identity only)


class _Rows:
    """The batched cache and its members (see the module docstring); used by the stepping
    thread alone."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device  # where the fed ids go
        self.rows: list[_Row] = []
        self.cache: Any = None  # batched DynamicCache, or a lone member's own cache
        self.valid: torch.Tensor | None = None  # [members, S] bool; None: all valid

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def arrange(self, works: dict[Hashable, ModelWork]) -> list[_Row]:
        """Rows for exactly `works`' members on their posted caches, in post order; returns
        the rows that went."""
        kept = [r for r in self.rows if r.member in works and works[r.member].cache is r.source]
        if len(kept) == len(self.rows) == len(works):
            return []
        gone = [r for r in self.rows if r not in kept]
        held = {r.member for r in kept}
        fresh = [_Row(m, w.cache) for m, w in works.items() if m not in held]
        if not kept and len(fresh) == 1:  # alone on its own cache: batch-1 forwards
            self.rows, self.cache, self.valid = fresh, fresh[0].source, None
            return gone
        self._rebuild(kept, fresh)
        return gone

    def _rebuild(self, kept: list[_Row], fresh: list[_Row]) -> None:
        """One batched cache of the kept rows (valid entries packed left) and the fresh
        members' caches, each row padded to the longest, made layer by layer (the old
        batch's layers freed as they are copied, unless the old batch is a lone member's
        own cache)."""
        from transformers import DynamicCache

        old = self.cache
        owned = old is not None and all(old is not r.source for r in self.rows)
        index = {id(r): i for i, r in enumerate(self.rows)}
        valid = self._valid_now() if kept else None
        # kept rows: (their index in the old batch, their valid slots [entries])
        picks = [(index[id(r)], valid[index[id(r)]].nonzero().squeeze(1)) for r in kept] \
            if valid is not None else []
        lengths = [int(at.numel()) for _, at in picks] + \
            [int(r.source.get_seq_length()) for r in fresh]
        slots = max(lengths)
        first = old if kept else fresh[0].source
        new = DynamicCache(config=self.model.config)
        for layer in range(len(first.layers)):
            pair = []
            for kv in ("keys", "values"):
                like = getattr(first.layers[layer], kv)  # [rows, kv_heads, entries, head_dim]
                out = like.new_zeros((len(lengths), like.shape[1], slots, like.shape[3]))
                for j, (i, at) in enumerate(picks):
                    out[j, :, :at.numel()] = getattr(old.layers[layer], kv)[i, :, at]
                for j, r in enumerate(fresh, start=len(picks)):
                    t = getattr(r.source.layers[layer], kv)  # [1, kv_heads, entries, head_dim]
                    out[j, :, :t.shape[2]] = t[0]
                pair.append(out)
            new.layers[layer].update(*pair)  # (a layer's first update copies it in)
            del pair
            if owned:  # the old batch's layer is copied: free it now
                old.layers[layer].keys = old.layers[layer].values = None
        self.rows, self.cache = kept + fresh, new
        device = new.layers[0].keys.device
        self.valid = None if len(lengths) == 1 else \
            torch.arange(slots, device=device)[None] < torch.tensor(lengths, device=device)[:, None]

    def _valid_now(self) -> torch.Tensor:
        if self.valid is not None:
            return self.valid
        slots = int(self.cache.get_seq_length())
        return torch.ones((len(self.rows), slots), dtype=torch.bool,
                          device=self.cache.layers[0].keys.device)

    def crop(self, member: Hashable, keep: int) -> None:
        """The member's request keeps its first `keep` entries."""
        i = next((i for i, r in enumerate(self.rows) if r.member == member), None)
        if i is None:
            raise RuntimeError(f"crop of {member!r}, which has no row in the batch")
        if len(self.rows) == 1 and self.valid is None:  # alone: a real crop
            crop_cache(self.cache, keep)
            return
        valid = self._valid_now()
        at = valid[i].nonzero().squeeze(1)
        if keep > at.numel():
            raise ValueError(f"cannot crop a {at.numel()}-entry request to {keep}")
        valid[i, at[keep:]] = False
        self.valid = valid

    @torch.no_grad()
    def forward(self, works: dict[Hashable, ModelWork]) -> dict[Hashable, torch.Tensor]:
        """One forward over every row (arranged for `works`): each member's logits
        [its fed ids, vocab]."""
        ids = [list(works[r.member].token_ids) for r in self.rows]
        device = self.device
        if self.valid is None:  # one row, every entry its own
            logits = lm_forward(self.model, torch.tensor(ids, device=device), self.cache).logits
            return {self.rows[0].member: logits[0]}
        widest = max(len(x) for x in ids)
        fed = torch.tensor([x + [x[-1]] * (widest - len(x)) for x in ids], device=device)
        new_valid = torch.arange(widest, device=device)[None] < \
            torch.tensor([len(x) for x in ids], device=device)[:, None]  # [members, widest]
        lengths = self.valid.sum(dim=1)  # [members] each request's own entries
        positions = lengths[:, None] + torch.arange(widest, device=device)[None]
        mask = torch.cat([self.valid, new_valid], dim=1)
        logits = lm_forward(self.model, fed, self.cache, attention_mask=mask.long(),
                            position_ids=positions).logits
        self.valid = mask
        return {r.member: logits[i, :len(ids[i])] for i, r in enumerate(self.rows)}


def crop_cache(cache: Any, keep: int) -> None:
    """Drop a DynamicCache's entries past the first `keep` (every layer). transformers 5
    takes a negative count of entries to remove; 4.x a negative count too (or the new
    absolute length), so the negative form works with both."""
    have = int(cache.get_seq_length())
    if keep > have:
        raise ValueError(f"cannot crop a {have}-entry cache to {keep}")
    if keep < have:
        cache.crop(-(have - keep))
    if int(cache.get_seq_length()) != keep:
        raise RuntimeError(f"cache crop kept {cache.get_seq_length()} entries, wanted {keep}")


class ModelBatch(ContinuousBatch):
    """See the module docstring. model: a transformers causal LM (eval mode); the other
    arguments as ContinuousBatch's."""

    def __init__(self, model: Any, max_batch: int, **batch_kw) -> None:
        super().__init__(max_batch, **batch_kw)
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self._rows = _Rows(model)
        self._results: dict[Hashable, list[int]] = {}
        self._crops: list[tuple[Hashable, int]] = []  # asked between steps, done before one
        # rows that went, by member: the cache each was on (weakly: a cache its decode
        # loop let go of is not kept); that member posting that cache again is refused
        self._dropped: dict[Hashable, weakref.ref] = {}

    def forward(self, member: Hashable, cache: Any, token_ids: list[int],
                cancelled: Callable[[], str] = str) -> list[int] | None:
        """Feed `token_ids` on `cache` in the next step: the greedy token after each, or
        None when cancelled() says the request was dropped first."""
        if not token_ids:
            raise ValueError("a step member feeds at least one token")
        ids = tuple(int(t) for t in token_ids)
        if not all(0 <= t < self.vocab_size for t in ids):  # (it would fail every member)
            raise ValueError(f"token ids must be in 0..{self.vocab_size - 1}, got {list(ids)}")
        with self._cond:
            gone = self._dropped.pop(member, None)
            if gone is not None and gone() is cache:
                raise RuntimeError(
                    f"{member!r} was dropped from the batch while it decoded on this cache "
                    f"(its row held entries the cache lacks): it cannot step on it again")
        if not self._post(member, ModelWork(cache, ids), cancelled):
            return None
        with self._cond:
            return self._results.pop(member)

    def crop(self, member: Hashable, keep: int) -> None:
        """The member's request keeps its first `keep` cache entries (its verification's
        rejected drafts go), from its next step on."""
        with self._cond:
            self._crops.append((member, int(keep)))

    def pause(self, member: Hashable) -> None:
        with self._cond:
            super().pause(member)
            self._results.pop(member, None)
            self._crops = [c for c in self._crops if c[0] != member]

    def _begin_step(self, works: dict[Hashable, Any]) -> tuple[dict, list]:
        crops, self._crops = self._crops, []
        return works, crops

    def _run_step(self, plan: tuple[dict, list]) -> None:
        works, crops = plan
        held = {r.member for r in self._rows.rows}
        for member, keep in crops:
            if member in held:  # (a member whose row went has nothing to crop)
                self._rows.crop(member, keep)
            else:
                self.log(f"decode batch: a crop for {member!r}, which has no row; skipped")
        gone = self._rows.arrange(works)
        logits = self._rows.forward(works)
        # greedy tokens; tolist() waits for the device
        tokens = {m: x.argmax(dim=-1).tolist() for m, x in logits.items()}
        with self._cond:
            # only for members still in the step (one dropped meanwhile takes none)
            self._results.update({m: t for m, t in tokens.items() if m in self._running})
            self._remember(gone)

    def _remember(self, rows: list[_Row]) -> None:
        """Note the rows that went (lock held); forget notes on caches let go of."""
        for r in rows:
            self._dropped[r.member] = weakref.ref(r.source)
        for m in [m for m, ref in self._dropped.items() if ref() is None]:
            del self._dropped[m]

    def _idle(self) -> None:
        self._remember(self._rows.rows)
        self._rows = _Rows(self.model)  # the batched cache goes with its members
        self._results.clear()
        self._crops.clear()


__all__ = ["ModelBatch", "ModelWork", "crop_cache"]
