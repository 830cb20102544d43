"""Continuous batching on one decode instance: processor sharing over the batch.

Every member of a decode instance's batch gains one token per forward step, and the step's
length depends on the whole batch (TimingModel.batch_step_s: the members' new tokens,
FLOPs and KV reads, plus `draft_overhead_s` per drafting member). So all members advance
at the same rate, 1 / step_s(t) steps per second, and that rate changes only when the
batch changes: a member joins, leaves, or changes phase (draft -> verify -> decode).
Between those instants it is constant, so one fluid clock serves every member:

    steps(t) = steps(t0) + (t - t0) / step_s      (steps the instance has run)

A member that enters a phase when the clock reads v0 has its j-th token of the phase when
the clock reads v0 + j; token times are read off the clock's breakpoints by interpolation
when the member leaves. Members enter a computing phase at a step boundary, as
iteration-level scheduling admits them: one that becomes ready while the others' step is in
progress joins when that step ends (the clock's next whole step from the moment the batch
last started from idle), computing nothing meanwhile; one that finds the batch idle starts
at once. A step in progress is re-timed when a member leaves it or changes its work
(verification, a draft overhead that ends), as the link re-times a message when its share
changes. Cost: O(log batch) per batch change, and none per token.

Context of a member: its prompt (`context_tokens`). The tokens it generates (output_tokens,
128 by default, against prompts of thousands) are left out so that the step time is
constant between batch changes: the clock stays exact, and a request alone on its
instance keeps the closed-form timeline of kvsim.scenario.speculative (batch-1 TPOT).

Phases of a member (speculative: split-stream decoding that starts on the anchor):
  draft   on the anchor, one drafted token per step; each drafting member makes the step
          `draft_overhead_s` longer (dequantizing its anchor, or, `overhead_until_full`,
          the receiver's work beside it, which ends when its full cache is ready: the
          step in progress then goes on without it); at most `cap` drafts;
  wait    `cap` drafts done and the full cache not ready: holds its slot, computes nothing;
  verify  full cache ready: the draft step in progress finishes (the clock reaches the
          next whole draft), then one step in which this member's forward covers its n
          drafts on the full cache (batched with the others' decode steps); its accepted
          prefix is drawn then, and the step yields the correction / bonus token;
  decode  one token per step until the request's tokens are out;
  join    ready for one of the above, waiting for the step in progress to end.
Drafted and committed token times follow kvsim.scenario.speculative's definitions.

workload.colocated_prefill (a prefill instance on the decode instance's host, as `kvsim
emulate` runs both sides on one machine): while a prefill runs there, every step costs
TimingModel.beside_prefill_ratio(computing members) of itself; a prefill's start and end
change the rate as a batch change does.

workload.worker_slows_decode (the decode instance's on-arrival workers dequantize on the
processor that steps the batch, as `kvsim serve` runs them): while a request is received
(kvsim.sim.run: from its first message's release + the link's latency until its cache is
dequantized, or until it joins to draft with an overhead that stands for its worker), its
worker is busy a projected share u of that time
(kvsim.sim.worker_load.receiver_busy_fraction), and a step of step_s takes step_s + e while
the worker works (e: TimingModel.beside_worker_extra_s, whatever the batch), r = 1 + e /
step_s times as long, so the clock runs at (1 - u (1 - 1/r)) of its rate on average: every
step costs 1 / (1 - U (1 - 1/r)) of itself, U the shares of the requests received now,
summed (at most 1).
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable

import numpy as np
import simpy

from kvsim.scenario.speculative import DecodeTimeline
from kvsim.scenario.timing_model import TimingModel
from kvsim.sim.timer import Timer, call_later

_COUNTS: dict[int, np.ndarray] = {}  # n -> [n] float 1..n (read-only), see _counts


def _counts(n: int) -> np.ndarray:
    """[n] the floats 1..n, made once per n (every member of a run reads them)."""
    hit = _COUNTS.get(n)
    if hit is None:
        hit = _COUNTS[n] = np.arange(1, n + 1, dtype=np.float64)
        hit.flags.writeable = False
    return hit


_EPS_STEPS = 1e-9  # clock slack (steps) when deciding that members reached their target
# breakpoints a batch holds before it drops those no member in it can still read (and then
# at twice what it kept): the clock's breakpoints otherwise grow with the run (5 per
# request, two doubles each)
_TRIM_BREAKPOINTS = 4096


class Member:
    """One request in a decode batch. Clock values (`*_v`) are in steps, times in s."""

    __slots__ = ("seq", "context_tokens", "tokens", "cap", "draft_overhead_s",
                 "sample_accepted", "phase", "phase_v", "phase_i", "target_v", "full_ready",
                 "work", "timeline", "start_t", "full_t", "draft_v", "draft_i",
                 "draft_end_t", "draft_end_i", "proposed", "accepted", "verify_start_t",
                 "verify_end_t", "_verify_work", "load_s", "env", "on_leave", "_done",
                 "overhead_until_full", "pending")

    def __init__(self, env: simpy.Environment, seq: int, context_tokens: int, tokens: int,
                 cap: int, draft_overhead_s: float,
                 sample_accepted: Callable[[int], int] | None,
                 on_leave: Callable[[Member], None] | None = None,
                 overhead_until_full: bool = False) -> None:
        self.env, self.on_leave = env, on_leave
        # the draft overhead is the receiver's work beside the drafts, which ends when the
        # full cache is ready: the draft step in progress then goes on without it
        self.overhead_until_full = overhead_until_full
        self.seq, self.context_tokens, self.tokens = seq, int(context_tokens), int(tokens)
        self.cap, self.draft_overhead_s = int(cap), float(draft_overhead_s)
        self.sample_accepted = sample_accepted
        self.phase = ""
        self.phase_v = 0.0  # clock when the current phase began
        self.phase_i = 0  # its breakpoint index
        self.target_v = math.inf  # clock at which the current phase ends
        self.full_ready = sample_accepted is None  # plain members decode on the full cache
        # this member's share of the step now: (new tokens, FLOPs, KV bytes, overhead s)
        self.work = (0, 0.0, 0.0, 0.0)
        self._done: simpy.Event | None = None  # made on first use (see done)
        self.timeline: DecodeTimeline | None = None
        self.start_t = self.full_t = self.draft_end_t = math.nan
        self.verify_start_t = self.verify_end_t = math.nan
        self.draft_v, self.draft_i, self.draft_end_i = 0.0, 0, 0
        self.proposed = self.accepted = 0
        self._verify_work = (0, 0.0, 0.0, 0.0)
        self.load_s = 0.0  # deserializer=on_demand: full cache dequantized after drafting (s)
        self.pending: Callable[[], None] | None = None  # joining: starts its phase at the boundary

    @property
    def done(self) -> simpy.Event:
        """An event that succeeds with the DecodeTimeline when the member leaves (for a
        simpy process that waits on it; `on_leave` is the callback form, without an
        event)."""
        if self._done is None:
            self._done = self.env.event()
            if self.timeline is not None:
                self._done.succeed(self.timeline)
        return self._done


class DecodeBatch:
    """The continuous batch of one decode instance (see the module docstring)."""

    def __init__(self, env: simpy.Environment, timing: TimingModel) -> None:
        self.env, self.timing = env, timing
        self.steps = 0.0  # the fluid clock (steps run since the start)
        self.last_t = env.now
        self.step_s = math.inf  # length of one step of the current batch (s)
        # clock breakpoints: time (s) ... and clock (steps), piecewise linear between. Raw
        # doubles, not lists of Python floats: a member that leaves reads its phase's
        # breakpoints, written up to seconds before; as floats scattered over the heap those
        # reads would be cache misses that grow with the requests in flight, as contiguous
        # doubles they are a few lines, handed to np.interp without a conversion
        self.bp_t = array("d", (env.now,))
        self.bp_v = array("d", (0.0,))
        # members hold absolute breakpoint indices; bp_t[0] is breakpoint _bp0 (those before
        # it were dropped, see _trim)
        self._bp0 = 0
        self._trim_at = _TRIM_BREAKPOINTS
        self._live: set[Member] = set()  # the members in the batch (joined, not left)
        # sums over the computing members: new tokens, FLOPs, KV bytes read, draft overhead
        # (s), sequences, prompt tokens (the profile's mean context)
        self._tokens, self._flops, self._kv, self._overhead = 0, 0.0, 0.0, 0.0
        self._seqs, self._ctx = 0, 0
        self._origin = 0.0  # clock (steps) of a step boundary: where the batch last left idle
        self._verifying = 0  # members in their verification pass
        self._heap: list[tuple[float, int, Member]] = []  # (target clock, push #, member)
        self._pushed = 0
        self._timer: Timer | None = None
        self._timer_v = math.inf  # the armed timer's clock target (steps) ...
        self._timer_t = math.inf  # ... and time (s)
        self.changes = 0  # batch changes (rate recomputations)
        # prefills running on this instance's host now (workload.colocated_prefill): while
        # one runs, every step costs TimingModel.beside_prefill_ratio(members) of itself
        self._prefills = 0
        # requests received on this instance now -> their worker's busy share of the
        # reception (workload.worker_slows_decode)
        self._received: dict[int, float] = {}
        self._left: list[Member] = []  # left during the batch's update, told after it

    @property
    def members(self) -> int:
        """Requests in the batch now."""
        return len(self._live)

    def prefills_running(self, delta: int) -> None:
        """A prefill on this instance's host started (+1) or ended (-1) now
        (workload.colocated_prefill): the step in progress goes on at the new rate."""
        self._advance()
        before, self._prefills = self._prefills, self._prefills + delta
        if self._prefills < 0:
            raise RuntimeError("a colocated prefill ended that never started")
        if self._seqs and (before == 0) != (self._prefills == 0):
            self._changed()  # from none running to some, or back

    def receiving(self, seq: int, busy_share: float | None) -> None:
        """Request seq's reception on this instance's host began now, its worker busy
        `busy_share` (0..1) of it, or ended (None) (workload.worker_slows_decode): the step in
        progress goes on at the new rate."""
        self._advance()
        before = self._received.get(seq, 0.0)
        if busy_share is None:
            self._received.pop(seq, None)
        else:
            if not 0.0 <= busy_share <= 1.0:
                raise ValueError(f"a worker's busy share must be in [0, 1], got {busy_share}")
            self._received[seq] = busy_share
        if self._seqs and self._received.get(seq, 0.0) != before:
            self._changed()

    # ---- members in and out ------------------------------------------------------------
    def join(self, seq: int, context_tokens: int, tokens: int, cap: int = 0,
             draft_overhead_s: float = 0.0,
             sample_accepted: Callable[[int], int] | None = None,
             on_leave: Callable[[Member], None] | None = None,
             overhead_until_full: bool = False) -> Member:
        """A request takes its place in the batch now. With `sample_accepted` (drawing the
        accepted prefix of n drafts) it starts speculatively on the anchor (drafting, or
        waiting when cap is 0) and `full_ready` must follow; without it, it decodes.
        on_leave(member) is called when it leaves (member.timeline set), after the batch
        has been re-timed, so the callback may change the batch (admit the next request).
        overhead_until_full: the member's draft overhead ends at `full_ready` (the receiver's
        work beside the drafts is over), the draft step in progress finishing without it."""
        if tokens < 1:
            raise ValueError(f"request {seq}: a decode member needs tokens >= 1, got {tokens}")
        self._advance()
        m = Member(self.env, seq, context_tokens, tokens, cap, draft_overhead_s,
                   sample_accepted, on_leave, overhead_until_full)
        m.start_t = self.env.now
        m.draft_v, m.draft_i = self.steps, self._last_i()  # (set again when drafting starts)
        self._live.add(m)
        if m.full_ready:
            m.full_t = m.start_t
            self._begin(m, lambda: self._enter(m, "decode", m.tokens))
        elif m.cap > 0:
            def draft() -> None:
                m.draft_v, m.draft_i = self.steps, self._last_i()
                if m.full_ready and m.overhead_until_full:
                    m.draft_overhead_s = 0.0  # the receiver's work beside it is over
                # full cache ready while it joined: the one draft it was admitted for
                self._enter(m, "draft", 1 if m.full_ready else m.cap)
            self._begin(m, draft)
        else:
            self._enter(m, "wait", 0)
        self._changed()
        return m

    def full_ready(self, m: Member, load_s: float = 0.0) -> None:
        """Every stream of speculative member m is here now. load_s > 0
        (deserializer=on_demand): drafting stops after the step in progress, then the full
        cache is dequantized for load_s seconds (the member leaves the batch's work), then
        verification (or plain decoding) starts; load_s = 0: it is usable now."""
        if m.full_ready:
            raise RuntimeError(f"request {m.seq}: full cache reported ready twice")
        self._advance()
        m.full_ready, m.full_t, m.load_s = True, self.env.now, float(load_s)
        if m.phase == "join":
            # its first draft step was pending (as a decode loop that posted it): that one
            # draft runs, then verification (the draft phase reads full_ready as it starts)
            return
        elif m.phase == "draft":
            progress = self.steps - m.draft_v  # drafts done (fractional: one in progress)
            proposed = min(m.cap, math.ceil(progress - 1e-12))
            if proposed <= 0:  # full cache with the anchor: no draft, plain decoding
                self._after_load(m, lambda: self._enter(m, "decode", m.tokens))
            else:
                target = m.draft_v + proposed
                if target != m.target_v:  # fewer than cap: the step in progress is the last
                    m.target_v = target
                    self._push(m)
                if m.overhead_until_full and m.draft_overhead_s:
                    m.draft_overhead_s = 0.0  # the step in progress goes on at the plain rate
                    self._set_work(m, "draft")
                    self._changed()
                else:
                    self._arm()
                return  # otherwise the batch is unchanged until the draft step finishes
        elif m.phase == "wait":
            if m.cap == 0:
                self._after_load(m, lambda: self._enter(m, "decode", m.tokens))
            else:
                self._after_load(m, lambda: self._start_verify(m, m.cap))
        self._changed()

    def _after_load(self, m: Member, start: Callable[[], None]) -> None:
        """Begin `start` (m's next phase) now, or after m.load_s with m waiting meanwhile
        (either at the next step boundary, `_begin`)."""
        if m.load_s <= 0:
            self._begin(m, start)
            return
        if m.phase != "wait":
            self._enter(m, "wait", 0)

        def loaded(_timer: Timer) -> None:
            self._advance()
            m.full_t = self.env.now  # the full cache is usable from here
            self._begin(m, start)
            self._changed()
        call_later(self.env, m.load_s, loaded)

    # ---- phases ------------------------------------------------------------------------
    def _boundary(self) -> float:
        """The clock (steps) at which the step in progress ends; now when none runs."""
        if not self._seqs:
            return self.steps
        return self._origin + math.ceil(self.steps - self._origin - _EPS_STEPS)

    def _begin(self, m: Member, start: Callable[[], None]) -> None:
        """m starts a computing phase (`start` enters it) at the next step boundary: now
        when the batch is idle or at one, else joining until the step in progress ends."""
        boundary = self._boundary()
        if boundary - self.steps <= _EPS_STEPS:
            start()
            return
        self._enter(m, "join", 0)
        m.pending, m.target_v = start, boundary
        self._push(m)

    def _enter(self, m: Member, phase: str, steps: int) -> None:
        """m starts `phase` now, lasting `steps` steps (0: until an outside event)."""
        self._set_work(m, phase)
        m.phase, m.phase_v, m.phase_i = phase, self.steps, self._last_i()
        m.target_v = self.steps + steps if steps > 0 else math.inf
        if steps > 0:
            self._push(m)

    def _push(self, m: Member) -> None:
        self._pushed += 1  # unique tie-breaker: members never compare
        heapq.heappush(self._heap, (m.target_v, self._pushed, m))

    def _set_work(self, m: Member, phase: str) -> None:
        if phase in ("decode", "draft"):
            hit = self.timing.member_work(1, m.context_tokens)
            work = (1, hit[0], hit[1], m.draft_overhead_s if phase == "draft" else 0.0)
        elif phase == "verify":
            work = m._verify_work
        else:
            work = (0, 0.0, 0.0, 0.0)
        old = m.work
        idle = not self._seqs  # (a member changing its own work leaves the batch busy)
        self._verifying += (phase == "verify" and work[0] > 0) - \
            (m.phase == "verify" and old[0] > 0)
        if old[0]:
            self._tokens -= old[0]
            self._flops -= old[1]
            self._kv -= old[2]
            self._overhead -= old[3]
            self._seqs -= 1
            self._ctx -= m.context_tokens
        if work[0]:
            if idle:  # the batch leaves idle: its steps count from here
                self._origin = self.steps
            self._tokens += work[0]
            self._flops += work[1]
            self._kv += work[2]
            self._overhead += work[3]
            self._seqs += 1
            self._ctx += m.context_tokens
        if self._seqs == 0:  # no float residue once the batch is idle
            self._tokens, self._flops, self._kv, self._overhead, self._ctx = 0, 0.0, 0.0, 0.0, 0
        m.work = work

    def _start_verify(self, m: Member, proposed: int) -> None:
        m.proposed = proposed
        accepted = int(m.sample_accepted(proposed)) if m.sample_accepted else 0
        if not 0 <= accepted <= proposed:
            raise ValueError(f"acceptance model returned {accepted} of {proposed} drafted tokens")
        m.accepted, m.verify_start_t = accepted, self.env.now
        flops, kv = self.timing.member_work(proposed, m.context_tokens)
        m._verify_work = (proposed, flops, kv, 0.0)
        self._enter(m, "verify", 1)

    def _reached(self, m: Member) -> None:
        """m's clock target is reached now: next phase, or leave."""
        if m.phase == "join":
            start, m.pending = m.pending, None
            if start is not None:
                start()
            return
        if m.phase == "draft":
            m.draft_end_t, m.draft_end_i = self.env.now, self._last_i()
            if m.full_ready:
                proposed = round(m.target_v - m.draft_v)
                self._after_load(m, lambda: self._start_verify(m, proposed))
            else:
                self._enter(m, "wait", 0)
        elif m.phase == "verify":
            m.verify_end_t = self.env.now
            rest = m.tokens - m.accepted - 1
            if rest > 0:
                self._enter(m, "decode", rest)
            else:
                self._leave(m)
        else:
            self._leave(m)

    def _leave(self, m: Member) -> None:
        self._set_work(m, "gone")
        m.phase, m.target_v = "gone", math.inf
        self._live.discard(m)
        m.timeline = self._timeline(m)
        if m._done is not None:
            m._done.succeed(m.timeline)
        self._left.append(m)

    # ---- token times -------------------------------------------------------------------
    def _times(self, from_i: int, to_i: int, v0: float, n: int) -> np.ndarray:
        """[n] times (s) at which the clock reads v0 + 1 .. v0 + n, from the breakpoints
        from_i..to_i of one phase of a member (it computes throughout, so the clock is
        strictly increasing there; outside, it may stand still)."""
        steps = _counts(n)  # [n] 1..n
        from_i, to_i = from_i - self._bp0, to_i - self._bp0  # positions in bp_t / bp_v
        if to_i == from_i + 1:  # one rate throughout: closed form
            t0, t1 = self.bp_t[from_i], self.bp_t[to_i]
            v_from, v_to = self.bp_v[from_i], self.bp_v[to_i]
            return t0 + (v0 - v_from + steps) * ((t1 - t0) / (v_to - v_from))
        # views of the breakpoints (no copy, no format parsing), which die with this call:
        # an array cannot grow while a view of it lives
        count, offset = to_i + 1 - from_i, 8 * from_i
        return np.interp(v0 + steps, np.frombuffer(self.bp_v, np.float64, count, offset),
                         np.frombuffer(self.bp_t, np.float64, count, offset))

    def _timeline(self, m: Member) -> DecodeTimeline:
        now, k = self.env.now, m.tokens
        if m.proposed == 0:  # plain decode from the full cache (after a wait with cap 0)
            times = self._times(m.phase_i, self._last_i(), m.phase_v, k)
            times[-1] = now
            tl = DecodeTimeline(times, m.start_t, m.full_t, tpot_s=(now - m.full_t) / k,
                                segments=[("decode", m.full_t, now)])
            if m.full_t > m.start_t:
                tl.segments.insert(0, ("wait", m.start_t, m.full_t))
            return tl
        a = m.accepted
        head = min(a, k)
        drafted = self._times(m.draft_i, m.draft_end_i, m.draft_v, m.proposed)  # [n] s
        v_end = m.verify_end_t
        times = np.empty(k)
        times[:head] = drafted[:head]
        if k > a:
            times[a] = v_end
        rest = k - a - 1
        if rest > 0:
            times[a + 1:] = self._times(m.phase_i, self._last_i(), m.phase_v, rest)
            times[-1] = now
        t_acc = float(drafted[a - 1]) if a else m.start_t
        seg = [("draft_accepted", m.start_t, t_acc), ("draft_rejected", t_acc, m.draft_end_t)]
        if m.verify_start_t > m.draft_end_t:
            seg.append(("wait", m.draft_end_t, m.verify_start_t))
        seg.append(("verify", m.verify_start_t, v_end))
        if rest > 0:
            seg.append(("decode", v_end, now))
        # committed: drafts count once verification accepts them
        return DecodeTimeline(
            times, m.start_t, m.full_t, m.proposed, a, m.verify_start_t, v_end - m.verify_start_t,
            (m.draft_end_t - m.start_t) / m.proposed, (now - v_end) / rest if rest > 0 else 0.0,
            seg, min(a + 1, k), v_end, float(drafted[0]))

    # ---- the fluid clock ---------------------------------------------------------------
    def _advance(self) -> None:
        now = self.env.now
        if now > self.last_t and self._seqs:
            self.steps += (now - self.last_t) / self.step_s
        self.last_t = now

    def _changed(self) -> None:
        """The batch changed now: new step time, a clock breakpoint, the next target."""
        self.changes += 1
        if not self._seqs:
            self.step_s = math.inf
        else:
            self.step_s = self.timing.batch_pass_s(
                self._tokens, self._flops, self._kv, self._seqs, self._ctx,
                self._verifying) + self._overhead
            if self._prefills:
                self.step_s *= self.timing.beside_prefill_ratio(self._seqs)
            if self._received:
                busy = min(1.0, sum(self._received.values()))
                if busy > 0.0:  # (extra / (step + extra) = 1 - 1/r)
                    extra_s = self.timing.beside_worker_extra_s()
                    self.step_s /= 1.0 - busy * extra_s / (self.step_s + extra_s)
        self._mark()
        self._arm()

    def _mark(self) -> None:
        if self.bp_t[-1] == self.env.now:
            self.bp_v[-1] = self.steps
        else:
            self.bp_t.append(self.env.now)
            self.bp_v.append(self.steps)
            if len(self.bp_t) >= self._trim_at:
                self._trim()

    def _last_i(self) -> int:
        """The absolute index of the latest breakpoint."""
        return self._bp0 + len(self.bp_t) - 1

    def _trim(self) -> None:
        """Drop the breakpoints before the first one a member in the batch may still read:
        its phase's start, and a drafting member's first draft (its timeline reads both
        when it leaves). Results are unchanged: only positions shift."""
        need = self._last_i()
        for m in self._live:
            need = min(need, m.phase_i)
            if m.cap > 0 and m.sample_accepted is not None:
                need = min(need, m.draft_i)
        drop = need - self._bp0
        if drop > 0:
            del self.bp_t[:drop]
            del self.bp_v[:drop]
            self._bp0 = need
        self._trim_at = max(_TRIM_BREAKPOINTS, 2 * len(self.bp_t))

    def _arm(self) -> None:
        heap = self._heap
        while heap and heap[0][0] != heap[0][2].target_v:
            heapq.heappop(heap)  # stale: the member moved on or left
        target = heap[0][0] if heap else math.inf
        if math.isinf(target) or not self._seqs:
            self._timer, self._timer_v, self._timer_t = None, math.inf, math.inf
            return
        delay = max(0.0, (target - self.steps) * self.step_s)
        t = self.env.now + delay
        if target == self._timer_v and t == self._timer_t and self._timer is not None:
            return  # same target at the same rate: the armed timer stands
        self._timer = call_later(self.env, delay, self._on_timer)
        self._timer_v, self._timer_t = target, t

    def _on_timer(self, event: Timer) -> None:
        if event is not self._timer:
            return  # superseded: the batch changed before this target was reached
        target = self._timer_v
        self._timer, self._timer_v, self._timer_t = None, math.inf, math.inf
        self._advance()
        self.steps = target  # exact: the timer was set for this clock value
        self._mark()
        heap = self._heap
        while heap and heap[0][0] <= target + _EPS_STEPS:
            v, _seq, m = heapq.heappop(heap)
            if v == m.target_v:
                self._reached(m)
        self._changed()
        if self._left:
            left, self._left = self._left, []
            for m in left:
                if m.on_leave is not None:
                    m.on_leave(m)
