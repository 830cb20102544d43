"""The decode side's decode loop: decode one request on the cache the receiver assembles.

The receiver exposes the request's cache as a `CacheView` (streams arrive in order; stream i
is useful once streams 0..i are complete). A decode loop turns it into tokens and a
timeline that the simulator's closed form (`kvsim.scenario.speculative`) can be set against:

  non-speculative  wait for every stream, dequantize, greedy-decode `output_tokens` tokens
                   starting from `first_token` (the prefill node's token): token j is valid
                   and committed when step j finishes.
  speculative      wait for stream 0. If every stream is complete by then: as above. Else
                   dequantize the anchor and draft greedily, one token per step, while the
                   cache is incomplete and fewer than `cap_tokens` were drafted (checked
                   before each step; a step in progress finishes); at the cap, wait. Then
                   dequantize every stream, verify [first_token, d_1..d_n] in ONE forward
                   pass on the full cache, accept the longest matching prefix (a tokens),
                   take the target's token at the first divergence (or the bonus) as token
                   a+1, crop the cache to context + 1 + a entries and decode on.
Valid-token time (the seeds' TTKT, as the simulator counts it): an accepted draft when it
was drafted, the correction at the end of verification, later tokens when decoded.

Two loops share that control flow (`_DecodeLoop.run`) and differ only in their steps:
`RealDecodeLoop` runs a transformers causal LM on this machine (greedy: the committed
tokens equal plain greedy decoding on the full cache, token for token); `TimingDecodeLoop`
sleeps the modelled step times of a `TimingModel` (for models too large for this machine)
and draws the accepted count from an `AcceptanceModel`.

Every time in a `DecodeResult` is a raw reading of the loop's clock (s); nothing is divided
by a time scale here.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from kvsim.core.checks import check_number
from kvsim.kv.capture import CacheFromLayers, kv_to_cache
from kvsim.kv.draft_verify import accept_greedy
from kvsim.model.forward import lm_forward
from kvsim.scenario.acceptance import AcceptanceModel
from kvsim.scenario.speculative import busy_share_overhead_s
from kvsim.scenario.timing_model import TimingModel
from kvsim.transport.decode_batch import ContinuousBatch, StepBatch, StepWork
from kvsim.transport.model_batch import ModelBatch, crop_cache

Clock = Callable[[], float]
Span = tuple[str, float, float]  # (name or kind, t0 s, t1 s) on the loop's clock


@runtime_checkable
class CacheView(Protocol):
    """What the receiver exposes to a decode loop for one request (thread-safe)."""

    num_streams: int

    def wait_streams(self, n: int, timeout_s: float) -> bool:
        """Block until streams 0..n-1 are complete; False on timeout."""
        ...

    def streams_ready(self) -> int:
        """Non-blocking: number of leading complete streams."""
        ...

    def kv(self, n: int) -> torch.Tensor:
        """Dequantized [layers, 2, kv_heads, tokens, head_dim] from the first n streams."""
        ...


class DecodeCancelled(RuntimeError):
    """The request was dropped (its view says why) while the loop decoded."""


@dataclass
class DecodeResult:
    mode: str  # "real" | "timing"
    drafted_t: list[float]  # [output_tokens] valid-token time of tokens 1..K (s, clock)
    committed_t: list[float]  # [output_tokens] time each token was verified / decoded
    token_ids: list[int]  # real: the committed tokens; timing: []
    proposed: int  # drafted tokens sent to verification (0: no verification)
    accepted: int  # longest accepted prefix of them
    start_t: float  # decoding or drafting began
    full_t: float  # full cache (all streams) dequantized and usable
    verify_start_t: float  # nan when no verification
    verify_end_t: float  # nan when no verification
    tpot_s: float  # mean decode step on the full cache: measured (real), modelled (timing)
    segments: list[Span] = field(default_factory=list)  # kinds as kvsim.scenario.speculative
    events: list[Span] = field(default_factory=list)  # extra trace spans
    draft_tpot_s: float = math.nan  # mean draft step: measured (real), modelled (timing)
    verify_s: float = math.nan  # verification pass: measured (real), modelled (timing)
    streams: int = 0  # streams of the view
    context_tokens: int = 0  # cache entries before decoding (the prompt)
    # [proposed] end of every draft step, accepted or rejected (s, clock); drafted_t holds
    # only the accepted drafts' (a rejected draft's token never stands)
    draft_step_t: list[float] = field(default_factory=list)


def _streams_name(n: int) -> str:
    return "stream 0" if n == 1 else f"streams 0-{n - 1}"


def _wait(view: CacheView, n: int, timeout_s: float) -> None:
    """Block until streams 0..n-1 are complete, or raise TimeoutError naming the first
    incomplete stream."""
    if not view.wait_streams(n, timeout_s):
        have = int(view.streams_ready())
        raise TimeoutError(f"decode loop: stream {have} of {view.num_streams} still incomplete "
                           f"after {timeout_s:g} s (waiting for {_streams_name(n)})")


class _DecodeLoop(ABC):
    """The shared control flow; subclasses provide the steps (`_load`, `_step`, `_verify`).

    A loop on a decode instance's batch (kvsim.transport.decode_batch) holds one of its
    slots from its first step to its end (`slots`: a batch of max_batch > 1 it steps with,
    or an instance of one slot whose lone member steps by itself), is out of the batch's
    steps while it waits or loads (`batch.pause`), and calls `on_done` once when it ends."""

    mode: str
    first_token: int
    clock: Clock
    batch: ContinuousBatch | None = None  # the batch whose steps this loop's steps are
    slots: ContinuousBatch | None = None  # whose slot it holds (the batch, or one slot)
    _has_slot = False
    # (the phase's start t, clock s once its slot was held): steps are measured from there
    _slot_at: tuple[float, float] | None = None
    _on_done: Callable[[], None] | None = None

    def _on_batch(self, batch: ContinuousBatch | None, slots: ContinuousBatch | None,
                  on_done: Callable[[], None] | None) -> None:
        self.batch = batch
        self.slots = batch if batch is not None else slots
        self._on_done = on_done

    # ---- steps ------------------------------------------------------------------------
    @abstractmethod
    def _load(self, view: CacheView, n: int) -> Any:
        """Dequantize the first n streams and build a cache to decode on."""

    @abstractmethod
    def _step(self, cache: Any, token: int, drafting: bool) -> int:
        """One decode step feeding `token`; returns the next token (timing: -1)."""

    @abstractmethod
    def _verify(self, cache: Any, drafts: list[int]) -> tuple[int, int]:
        """One pass of [first_token, *drafts] on the full cache; leaves it holding
        context + 1 + accepted entries. Returns (accepted, token accepted + 1)."""

    def _begin_phase(self, t: float) -> None:
        """Back-to-back steps start at clock time `t` (the timing loop plans sleeps from
        it); the first ones take a place in the batch."""
        if self.slots is not None and not self._has_slot:
            if not self.slots.take_slot(self._cancelled):  # dropped while it queued
                raise DecodeCancelled(self._cancelled())
            self._has_slot = True
            self._slot_at = (t, self.clock())

    def _end_phase(self) -> None:
        """Back-to-back steps are over for now (drafting stopped: the loop waits or loads)."""
        if self.batch is not None:
            self.batch.pause(self)

    def _leave(self) -> None:
        """The run ended, whatever happened: out of the batch, its slot given back."""
        self._end_phase()
        if self._has_slot and self.slots is not None:
            self._has_slot = False
            self.slots.give_slot()
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()

    def _steps_from(self, t: float, drafting: bool = False) -> float:
        """Where a phase's mean step is measured from: `t`, where it began, or once it held
        its slot where it waited for one (a batched timing loop: its first step's post,
        after its slot and the fresh cache's extra), as the simulator's batch starts its
        member's clock at admission."""
        if self._slot_at is not None and self._slot_at[0] == t:
            return self._slot_at[1]
        return t

    @abstractmethod
    def _context_tokens(self, cache: Any) -> int:
        """Entries in a freshly loaded cache."""

    def _tpot_report(self, measured_s: float) -> float:
        return measured_s

    def _draft_tpot_report(self, measured_s: float) -> float:
        return measured_s

    def _verify_report(self, measured_s: float, proposed: int) -> float:
        return measured_s

    # ---- control flow -----------------------------------------------------------------
    def run(self, view: CacheView, speculative: bool, output_tokens: int, cap_tokens: int,
            timeout_s: float) -> DecodeResult:
        """Decode `output_tokens` tokens (tokens 1..K after first_token) on `view`.

        timeout_s: the longest any one wait for streams may block (TimeoutError after).
        Times are raw clock readings (s); a caller that slowed time down divides them."""
        try:
            return self._run(view, speculative, output_tokens, cap_tokens, timeout_s)
        finally:
            self._leave()

    def _run(self, view: CacheView, speculative: bool, output_tokens: int, cap_tokens: int,
             timeout_s: float) -> DecodeResult:
        if int(output_tokens) < 1:
            raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
        if int(cap_tokens) < 0:
            raise ValueError(f"cap_tokens must be >= 0, got {cap_tokens}")
        check_number("timeout_s", timeout_s)
        # a view that can be cancelled (the receiver's Assembly: cancelled() -> why) stops
        # the loop between steps
        self._cancelled: Callable[[], str] = getattr(view, "cancelled", lambda: "")
        n_streams = int(view.num_streams)
        if n_streams < 1:
            raise ValueError(f"the cache view has {n_streams} streams")
        t_call = self.clock()
        if not speculative or n_streams == 1:
            return self._plain(view, int(output_tokens), timeout_s, t_call)
        _wait(view, 1, timeout_s)
        t_anchor = self.clock()  # stream 0 complete
        events: list[Span] = [("wait stream 0", t_call, t_anchor)]
        if view.streams_ready() >= n_streams:  # the anchor brought nothing: plain decoding
            return self._plain(view, int(output_tokens), timeout_s, t_anchor, events=events)
        if int(cap_tokens) == 0:  # nothing to draft: wait for the rest (simulator: 'wait')
            return self._plain(view, int(output_tokens), timeout_s, t_anchor, events=events,
                               start_t=t_anchor, segments=[], wait_from=t_anchor)
        return self._speculative(view, int(output_tokens), int(cap_tokens), timeout_s,
                                 t_anchor, events)

    def _decode_on(self, cache: Any, token: int, tokens: list[int], times: list[float],
                   output_tokens: int) -> None:
        """Decode on the full cache until `output_tokens` tokens; token: the last one."""
        while len(times) < output_tokens:
            self._check_cancelled()
            token = self._step(cache, token, drafting=False)
            tokens.append(token)
            times.append(self.clock())

    def _plain(self, view: CacheView, output_tokens: int, timeout_s: float, t_wait0: float,
               events: list[Span] | None = None, start_t: float | None = None,
               segments: list[Span] | None = None, wait_from: float | None = None
               ) -> DecodeResult:
        """Every stream, then plain greedy decoding. start_t / segments / wait_from: set by
        the speculative path when it falls back (anchor time, spans so far, wait origin)."""
        n = int(view.num_streams)
        events = list(events or [])
        segments = list(segments or [])
        _wait(view, n, timeout_s)
        t_ready = self.clock()
        events.append((f"wait {_streams_name(n)}", t_wait0, t_ready))
        if wait_from is not None:
            segments.append(("wait", wait_from, t_ready))
        cache = self._load(view, n)
        full_t = self.clock()
        segments.append(("dequantize", t_ready, full_t))
        events.append((f"dequantize {_streams_name(n)}", t_ready, full_t))
        context = self._context_tokens(cache)
        self._begin_phase(full_t)
        tokens: list[int] = []
        times: list[float] = []
        self._decode_on(cache, self.first_token, tokens, times, output_tokens)
        segments.append(("decode", full_t, times[-1]))
        return DecodeResult(
            self.mode, list(times), list(times), self._ids(tokens), 0, 0,
            full_t if start_t is None else start_t, full_t, math.nan, math.nan,
            self._tpot_report((times[-1] - self._steps_from(full_t)) / len(times)), segments,
            events,
            streams=n, context_tokens=context)

    def _speculative(self, view: CacheView, output_tokens: int, cap_tokens: int,
                     timeout_s: float, t_anchor: float, events: list[Span]) -> DecodeResult:
        n = int(view.num_streams)
        draft_cache = self._load(view, 1)
        start_t = self.clock()  # anchor dequantized: drafting begins
        segments: list[Span] = [("dequantize", t_anchor, start_t)]
        events.append(("dequantize stream 0", t_anchor, start_t))
        self._begin_phase(start_t)
        drafts: list[int] = []
        draft_t: list[float] = []  # [proposed] end of each draft step (s)
        token = self.first_token
        while len(drafts) < cap_tokens and view.streams_ready() < n:
            self._check_cancelled()
            token = self._step(draft_cache, token, drafting=True)
            drafts.append(token)
            draft_t.append(self.clock())
        self._end_phase()
        del draft_cache  # the anchor-only cache is never used again
        if not drafts:  # the rest completed while the anchor was dequantized
            return self._plain(view, output_tokens, timeout_s, start_t, events=events,
                               start_t=start_t, segments=segments)
        draft_end = draft_t[-1]
        t_wait = self.clock()
        waited = view.streams_ready() < n  # the cap was reached first
        if waited:
            _wait(view, n, timeout_s)
        t_ready = self.clock()
        if waited:
            events.append((f"wait streams 1-{n - 1}", t_wait, t_ready))
        full = self._load(view, n)
        full_t = self.clock()
        events.append((f"dequantize {_streams_name(n)}", t_ready, full_t))
        context = self._context_tokens(full)
        self._begin_phase(full_t)
        accepted, token = self._verify(full, drafts)
        v_end = self.clock()
        if not 0 <= accepted <= len(drafts):
            raise RuntimeError(f"verification accepted {accepted} of {len(drafts)} drafts")
        t_acc = draft_t[accepted - 1] if accepted else start_t
        segments += [("draft_accepted", start_t, t_acc), ("draft_rejected", t_acc, draft_end)]
        if waited:
            segments.append(("wait", draft_end, t_ready))
        segments += [("dequantize", t_ready, full_t), ("verify", full_t, v_end)]
        tokens = drafts[:accepted] + [token]
        drafted_t = draft_t[:accepted] + [v_end]
        committed_t = [v_end] * (accepted + 1)
        self._decode_on(full, token, tokens, committed_t, output_tokens)
        steps = len(committed_t) - (accepted + 1)  # decode steps on the full cache
        drafted_t += committed_t[accepted + 1:]
        if steps > 0:
            segments.append(("decode", v_end, committed_t[-1]))
        k = output_tokens
        tpot = (committed_t[-1] - v_end) / steps if steps > 0 else math.nan
        return DecodeResult(
            self.mode, drafted_t[:k], committed_t[:k], self._ids(tokens[:k]), len(drafts),
            accepted, start_t, full_t, full_t, v_end, self._tpot_report(tpot), segments,
            events, self._draft_tpot_report(
                (draft_end - self._steps_from(start_t, drafting=True)) / len(drafts)),
            self._verify_report(v_end - full_t, len(drafts)), n, context, list(draft_t))

    def _check_cancelled(self) -> None:
        why = getattr(self, "_cancelled", str)()
        if why:
            raise DecodeCancelled(why)

    def _ids(self, tokens: list[int]) -> list[int]:
        return list(tokens) if self.mode == "real" else []


class RealDecodeLoop(_DecodeLoop):
    """Greedy decoding with a real transformers causal LM on its own device.

    first_token: the token the prefill node generated (fed by decode step 1). The committed
    tokens equal plain greedy decoding on the view's full cache (the verification pass
    scores every draft on it), up to ties broken differently by batched vs one-token
    forwards. Alone, each step is a batch-1 forward of this loop's own; with `batch` (a
    decode instance's ModelBatch, kvsim.transport.model_batch) each step is this request's
    share of the instance's batched forward, and with `slots` instead (an instance of one
    slot) the request waits for that slot before its first step and holds it to its end."""

    mode = "real"

    def __init__(self, model: Any, first_token: int, clock: Clock = time.perf_counter,
                 batch: ModelBatch | None = None, slots: ContinuousBatch | None = None,
                 on_done: Callable[[], None] | None = None) -> None:
        self.model = model
        self.first_token = int(first_token)
        self.clock = clock
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.model_batch = batch
        self._on_batch(batch, slots, on_done)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _ids_tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, tokens]

    def cache_builder(self) -> CacheFromLayers:
        """A cache of this model filled layer by layer: a view that dequantizes on arrival
        builds the decoder's caches with these (then `_load` only takes them)."""
        return CacheFromLayers(self.model.config, self.dtype, self.device)

    @torch.no_grad()
    def _load(self, view: CacheView, n: int) -> Any:
        self._end_phase()  # loading takes no part in the batch's steps
        built = getattr(view, "built_cache", None)
        cache = built(n) if built is not None else None
        if cache is None:
            kv = view.kv(n)  # [layers, 2, kv_heads, tokens, head_dim]
            cache = kv_to_cache(kv.to(self.device), self.model.config, self.dtype)
        self._sync()
        return cache

    def _context_tokens(self, cache: Any) -> int:
        return int(cache.get_seq_length())

    def _batched(self, cache: Any, ids: list[int]) -> list[int]:
        """This request's share of the batch's next forward: the greedy token after each id."""
        assert self.model_batch is not None
        got = self.model_batch.forward(self, cache, ids, self._cancelled)
        if got is None:
            raise DecodeCancelled(self._cancelled())  # dropped while its step ran
        return got

    @torch.no_grad()
    def _step(self, cache: Any, token: int, drafting: bool) -> int:
        if self.model_batch is not None:
            return self._batched(cache, [token])[0]
        out = lm_forward(self.model, self._ids_tensor([token]), cache)
        return int(out.logits[0, -1].argmax())  # int() waits for the device

    @torch.no_grad()
    def _verify(self, cache: Any, drafts: list[int]) -> tuple[int, int]:
        context = int(cache.get_seq_length())  # a freshly loaded cache: the prompt's
        fed = [self.first_token, *drafts]
        if self.model_batch is not None:
            target = self._batched(cache, fed)
        else:
            ids = self._ids_tensor(fed)  # [1, n + 1]
            logits = lm_forward(self.model, ids, cache).logits[0]
            target = logits.argmax(dim=-1).tolist()  # [n + 1]: the target's token after each
        accepted, emitted = accept_greedy(drafts, target)
        # keep first_token and d_1..d_a; token a+1 is fed by the next step
        if self.model_batch is not None:
            self.model_batch.crop(self, context + 1 + accepted)
        else:
            crop_cache(cache, context + 1 + accepted)
        return accepted, emitted[-1]


