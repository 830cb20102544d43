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
added, everyone padded to the longest (one copy of the batch's caches per change). A
verification's rejected drafts are masked out of its row (`crop`). A member alone in the
batch steps on its own cache object with no mask, cropped for real: exactly the batch-1
forwards of an unbatched decode loop.

Greedy tokens from a padded batched forward equal the member's unbatched ones up to float
rounding (the same sums in another order), so near-ties may break differently; the tests
hold the logits to 1e-4 of the unbatched forward's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

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
        self.rows: list[_Row] = []
        self.cache: Any = None  # batched DynamicCache, or a lone member's own cache
        self.valid: torch.Tensor | None = None  # [members, S] bool; None: all valid

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def arrange(self, works: dict[Hashable, ModelWork]) -> None:
        """Rows for exactly `works`' members on their posted caches, in post order."""
        kept = [r for r in self.rows if r.member in works and works[r.member].cache is r.source]
        if len(kept) == len(self.rows) == len(works):
            return
        held = {r.member for r in kept}
        fresh = [_Row(m, w.cache) for m, w in works.items() if m not in held]
        if not kept and len(fresh) == 1:  # alone on its own cache: batch-1 forwards
            self.rows, self.cache, self.valid = fresh, fresh[0].source, None
            return
        self._rebuild(kept, fresh)

    def _rebuild(self, kept: list[_Row], fresh: list[_Row]) -> None:
        """One batched cache of the kept rows (valid entries packed left) and the fresh
        members' caches, each row padded to the longest."""
        from transformers import DynamicCache

        index = {id(r): i for i, r in enumerate(self.rows)}
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # [row][layer] (k, v)
        if kept:
            old = self._layers()
            valid = self._valid_now()
            for r in kept:
                i = index[id(r)]
                at = valid[i].nonzero().squeeze(1)  # [entries] slots of the row's cache
                parts.append([(k[i:i + 1, :, at], v[i:i + 1, :, at]) for k, v in old])
        for r in fresh:
            parts.append([(layer.keys, layer.values) for layer in r.source.layers])
        lengths = [int(p[0][0].shape[2]) for p in parts]
        slots = max(lengths)
        data = []
        for layer in range(len(parts[0])):
            data.append(tuple(torch.cat([_pad_entries(p[layer][kv], slots) for p in parts])
                              for kv in (0, 1)))
        self.rows = kept + fresh
        self.cache = DynamicCache(data, config=self.model.config)
        device = data[0][0].device
        self.valid = None if len(parts) == 1 else \
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
        device = next(self.model.parameters()).device
        if self.valid is None:  # one row, every entry its own
            logits = self.model(input_ids=torch.tensor(ids, device=device),
                                past_key_values=self.cache, use_cache=True).logits
            return {self.rows[0].member: logits[0]}
        widest = max(len(x) for x in ids)
        fed = torch.tensor([x + [x[-1]] * (widest - len(x)) for x in ids], device=device)
        new_valid = torch.arange(widest, device=device)[None] < \
            torch.tensor([len(x) for x in ids], device=device)[:, None]  # [members, widest]
        lengths = self.valid.sum(dim=1)  # [members] each request's own entries
        positions = lengths[:, None] + torch.arange(widest, device=device)[None]
        mask = torch.cat([self.valid, new_valid], dim=1)
        logits = self.model(input_ids=fed, attention_mask=mask.long(), position_ids=positions,
                            past_key_values=self.cache, use_cache=True).logits
        self.valid = mask
        return {r.member: logits[i, :len(ids[i])] for i, r in enumerate(self.rows)}


def _pad_entries(t: torch.Tensor, slots: int) -> torch.Tensor:
    """[1, kv_heads, entries, head_dim] -> [1, kv_heads, slots, head_dim] (zeros after)."""
    return torch.nn.functional.pad(t, (0, 0, 0, slots - int(t.shape[2])))


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
        self._rows = _Rows(model)
        self._results: dict[Hashable, list[int]] = {}
        self._crops: list[tuple[Hashable, int]] = []  # asked between steps, done before one

    def forward(self, member: Hashable, cache: Any, token_ids: list[int],
                cancelled: Callable[[], str] = str) -> list[int] | None:
        """Feed `token_ids` on `cache` in the next step: the greedy token after each, or
        None when cancelled() says the request was dropped first."""
        if not token_ids:
            raise ValueError("a step member feeds at least one token")
        work = ModelWork(cache, tuple(int(t) for t in token_ids))
        if not self._post(member, work, cancelled):
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
        for member, keep in crops:  # rows as the last step left them: its member is there
            self._rows.crop(member, keep)
        self._rows.arrange(works)
        logits = self._rows.forward(works)
        # greedy tokens; tolist() waits for the device
        tokens = {m: x.argmax(dim=-1).tolist() for m, x in logits.items()}
        with self._cond:
            self._results.update(tokens)

    def _idle(self) -> None:
        self._rows = _Rows(self.model)  # the batched cache goes with its members
        self._results.clear()


__all__ = ["ModelBatch", "ModelWork", "crop_cache"]
