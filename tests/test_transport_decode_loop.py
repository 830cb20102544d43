"""The decode side's decode loop: real greedy drafting on the anchor while the residual
arrives (another thread), verification, and the timing loop against the simulator's
closed form."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from timing_models import llama8b_h100_timing

from kvsim.kernels.presets import resolve_codec
from kvsim.kv.capture import cache_to_kv, prefill
from kvsim.kv.draft_verify import decode
from kvsim.model.tiny import tiny_llama
from kvsim.scenario.acceptance import geometric
from kvsim.scenario.speculative import speculative_decode
from kvsim.transport.decode_loop import (
    CacheView,
    DecodeResult,
    RealDecodeLoop,
    TimingDecodeLoop,
)
from kvsim.transport.model_batch import ModelBatch

CONTEXT = 300  # tokens: two lynx pages (256 + 44), the last one short
TIMEOUT_S = 20.0  # generous: waits end when the Timer fires, long before this
SEGMENT_KINDS = {"draft_accepted", "draft_rejected", "wait", "verify", "decode", "dequantize"}


class DelayedView:
    """A CacheView whose stream i completes `delays_s[i]` seconds after `start()` (None:
    never), from a threading.Timer, the way the receiver thread completes streams. kv(n)
    dequantizes with `levels(n)` (a real codec's decode) when called.

    after_anchor: streams 1.. count their delay from the moment the anchor's kv(1) returned
    instead of from start(), so that a loaded machine (slow dequantization) cannot let the
    residual arrive before drafting begins."""

    def __init__(self, num_streams: int, levels: Callable[[int], torch.Tensor],
                 delays_s: list[float | None], clock: Callable[[], float] = time.perf_counter,
                 after_anchor: bool = False) -> None:
        if len(delays_s) != num_streams:
            raise ValueError("one delay per stream")
        self.num_streams = num_streams
        self._levels, self._delays, self._clock = levels, delays_s, clock
        self._after_anchor = after_anchor
        self._cond = threading.Condition()
        self._done = [False] * num_streams
        self._ready = 0
        self.ready_t = [math.nan] * num_streams  # clock time stream i became usable
        self.kv_calls: list[int] = []
        self._timers: list[threading.Timer] = []

    def start(self) -> None:
        self._start_timers(range(1 if self._after_anchor else self.num_streams))

    def _start_timers(self, streams: range) -> None:
        for i in streams:
            delay = self._delays[i]
            if delay is None:
                continue
            if delay <= 0:
                self._complete(i)
            else:
                timer = threading.Timer(delay, self._complete, (i,))
                timer.daemon = True
                self._timers.append(timer)
                timer.start()

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()

    def _complete(self, i: int) -> None:
        with self._cond:
            self._done[i] = True
            while self._ready < self.num_streams and self._done[self._ready]:
                self.ready_t[self._ready] = self._clock()
                self._ready += 1
            self._cond.notify_all()

    def wait_streams(self, n: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._ready >= n, timeout_s)

    def streams_ready(self) -> int:
        with self._cond:
            return self._ready

    def kv(self, n: int) -> torch.Tensor:
        if n > self.streams_ready():
            raise AssertionError(f"kv({n}) asked with {self.streams_ready()} streams ready")
        self.kv_calls.append(n)
        kv = self._levels(n)
        if self._after_anchor and self.kv_calls == [1]:
            self._start_timers(range(1, self.num_streams))
        return kv


@contextmanager
def running(view: DelayedView) -> Iterator[DelayedView]:
    view.start()
    try:
        yield view
    finally:
        view.close()


@pytest.fixture(scope="module")
def tiny():
    """Tiny random Llama, its real prefill KV (bf16, as on the wire) and first token."""
    model = tiny_llama(seed=1)
    ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(2))
    cache, last = prefill(model, ids)
    return model, cache_to_kv(cache).to(torch.bfloat16), int(last.argmax())


def codec_levels(kv: torch.Tensor, preset: str) -> tuple[int, Callable[[int], torch.Tensor]]:
    """(streams, n -> dequantized first n streams) of a real codec (torch backend: no JIT)."""
    codec = resolve_codec({"preset": preset, "params": {"backend": "torch"}}).build()
    enc = codec.encode(kv)
    return codec.num_streams, lambda n: codec.decode(enc, streams=n)


def noisy_anchor_levels(kv: torch.Tensor) -> tuple[int, Callable[[int], torch.Tensor]]:
    """Two streams: a useless anchor (the cache + 3 std of noise) and the exact cache; the
    drafts diverge at once, so verification must correct them and crop the cache."""
    noise = 3.0 * kv.float().std() * torch.randn(kv.shape, generator=torch.Generator()
                                                 .manual_seed(5))
    bad = (kv.float() + noise).to(kv.dtype)
    return 2, lambda n: bad if n == 1 else kv


def greedy_reference(model, levels, streams: int, first: int, tokens: int) -> list[int]:
    return decode(model, levels(streams), first, tokens)[0]


def check_timeline(res: DecodeResult, tokens: int) -> None:
    assert len(res.drafted_t) == len(res.committed_t) == tokens
    assert all(c >= d for c, d in zip(res.committed_t, res.drafted_t, strict=True))
    assert res.drafted_t == sorted(res.drafted_t)
    assert res.committed_t == sorted(res.committed_t)
    assert {kind for kind, _, _ in res.segments} <= SEGMENT_KINDS
    prev = -math.inf
    for kind, t0, t1 in res.segments:  # each span forward in time, spans in order
        assert prev <= t0 <= t1, (kind, res.segments)
        prev = t1
    for _, t0, t1 in res.events:
        assert t0 <= t1


@pytest.mark.parametrize("levels_kind, delay_s, cap", [
    ("lynx", 0.8, 6),  # the cap is reached first: wait for the residual
    ("lynx", 0.15, 10_000),  # the residual arrives while drafting
    ("lynx-2+2+4", 0.15, 10_000),  # three streams: drafting on stream 0 only
    ("noisy", 0.3, 12),  # drafts rejected early: correction + crop + decode on
])
def test_speculative_commits_plain_greedy_tokens(tiny, levels_kind, delay_s, cap):
    model, kv, first = tiny
    streams, levels = noisy_anchor_levels(kv) if levels_kind == "noisy" else \
        codec_levels(kv, levels_kind)
    tokens = 40
    ref = greedy_reference(model, levels, streams, first, tokens)
    delays = [0.0] + [delay_s] * (streams - 1)
    view = DelayedView(streams, levels, delays, after_anchor=True)
    assert isinstance(view, CacheView)
    with running(view):
        res = RealDecodeLoop(model, first).run(view, True, tokens, cap, TIMEOUT_S)
    check_timeline(res, tokens)
    assert res.mode == "real" and res.streams == streams and res.context_tokens == CONTEXT
    assert res.token_ids == ref
    assert 1 <= res.proposed <= cap and 0 <= res.accepted <= res.proposed
    assert view.kv_calls == [1, streams]  # the anchor, then everything
    t_residual = view.ready_t[-1]
    assert res.start_t <= t_residual <= res.full_t <= res.verify_start_t < res.verify_end_t
    # accepted drafts were valid before the full cache was usable; every draft step but the
    # last began, so the one before it ended, while the residual was still on its way
    assert all(t < res.full_t for t in res.drafted_t[:res.accepted])
    # every draft step's end is kept, the rejected ones' too: the accepted ones are drafted_t's
    assert len(res.draft_step_t) == res.proposed
    assert res.draft_step_t[:res.accepted] == res.drafted_t[:res.accepted]
    assert np.all(np.diff(res.draft_step_t) > 0) and res.draft_step_t[0] > res.start_t
    assert res.draft_step_t[-1] <= res.verify_start_t
    assert all(t < t_residual for t in res.drafted_t[:min(res.accepted, res.proposed - 1)])
    a = min(res.accepted, tokens)
    assert all(t == res.verify_end_t for t in res.committed_t[:a + 1])
    assert res.drafted_t[a] == res.verify_end_t  # the correction / bonus token
    kinds = [kind for kind, _, _ in res.segments]
    assert kinds[:3] == ["dequantize", "draft_accepted", "draft_rejected"]
    assert "wait" not in kinds or res.proposed == cap
    assert kinds[-3:] == ["dequantize", "verify", "decode"]
    assert res.tpot_s > 0 and res.draft_tpot_s > 0 and res.verify_s > 0
    if "wait" in kinds:  # the cap was reached first and the wait ended with the residual
        assert dict((k, t1) for k, _, t1 in res.segments)["wait"] >= t_residual
    if res.proposed < cap:  # drafting stopped at the first step begun after the residual
        assert res.proposed >= 2
    if levels_kind == "noisy":
        assert res.accepted < res.proposed  # the crop path ran and decoding went on


def test_non_speculative_waits_for_every_stream(tiny):
    model, kv, first = tiny
    streams, levels = codec_levels(kv, "lynx")
    tokens = 12
    ref = greedy_reference(model, levels, streams, first, tokens)
    view = DelayedView(streams, levels, [0.0, 0.2])
    with running(view):
        res = RealDecodeLoop(model, first).run(view, False, tokens, 64, TIMEOUT_S)
    check_timeline(res, tokens)
    assert res.token_ids == ref and (res.proposed, res.accepted) == (0, 0)
    assert view.kv_calls == [streams]
    assert res.drafted_t == res.committed_t
    assert view.ready_t[-1] <= res.start_t == res.full_t < res.drafted_t[0]
    assert math.isnan(res.verify_start_t) and math.isnan(res.verify_end_t)
    assert [k for k, _, _ in res.segments] == ["dequantize", "decode"]
    assert res.tpot_s == pytest.approx((res.committed_t[-1] - res.full_t) / tokens)


def test_speculative_without_a_gap_decodes_plainly(tiny):
    """Every stream complete when stream 0 is: no drafting, same tokens."""
    model, kv, first = tiny
    streams, levels = codec_levels(kv, "lynx")
    tokens = 8
    view = DelayedView(streams, levels, [0.0, 0.0])
    with running(view):
        res = RealDecodeLoop(model, first).run(view, True, tokens, 64, TIMEOUT_S)
    check_timeline(res, tokens)
    assert res.proposed == 0 and view.kv_calls == [streams]
    assert res.token_ids == greedy_reference(model, levels, streams, first, tokens)


def test_cap_zero_waits_without_drafting(tiny):
    model, kv, first = tiny
    streams, levels = codec_levels(kv, "lynx")
    view = DelayedView(streams, levels, [0.0, 0.15])
    with running(view):
        res = RealDecodeLoop(model, first).run(view, True, 6, 0, TIMEOUT_S)
    check_timeline(res, 6)
    assert res.proposed == 0 and view.kv_calls == [streams]
    kinds = [k for k, _, _ in res.segments]
    assert kinds == ["wait", "dequantize", "decode"]
    assert res.start_t < view.ready_t[-1] <= res.full_t


@pytest.mark.parametrize("speculative, delays, missing", [
    (True, [0.0, None], "stream 1 of 2"),  # the residual never comes
    (False, [0.0, None], "stream 1 of 2"),
    (True, [None, None], "stream 0 of 2"),  # nothing comes
])
def test_timeout_names_the_incomplete_stream(tiny, speculative, delays, missing):
    model, kv, first = tiny
    streams, levels = codec_levels(kv, "lynx")
    view = DelayedView(streams, levels, delays)
    started = time.perf_counter()
    with running(view), pytest.raises(TimeoutError, match=missing):
        RealDecodeLoop(model, first).run(view, speculative, 8, 4, 0.2)
    assert time.perf_counter() - started < 5.0  # drafting is capped, the wait times out


def test_bad_arguments_are_refused(tiny):
    model, kv, first = tiny
    streams, levels = codec_levels(kv, "lynx")
    view = DelayedView(streams, levels, [0.0, 0.0])
    loop = RealDecodeLoop(model, first)
    for args, msg in (((True, 0, 4, 1.0), "output_tokens"), ((True, 4, -1, 1.0), "cap_tokens"),
                      ((True, 4, 4, 0.0), "timeout_s")):
        with pytest.raises(ValueError, match=msg):
            loop.run(view, *args)


def test_real_loops_on_one_batch_share_forwards_and_commit_their_own_greedy_tokens(tiny):
    """Three requests on one decode instance's ModelBatch, at once: one drafts on a useless
    anchor (its verification rejects, crops and decodes on), one drafts on lynx's anchor,
    one decodes plainly on a shorter prompt. Each commits the tokens of plain greedy
    decoding on its own full cache, and they shared forwards."""
    model, kv, first = tiny
    tokens = 24
    short = kv[:, :, :, :CONTEXT - 113].contiguous()
    lynx_streams, lynx = codec_levels(kv, "lynx")
    noisy_streams, noisy = noisy_anchor_levels(kv)
    cases = [  # (streams, levels, speculative, delays)
        (noisy_streams, noisy, True, [0.0, 0.3]),
        (lynx_streams, lynx, True, [0.0, 0.2]),
        (1, lambda n: short, False, [0.0]),
    ]
    refs = [greedy_reference(model, levels, n, first, tokens) for n, levels, _, _ in cases]
    batch = ModelBatch(model, max_batch=4, wait_timeout_s=TIMEOUT_S)
    done: list[int] = []
    results: dict[int, DecodeResult] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        n, levels, speculative, delays = cases[i]
        view = DelayedView(n, levels, delays, after_anchor=speculative)
        loop = RealDecodeLoop(model, first, batch=batch, on_done=lambda: done.append(i))
        try:
            with running(view):
                results[i] = loop.run(view, speculative, tokens, 10_000, TIMEOUT_S)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    assert not errors and sorted(done) == [0, 1, 2]
    for i, ref in enumerate(refs):
        check_timeline(results[i], tokens)
        assert results[i].token_ids == ref, i
    assert results[0].accepted < results[0].proposed  # the crop path ran in the batch
    assert results[1].proposed >= 1
    assert batch.widest >= 2  # they shared forwards ...
    steps_alone = sum(r.proposed + (1 if r.proposed else 0) + tokens - r.accepted - 1
                      if r.proposed else tokens for r in results.values())
    assert batch.steps < steps_alone  # ... so fewer forwards ran than their own steps
    with batch._cond:  # every slot given back, no member left computing
        assert batch._holders == 0 and not batch._computing


# ---- timing loop ----------------------------------------------------------------------------

TIMING_CONTEXT = 4096
STEP_S = 0.1  # clock seconds per full-cache step after scaling: large against sleep jitter
# Tolerance (clock s). Sleeps never end early and back-to-back steps sleep to their planned
# end, so the loop is never ahead of the closed form and its lag does not accumulate: it is
# at most the overshoot of the sleep that ended the drafting phase, one condition-variable
# wake-up, and the overshoot of the token's own sleep; each is a scheduler latency (well
# under 1 ms idle, tens of ms on a loaded shared 2-core machine). 40 ms stays below half a
# step, so a token one step off would still fail.
TOL_S = 0.04


@pytest.mark.parametrize("accept, gap_steps, cap", [
    (1.0, 3.5, 64),  # residual mid-step 4: 4 drafts, all accepted (+ bonus)
    (0.0, 3.5, 64),  # all 4 rejected: token 1 is the correction at verification end
    (1.0, 6.5, 3),  # cap 3 reached: wait for the residual, then verify
])
def test_timing_loop_matches_the_closed_form(tiny, accept, gap_steps, cap):
    _, kv, _ = tiny
    timing = llama8b_h100_timing()
    tpot = timing.tpot_s(TIMING_CONTEXT, 1)  # modelled s
    scale = STEP_S / tpot
    overhead = 0.1 * tpot  # modelled s per drafted token
    draft_step = (tpot + overhead) * scale  # clock s
    tokens = 10
    # kv(n) costs nothing here (the dequantization is real time the closed form does not
    # model); the residual's delay counts from the anchor's kv(1), just before drafting
    view = DelayedView(2, lambda n: kv, [0.0, gap_steps * draft_step], after_anchor=True)
    loop = TimingDecodeLoop(timing, TIMING_CONTEXT, geometric(accept),
                            np.random.default_rng(0), time_scale=scale,
                            draft_overhead_s=overhead)
    with running(view):
        res = loop.run(view, True, tokens, cap, TIMEOUT_S)
    check_timeline(res, tokens)
    assert res.mode == "timing" and res.token_ids == [] and view.kv_calls == [1, 2]
    expected_proposed = min(cap, math.ceil(gap_steps))
    assert res.proposed == expected_proposed
    assert res.accepted == (expected_proposed if accept == 1.0 else 0)
    assert res.tpot_s == pytest.approx(STEP_S) and res.draft_tpot_s == pytest.approx(draft_step)
    # the closed form, fed the same anchor and residual instants (clock s)
    closed = speculative_decode(
        res.start_t, view.ready_t[-1], STEP_S, draft_step,
        lambda n: timing.verify_s(n, TIMING_CONTEXT) * scale, cap, lambda n: res.accepted,
        tokens)
    assert (closed.proposed, closed.accepted) == (res.proposed, res.accepted)
    # the draft steps, rejected or not, end one modelled draft step apart
    assert np.diff([res.start_t, *res.draft_step_t]) == pytest.approx(draft_step, abs=TOL_S)
    lag = np.asarray(res.drafted_t) - closed.token_t
    assert lag.min() >= -1e-6 and lag.max() <= TOL_S, lag
    assert res.verify_start_t - closed.verify_start_t <= TOL_S
    assert [k for k, _, _ in res.segments if k != "dequantize"] == \
        [k for k, _, _ in closed.segments]


@pytest.mark.parametrize("dequantize", [True, False])
def test_timing_loop_plain_decoding(tiny, dequantize):
    _, kv, _ = tiny
    timing = llama8b_h100_timing()
    scale = STEP_S / timing.tpot_s(TIMING_CONTEXT, 1)
    streams, levels = codec_levels(kv, "lynx")
    view = DelayedView(streams, levels, [0.0, 0.05])
    loop = TimingDecodeLoop(timing, TIMING_CONTEXT, geometric(0.9), np.random.default_rng(0),
                            time_scale=scale, dequantize=dequantize)
    with running(view):
        res = loop.run(view, False, 5, 8, TIMEOUT_S)
    check_timeline(res, 5)
    assert view.kv_calls == ([streams] if dequantize else []) and res.proposed == 0
    assert view.ready_t[-1] <= res.full_t
    expected = res.full_t + STEP_S * np.arange(1, 6)
    lag = np.asarray(res.committed_t) - expected
    assert lag.min() >= -1e-6 and lag.max() <= TOL_S, lag
    with pytest.raises(ValueError, match="time_scale"):
        TimingDecodeLoop(timing, TIMING_CONTEXT, geometric(0.9), np.random.default_rng(0),
                         time_scale=0.0)


class WorkerView:
    """A two-stream CacheView in virtual time (`clock`, advanced by `sleep`): the anchor is
    dequantized at 0, the full cache at full_t; an on-arrival worker busy over [0, busy_end).
    """

    num_streams = 2
    dequantize = "on_arrival"

    def __init__(self, full_t: float, busy_end: float) -> None:
        self.t, self.full_t, self.busy_end = 0.0, full_t, busy_end

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def worker_busy(self) -> bool:
        return self.t < self.busy_end

    def streams_ready(self) -> int:
        return 2 if self.t >= self.full_t else 1

    def wait_streams(self, n: int, timeout_s: float) -> bool:
        if n > self.streams_ready():
            self.t = self.full_t  # virtual time jumps to the completion
        return True

    def kv(self, n: int) -> torch.Tensor:
        raise AssertionError("dequantize=False: the loop never asks for the tensor")


@pytest.mark.parametrize("on_arrival", [True, False])
def test_timing_draft_steps_slow_only_while_the_worker_is_busy(on_arrival):
    """busy_draft_overhead_s: a draft step advances at 1 / (3 x step) while the worker is
    busy (until 0.45 s) and 1 / step after (step 0.1 clock s). By hand: draft 1 runs
    0 -> 0.3 (busy), draft 2 half its work by 0.45 and the rest by 0.5, draft 3 0.5 -> 0.6;
    the full cache is ready at 0.55, so drafting stops after 3. A view without an on-arrival
    worker drafts at the constant draft step (tpot + draft_overhead_s): 0.15 s each, 4
    drafts."""
    timing = llama8b_h100_timing()
    tpot = timing.tpot_s(TIMING_CONTEXT, 1)
    scale = STEP_S / tpot
    view = WorkerView(full_t=0.55, busy_end=0.45)
    if not on_arrival:
        view.dequantize = "on_demand"
    loop = TimingDecodeLoop(timing, TIMING_CONTEXT, geometric(1.0), np.random.default_rng(0),
                            time_scale=scale, draft_overhead_s=0.5 * tpot, clock=view.clock,
                            sleep=view.sleep, dequantize=False,
                            busy_draft_overhead_s=2.0 * tpot, poll_s=0.001)
    res = loop.run(view, True, 8, 64, TIMEOUT_S)
    check_timeline(res, 8)
    drafts = np.asarray(res.drafted_t[:res.proposed]) - res.start_t
    if on_arrival:
        # the busy state is read at the start of each 1-ms slice: one slice may straddle
        # the worker's end (at most 1 ms x (1 - 1/3) late)
        assert res.proposed == 3 and res.accepted == 3
        np.testing.assert_allclose(drafts, [0.3, 0.5, 0.6], atol=1e-3)
        assert res.draft_tpot_s == pytest.approx(0.2, abs=1e-3)  # measured mean
    else:
        assert res.proposed == 4
        np.testing.assert_allclose(drafts, [0.15, 0.3, 0.45, 0.6], atol=1e-9)
        assert res.draft_tpot_s == pytest.approx(0.15)
    with pytest.raises(ValueError, match="busy_draft_overhead_s"):
        TimingDecodeLoop(timing, TIMING_CONTEXT, geometric(1.0), np.random.default_rng(0),
                         busy_draft_overhead_s=math.nan)


class IngestView(WorkerView):
    """WorkerView whose later streams' bytes come in at `rate` B/s until `arrive_end`."""

    def __init__(self, full_t: float, busy_end: float, rate: float, arrive_end: float) -> None:
        super().__init__(full_t, busy_end)
        self.rate, self.arrive_end = rate, arrive_end

    def later_bytes(self) -> float:
        return self.rate * min(self.t, self.arrive_end)

    def arrived_streams(self) -> int:
        return 2 if self.t >= self.arrive_end else 1


@pytest.mark.parametrize("busy_end", [0.0, 0.1])
def test_timing_draft_steps_slow_while_the_later_bytes_come_in(busy_end: float):
    """ingest_s_per_byte 5e-7 s/B at 1 MB/s: while the bytes arrive (until 0.4 s) and the
    worker waits, the receiver is busy half the time; busy ratio 3 (step 0.1 clock s), so
    a step advances at 0.5 / 0.1 + 0.5 / 0.3 = 6.67 per s. By hand, worker idle: drafts end
    at 0.15 and 0.30; draft 3 makes 2/3 of a step by 0.4 and the rest at the plain step, by
    0.4333; drafts 4 and 5 at the step, the last after the full cache (0.55). Worker busy
    until 0.1 (fully busy: 1/3 of a step by then): draft 1 ends at 0.2, draft 2 at 0.35,
    draft 3 makes 1/3 by 0.4 and ends at 0.4667, draft 4 at 0.5667. The mean rate is taken
    from the anchor's load (the first slice, with nothing elapsed, has share 0: <= 1 ms
    late). Without the cost the same drafts run at the step while the worker waits."""
    timing = llama8b_h100_timing()
    tpot = timing.tpot_s(TIMING_CONTEXT, 1)
    scale = STEP_S / tpot

    def drafts(ingest: float) -> np.ndarray:
        view = IngestView(full_t=0.55, busy_end=busy_end, rate=1e6, arrive_end=0.4)
        loop = TimingDecodeLoop(timing, TIMING_CONTEXT, geometric(1.0),
                                np.random.default_rng(0), time_scale=scale, clock=view.clock,
                                sleep=view.sleep, dequantize=False,
                                busy_draft_overhead_s=2.0 * tpot, poll_s=0.001,
                                ingest_s_per_byte=ingest)
        res = loop.run(view, True, 8, 64, TIMEOUT_S)
        check_timeline(res, 8)
        return np.asarray(res.drafted_t[:res.proposed]) - res.start_t

    if busy_end == 0.0:
        third = 0.4 + 0.1 / 3
        np.testing.assert_allclose(drafts(5e-7), [0.15, 0.30, third, third + 0.1,
                                                  third + 0.2], atol=1.5e-3)
        np.testing.assert_allclose(drafts(0.0), [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], atol=1e-9)
    else:
        third = 0.4 + 0.2 / 3
        np.testing.assert_allclose(drafts(5e-7), [0.2, 0.35, third, third + 0.1],
                                   atol=1.5e-3)
    with pytest.raises(ValueError, match="ingest_s_per_byte"):
        TimingDecodeLoop(timing, TIMING_CONTEXT, geometric(1.0), np.random.default_rng(0),
                         busy_draft_overhead_s=0.0, ingest_s_per_byte=-1.0)


# ---- the real model -------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_speculative_decoding_is_lossless():
    """SmolLM2-135M on 512 tokens of real text, the default Lynx codec (CPU kernels): drafting
    on the anchor while the residual arrives commits exactly plain greedy decoding."""
    from kvsim.kv.text import assemble
    from kvsim.model.fetch import cached_gguf_path
    from kvsim.model.load import load_lm
    from kvsim.model.presets import load_model_preset

    preset = load_model_preset("smollm2-135m")
    if not cached_gguf_path(preset).is_file():
        pytest.skip("SmolLM2-135M weights not fetched (`kvsim model fetch`)")
    lm = load_lm(preset)
    ids = assemble(lm.tokenizer, 512, "stdlib-docs", 0).ids
    cache, last = prefill(lm.model, ids)
    kv = cache_to_kv(cache).to(torch.bfloat16)
    first = int(last.argmax())
    codec = resolve_codec("lynx").build()
    enc = codec.encode(kv)

    def levels(n: int) -> torch.Tensor:
        return codec.decode(enc, streams=n)

    tokens = 16
    ready = DelayedView(2, levels, [0.0, 0.0])
    with running(ready):
        plain = RealDecodeLoop(lm.model, first).run(ready, False, tokens, 0, TIMEOUT_S)
    view = DelayedView(2, levels, [0.0, 8 * plain.tpot_s], after_anchor=True)  # ~8 drafts
    with running(view):
        res = RealDecodeLoop(lm.model, first).run(view, True, tokens, 32, TIMEOUT_S)
    check_timeline(res, tokens)
    assert res.token_ids == plain.token_ids
    assert res.proposed >= 1 and res.accepted <= res.proposed
    assert all(t < res.full_t for t in res.drafted_t[:res.accepted])
    # every draft step's end is kept, the rejected ones' too: the accepted ones are drafted_t's
    assert len(res.draft_step_t) == res.proposed
    assert res.draft_step_t[:res.accepted] == res.drafted_t[:res.accepted]
    assert np.all(np.diff(res.draft_step_t) > 0) and res.draft_step_t[0] > res.start_t
    assert res.draft_step_t[-1] <= res.verify_start_t


def test_a_real_loop_that_waited_for_its_slot_reports_its_steps_alone(tiny):
    """One slot (decode_max_batch=1): the second request decodes once the first has ended;
    its TPOT is its own steps' (from when it held the slot), not the wait's."""
    from kvsim.transport.decode_batch import StepBatch

    model, kv, first = tiny
    tokens = 48
    slot = StepBatch(None, max_batch=1, wait_timeout_s=TIMEOUT_S)  # (slots only)
    results: dict[int, DecodeResult] = {}

    def run(i: int) -> None:
        view = DelayedView(1, lambda n: kv, [0.0])
        with running(view):
            results[i] = RealDecodeLoop(model, first, slots=slot).run(
                view, False, tokens, 0, TIMEOUT_S)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    done_first, done_second = sorted(results.values(), key=lambda r: r.committed_t[-1])
    assert done_second.committed_t[0] >= done_first.committed_t[-1]  # it waited
    waited_s = done_first.committed_t[-1] - done_second.full_t
    assert waited_s > 0
    own_s = done_second.committed_t[-1] - done_first.committed_t[-1]
    assert done_second.tpot_s * tokens <= own_s + 0.01
    assert done_second.token_ids == done_first.token_ids  # the same prompt, alone each