class TimingDecodeLoop(_DecodeLoop):
    """Modelled step times as sleeps (a model too large for this machine).

    A step on the full cache sleeps tpot_s(context_tokens, batch=1) * time_scale; a draft
    step (tpot_s + draft_overhead_s) * time_scale, or, with busy_draft_overhead_s set and a
    view whose on-arrival worker reports `worker_busy()`, a step that advances at
    1 / (tpot_s + busy_draft_overhead_s) while that worker dequantizes and 1 / tpot_s while
    it waits (its state polled every poll_s clock s: the simulator's busy-share model,
    kvsim.sim.worker_load, on the real worker's schedule), and with ingest_s_per_byte > 0,
    while the worker waits and the later streams are still arriving, the receiver busy
    min(1, ingest_s_per_byte x their mean arrival rate since drafting began) (the view's
    `later_bytes()` and `arrived_streams()`; a host-time cost, not scaled by time_scale:
    the link is real), the step advancing at (1 - share) / tpot_s + share /
    (tpot_s + busy_draft_overhead_s);
    the first step after a load also
    first_step_extra_s (a measured profile's; the simulator's on_demand loads add it too);
    verification verify_s(n, context_tokens) * time_scale; the accepted count is
    acceptance.sample_accepted(n, rng). Back-to-back steps sleep until their planned end
    (phase start + modelled time so far), so sleep overshoot does not accumulate.
    dequantize: call view.kv(n) for real (its time is real, not scaled) or skip it. A view
    dequantized on arrival (its `dequantize` attribute) hands over finished layers: the load
    then sleeps the profile's cache build (cache_build_s) instead.
    With `batch` (a decode host's StepBatch, kvsim.transport.decode_batch) the loop's steps
    are its share of the host's batched steps instead of sleeps of its own: each step posts
    this request's work (a draft or decode token, or the verification pass over n drafts,
    plus a drafting step's overhead: draft_overhead_s, or with busy_draft_overhead_s the
    busy-share mean of kvsim.scenario.speculative.busy_share_overhead_s at the worker's
    state, read while the step runs) and returns when the batch's step ends; the first step
    after a load sleeps the fresh cache's extra alone before it joins (as the simulator
    admits a request after it); the request holds a batch slot from its first step to its
    end; and tpot_s, draft_tpot_s and verify_s are reported as measured. With `slots`
    instead (an instance of one slot, decode_max_batch=1), the request waits for that slot
    before its first step and holds it to its end, stepping by itself meanwhile.
    Reported times are raw clock readings: the caller divides
    durations by time_scale to get modelled seconds; tpot_s, draft_tpot_s and verify_s are
    the modelled ones times time_scale (clock seconds, like everything else)."""

    mode = "timing"

    def __init__(self, timing: TimingModel, context_tokens: int, acceptance: AcceptanceModel,
                 rng: np.random.Generator, time_scale: float = 1.0,
                 draft_overhead_s: float = 0.0, clock: Clock = time.perf_counter,
                 dequantize: bool = True, sleep: Callable[[float], None] = time.sleep,
                 busy_draft_overhead_s: float | None = None, poll_s: float = 0.005,
                 ingest_s_per_byte: float = 0.0, batch: StepBatch | None = None,
                 on_done: Callable[[], None] | None = None,
                 slots: StepBatch | None = None) -> None:
        if int(context_tokens) < 1:
            raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
        self.timing, self.context = timing, int(context_tokens)
        self.acceptance, self.rng = acceptance, rng
        self.time_scale = check_number("time_scale", time_scale)
        self.draft_overhead_s = check_number("draft_overhead_s", draft_overhead_s,
                                             strict=False)
        self.clock, self.sleep, self.dequantize = clock, sleep, dequantize
        self.first_token = -1  # no real tokens
        self.step_s = timing.tpot_s(self.context, 1) * self.time_scale  # clock s per step
        self.draft_step_s = (timing.tpot_s(self.context, 1) + self.draft_overhead_s) \
            * self.time_scale
        # clock s per draft step while the worker is busy (None: every draft step is
        # draft_step_s)
        self.busy_draft_step_s = None if busy_draft_overhead_s is None else \
            (timing.tpot_s(self.context, 1) + check_number(
                "busy_draft_overhead_s", busy_draft_overhead_s, strict=False)) * self.time_scale
        self.poll_s = check_number("poll_s", poll_s)
        # receiver s per later-stream byte taken in (host s, not scaled: the link is real)
        self.ingest_s_per_byte = check_number("ingest_s_per_byte", ingest_s_per_byte,
                                              strict=False)
        # the view's worker_busy() where draft steps follow it (set by _load), else None
        self._worker_busy: Callable[[], bool] | None = None
        # the view where the ingest cost applies (set by _load), else None, and the later
        # bytes and clock when drafting began (the mean arrival rate's origin)
        self._ingest_view: Any = None  # an Assembly: later_bytes(), arrived_streams()
        self._ingest_from: tuple[float, float] | None = None
        self._planned = 0.0  # clock time the current step sequence has reached (s)
        # the first step on a freshly loaded cache costs this much more (measured profiles;
        # a verification pass is measured as such and pays none)
        self._fresh_extra_s = 0.0
        # modelled busy draft overhead (s), for batched steps
        self._busy_overhead_model_s = None if busy_draft_overhead_s is None else \
            float(busy_draft_overhead_s)
        self.step_batch = batch
        self._on_batch(batch, slots, on_done)
        # batched: clock time of the current phase's first post, and of the drafts' first
        self._steps_t: float | None = None
        self._draft_steps_t: float | None = None

    def _begin_phase(self, t: float) -> None:
        self._planned = t
        self._steps_t = None
        super()._begin_phase(t)
        if self._slot_at is not None and self._slot_at[0] == t:
            self._planned = self._slot_at[1]  # steps are planned from when it had its slot

    def _sleep_for(self, s: float) -> None:
        self._planned += s
        left = self._planned - self.clock()
        if left > 0:
            self.sleep(left)

    def _load(self, view: CacheView, n: int) -> Any:
        self._end_phase()  # loading takes no part in the batch's steps
        if self.dequantize:
            view.kv(n)  # real dequantization cost; the tensor itself is not needed
        if getattr(view, "dequantize", "on_demand") == "on_arrival":
            # the layers were dequantized as they arrived: what is left is building the
            # modelled model's cache from them (a measured profile's cache_build); a prefix
            # the decode node held is in place already (kvsim.transport.prefix_store)
            built = self.context - int(getattr(view, "held_tokens", 0))
            build_s = self.timing.cache_build_s(built) * self.time_scale
            if build_s > 0:
                self.sleep(build_s)
            if self.busy_draft_step_s is not None:  # drafts slow while its worker works
                self._worker_busy = getattr(view, "worker_busy", None)
                if self.ingest_s_per_byte > 0 and hasattr(view, "later_bytes"):
                    # ... and while the later bytes come in (mean rate from here)
                    self._ingest_view = view
                    self._ingest_from = (float(view.later_bytes()), self.clock())
        self._fresh_extra_s = self.timing.first_step_extra_s(self.context) * self.time_scale
        return None

    def _context_tokens(self, cache: Any) -> int:
        return self.context

    def _step(self, cache: Any, token: int, drafting: bool) -> int:
        extra, self._fresh_extra_s = self._fresh_extra_s, 0.0
        if self.step_batch is not None:
            if extra > 0:  # the fresh cache's first step costs this request alone
                self.sleep(extra)
            if self._steps_t is None:
                self._steps_t = self.clock()
                if drafting:
                    self._draft_steps_t = self._steps_t
            flops, kv = self.timing.member_work(1, self.context)
            if drafting and self._busy_overhead_model_s is not None and \
                    self._worker_busy is not None:  # follows the worker while the step runs
                work = StepWork(1, flops, kv, self.context,
                                overhead_now=self._batched_draft_overhead_s)
            else:
                work = StepWork(1, flops, kv, self.context,
                                self.draft_overhead_s if drafting else 0.0)
            if not self.step_batch.step(self, work, self.time_scale, self._cancelled):
                raise DecodeCancelled(self._cancelled())  # dropped while its step ran
            return -1
        if drafting and self._worker_busy is not None:
            self._sleep_for(extra)
            self._fluid_draft_step(self._worker_busy)
        else:
            self._sleep_for((self.draft_step_s if drafting else self.step_s) + extra)
        return -1

    def _fluid_draft_step(self, busy: Callable[[], bool]) -> None:
        """One draft step as a unit of work done at 1 / step_s while the receiver is idle
        and 1 / busy_draft_step_s while it is busy, mixed by its busy share in each slice
        of <= poll_s: 1 while busy() (the worker's job), else the ingest share."""
        assert self.busy_draft_step_s is not None  # (_load sets a probe only then)
        left = 1.0  # share of the step still to run
        while left > 1e-9:
            u = 1.0 if busy() else self._ingest_share()
            rate = (1.0 - u) / self.step_s + u / self.busy_draft_step_s  # steps per clock s
            slice_s = min(left / rate, self.poll_s)
            self._sleep_for(slice_s)
            left -= slice_s * rate

    def _steps_from(self, t: float, drafting: bool = False) -> float:
        if self.batch is None:
            return super()._steps_from(t, drafting)
        began = self._draft_steps_t if drafting else self._steps_t
        return t if began is None else began

    def _batched_draft_overhead_s(self) -> float:
        """Modelled s this drafting request adds to a batched step at the worker's state
        now (read by the stepping thread as the step runs): the busy overhead while the
        worker dequantizes, else its ingest share's mean (0 once every byte is in)."""
        busy_s = self._busy_overhead_model_s
        assert busy_s is not None and self._worker_busy is not None  # (_step checks)
        share = 1.0 if self._worker_busy() else self._ingest_share()
        return busy_share_overhead_s(busy_s, self.timing.tpot_s(self.context, 1), share)

    def _ingest_share(self) -> float:
        """min(1, ingest_s_per_byte x the later streams' mean arrival rate since drafting
        began) while some later stream is still arriving; 0 after, or without the cost."""
        view = self._ingest_view
        if view is None:
            return 0.0
        if view.arrived_streams() >= view.num_streams:
            self._ingest_view = None  # every byte is in: no more to take
            return 0.0
        got_b, now = float(view.later_bytes()), self.clock()
        b0, t0 = self._ingest_from or (got_b, now)
        if now <= t0:
            return 0.0
        return min(1.0, self.ingest_s_per_byte * (got_b - b0) / (now - t0))

    def _verify(self, cache: Any, drafts: list[int]) -> tuple[int, int]:
        self._fresh_extra_s = 0.0
        n = len(drafts)
        if self.step_batch is not None:
            flops, kv = self.timing.member_work(n, self.context)
            work = StepWork(n, flops, kv, self.context, verifying=True)
            if not self.step_batch.step(self, work, self.time_scale, self._cancelled):
                raise DecodeCancelled(self._cancelled())
            return int(self.acceptance.sample_accepted(n, self.rng)), -1
        self._sleep_for(self.timing.verify_s(n, self.context) * self.time_scale)
        return int(self.acceptance.sample_accepted(n, self.rng)), -1

    def _tpot_report(self, measured_s: float) -> float:
        return measured_s if self.batch is not None else self.step_s  # batched: as it ran

    def _draft_tpot_report(self, measured_s: float) -> float:
        # steps that followed the worker, or the batch, have no one modelled length: report
        # their mean (as measured: with the first step's extra and any sleep overshoot)
        if self._worker_busy is not None or self.batch is not None:
            return measured_s
        return self.draft_step_s

    def _verify_report(self, measured_s: float, proposed: int) -> float:
        if self.batch is not None:
            return measured_s
        return self.timing.verify_s(proposed, self.context) * self.time_scale


__all__ = ["CacheView", "DecodeResult", "RealDecodeLoop", "TimingDecodeLoop"]
