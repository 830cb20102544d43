"""One decode host's continuous batch: the members' steps, their slots, the host's instances.

The simulator's decode instance (kvsim.sim.batch) advances every member of its batch one
token per forward step, the step's length set by the whole batch. Here the same happens in
real time: each request's decode loop posts its share of the next step and blocks; a
stepping thread starts a step once every computing member has posted, runs it and releases
them all at its end. `ContinuousBatch` is that machinery; what a step is differs:

  StepBatch   timing-model decode (`transport.decode=timing`): a `TimingDecodeLoop` posts a
              `StepWork`; the step sleeps its length (`TimingModel.batch_pass_s` over the
              members' summed work, plus each drafting member's overhead, times the time
              scale).
  ModelBatch  real decode (`transport.decode=real`, kvsim.transport.model_batch): a
              `RealDecodeLoop` posts the tokens it feeds; the step is one forward of the
              model over every member's cache.

A request that
becomes ready while a step runs joins at the next one; one that waits for streams or
dequantizes pauses (it computes nothing and the batch does not wait for it); one that is
done leaves. So joins and leaves happen between steps, as iteration-level scheduling does
and as the simulator's batch admits its members (kvsim.sim.batch: at the step boundary).

Instances: a decode host runs `workload.decode_nodes` batches (`DecodeInstances`); a request
goes to one by `workload.routing` (least_loaded: the fewest requests assigned, the first of
equals; round_robin), as the simulator routes at arrival, here when the decode host admits
the request's HELLO (after its prefill: an assignment can differ from the simulator's where
a request ends in between). `decode_max_batch=1` is an instance that decodes one request
at a time: the others assigned to it wait for its slot, as in the simulator.

Slots: at most `max_batch` requests hold a place in the batch (first come, first served,
from their first step to their end), as `workload.decode_max_batch` bounds the simulator's.

Back-to-back timed steps (some member of the new step was in the previous one and has not
paused since) are planned from the previous step's planned end, so the threads' wake-up
delays (a receiver busy dequantizing holds the interpreter) do not add up from step to
step; any other step (the batch was idle, or its members come back from a load) starts now.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from kvsim.scenario.timing_model import TimingModel
from kvsim.transport.routing import check_routing, route_index

Clock = Callable[[], float]

# a back-to-back step this late after the previous one's planned end (clock s) starts now:
# beyond any wake-up delay, the schedule is not caught up
_CATCH_UP_S = 0.25
_IDLE_EXIT_S = 2.0  # the stepping thread ends after this long with no member (clock s)
_POLL_S = 0.5  # the stepping thread re-checks stalled members at least this often (s)
# a step with a member whose overhead follows the receiver is re-timed this often (clock s)
_FLUID_SLICE_S = 0.005
_CANCEL_POLL_S = 0.1  # a waiting member checks whether its request was dropped this often (s)


@dataclass(frozen=True)
class StepWork:
    """One member's share of the next step: its new tokens (1 drafting or decoding, n
    verifying n drafts), their FLOPs and bf16 KV bytes read (TimingModel.member_work), its
    prompt tokens, the modelled s it adds to the step (a drafting member's overhead), and
    whether the step is its verification pass. overhead_now, where given, replaces
    overhead_s by a reading taken while the step runs (a drafting member's overhead that
    follows its receiver's worker, which may finish mid-step): the step then advances at
    1 / (its length with the overheads now), re-read every _FLUID_SLICE_S, as the
    simulator's fluid batch re-times a step in progress when a member's overhead ends."""

    new_tokens: int
    flops: float
    kv_read_bytes: float
    context_tokens: int
    overhead_s: float = 0.0
    verifying: bool = False
    overhead_now: Callable[[], float] | None = None


class ContinuousBatch(ABC):
    """See the module docstring: the members, their slots and the stepping thread; a
    subclass says what one step is (`_begin_step` with the lock held, `_run_step` without).
    Thread-safe; one per decode instance."""

    def __init__(self, max_batch: int, clock: Clock = time.time,
                 sleep: Callable[[float], None] = time.sleep, wait_timeout_s: float = 600.0,
                 stall_s: float = 30.0, log: Callable[[str], None] | None = None) -> None:
        if int(max_batch) < 1:
            raise ValueError(f"a decode batch needs max_batch >= 1, got {max_batch}")
        self.max_batch = int(max_batch)
        self.clock, self.sleep = clock, sleep
        self.wait_timeout_s, self.stall_s = float(wait_timeout_s), float(stall_s)
        self.log = log or (lambda msg: None)
        # reentrant (Condition's default), so a subclass may extend a locked method
        self._cond = threading.Condition()
        self._computing: set[Hashable] = set()  # members that take part in the next step
        self._posted: dict[Hashable, Any] = {}  # their work for it, as they post
        self._released_t: dict[Hashable, float] = {}  # when each was last released (clock)
        self._started = 0  # steps started ...
        self._finished = 0  # ... and finished
        self._error = ""  # the stepping thread's last failure ...
        self._failed_step = 0  # ... in this step: its members fail with it, later ones not
        # the members of the last step that have not paused since (their next post is
        # back to back with it)
        self._last_members: set[Hashable] = set()
        # the members of the step in progress still in it (a dropped request leaves; a
        # step that none is left in ends at once)
        self._running: set[Hashable] = set()
        self._thread: threading.Thread | None = None
        # slots: holders and the queue of waiting tickets (first come, first served)
        self._holders = 0
        self._queue: deque[int] = deque()
        self._tickets = 0
        # what a run did: steps run and the most members one step had
        self.steps = 0
        self.widest = 0
        self.assigned = 0  # requests routed here and not yet done (DecodeInstances)

    # ---- slots ---------------------------------------------------------------------------
    def _wait(self, done: Callable[[], bool], cancelled: Callable[[], str]) -> str:
        """Wait (holding the lock) until done(): 'done', 'cancelled' (cancelled() said why),
        or 'timeout' after wait_timeout_s."""
        deadline = time.monotonic() + self.wait_timeout_s
        while not done():
            if cancelled():
                return "cancelled"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            self._cond.wait(min(left, _CANCEL_POLL_S))
        return "done"

    def take_slot(self, cancelled: Callable[[], str] = str) -> bool:
        """Block until this caller holds one of the batch's max_batch places (first come,
        first served): True; False when cancelled() says the request was dropped first;
        TimeoutError after wait_timeout_s."""
        with self._cond:
            ticket = self._tickets
            self._tickets += 1
            self._queue.append(ticket)
            got = self._wait(
                lambda: self._queue[0] == ticket and self._holders < self.max_batch,
                cancelled)
            self._queue.remove(ticket)
            self._cond.notify_all()
            if got == "cancelled":
                return False
            if got == "timeout":
                raise TimeoutError(f"no place in the decode batch (max_batch {self.max_batch}, "
                                   f"all held) within {self.wait_timeout_s:g} s")
            self._holders += 1
            return True

    def give_slot(self) -> None:
        with self._cond:
            if self._holders <= 0:
                raise RuntimeError("a decode batch slot given back that no one held")
            self._holders -= 1
            self._cond.notify_all()

    # ---- steps ---------------------------------------------------------------------------
    def _post(self, member: Hashable, work: Any, cancelled: Callable[[], str]) -> bool:
        """Take part in the next step with `work`: True when that step has ended; False
        when cancelled() says the request was dropped first (the member is out of the
        batch; a step it was in goes on for the others)."""
        with self._cond:
            self._computing.add(member)
            self._posted[member] = work
            target = self._started + 1  # the step that will take this post
            if self._thread is None:
                self._start_thread()
            self._cond.notify_all()
            got = self._wait(
                lambda: self._finished >= target or self._failed_step >= target, cancelled)
            if got != "done" or self._failed_step >= target:  # out of the batch
                self._computing.discard(member)
                self._posted.pop(member, None)
                self._last_members.discard(member)
                self._running.discard(member)
                self._cond.notify_all()
            if got == "cancelled":
                return False
            if self._failed_step >= target:
                raise RuntimeError(f"decode batch failed: {self._error}")
            if got == "timeout":
                raise TimeoutError(f"the decode batch's step did not end within "
                                   f"{self.wait_timeout_s:g} s")
            return True

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvsim-decode-batch",
                                        daemon=True)
        self._thread.start()

    def pause(self, member: Hashable) -> None:
        """The member computes nothing until its next `step` (it waits for streams,
        dequantizes, or is done): the batch stops waiting for it."""
        with self._cond:
            self._computing.discard(member)
            self._posted.pop(member, None)
            self._released_t.pop(member, None)
            self._last_members.discard(member)
            self._cond.notify_all()

    def _ready(self) -> bool:
        return bool(self._computing) and self._computing <= self._posted.keys()

    def _drop_stalled(self) -> None:
        """A member released from a step that has not posted again within stall_s is
        paused (a decode loop always posts or pauses right after a step: this is a guard,
        and says so)."""
        now = self.clock()
        for member in [m for m in self._computing if m not in self._posted]:
            if now - self._released_t.get(member, now) > self.stall_s:
                self.log(f"decode batch: member {member!r} neither stepped nor paused for "
                         f"{self.stall_s:g} s; the batch goes on without it")
                self._computing.discard(member)
                self._released_t.pop(member, None)

    def _run(self) -> None:
        """The stepping thread; any failure fails the step it was in (its members raise),
        and the next post starts a new thread."""
        with self._cond:
            try:
                self._step_loop()
            except BaseException as exc:
                self._idle()  # what the step left half done is not used again
                self._error = f"{type(exc).__name__}: {exc}"
                self._failed_step = self._started  # its members leave (see step)
                self._thread = None
                if self._posted:  # members already waiting for the next step get a thread
                    self._start_thread()
                self._cond.notify_all()

    def _step_loop(self) -> None:
        """Steps while members post (the caller holds the lock; it is released while a
        step sleeps); returns after _IDLE_EXIT_S with no member."""
        cond = self._cond
        idle_since = self.clock()
        while True:
            while not self._ready():
                if not self._computing and not self._posted and \
                        self.clock() - idle_since > _IDLE_EXIT_S:
                    self._thread = None
                    self._idle()
                    return
                cond.wait(_POLL_S)
                self._drop_stalled()
            works, self._posted = self._posted, {}
            self._started += 1
            plan = self._begin_step(works)
            self._running = set(works)
            cond.release()
            try:
                self._run_step(plan)
            finally:
                cond.acquire()
            self._finished = self._started
            self.steps += 1
            self.widest = max(self.widest, len(works))
            idle_since = self.clock()
            # released now (the stall guard counts from here, whoever wakes first); a
            # member dropped during the step has left
            for member in works:
                if member in self._running:
                    self._released_t[member] = idle_since
            self._last_members = set(works)
            cond.notify_all()

    @abstractmethod
    def _begin_step(self, works: dict[Hashable, Any]) -> Any:
        """What the step over `works` (member -> its post) needs, read with the lock held."""

    @abstractmethod
    def _run_step(self, plan: Any) -> None:
        """Run the step `_begin_step` planned (the lock is released meanwhile)."""

    def _idle(self) -> None:  # noqa: B027 (optional hook)
        """The stepping thread ends (no member for a while, or a step failed): state kept
        between steps may go."""


class StepBatch(ContinuousBatch):
    """The timing-model batch (see the module docstring): a step sleeps its modelled length."""

    def __init__(self, timing: TimingModel, max_batch: int, **batch_kw) -> None:
        super().__init__(max_batch, **batch_kw)
        self.timing = timing
        self._planned_end = -float("inf")  # the last step's planned end (clock s)
        self._scale = 0.0  # clock s per modelled s (the members' HELLOs; 0: none yet)

    def give_slot(self) -> None:
        with self._cond:
            super().give_slot()
            if self._holders == 0 and not self._computing:
                self._scale = 0.0  # the next request may bring another time scale

    def step(self, member: Hashable, work: StepWork, time_scale: float,
             cancelled: Callable[[], str] = str) -> bool:
        """Take part in the next step with `work` (see `_post`). time_scale: clock s per
        modelled s (one per batch: the first member's)."""
        if work.new_tokens < 1:
            raise ValueError(f"a step member needs new_tokens >= 1, got {work.new_tokens}")
        with self._cond:
            if self._scale == 0.0:
                self._scale = float(time_scale)
            elif float(time_scale) != self._scale:
                raise ValueError(f"a decode batch runs at one time scale: this request's "
                                 f"{time_scale:g}, the batch's {self._scale:g}")
        return self._post(member, work, cancelled)

    def _begin_step(self, works: dict[Hashable, Any]) -> tuple[float, float, list]:
        base_s = self._step_model_s(list(works.values()))  # modelled s
        dynamic = [w.overhead_now for w in works.values() if w.overhead_now is not None]
        now = self.clock()
        back_to_back = not self._last_members.isdisjoint(works) and \
            now - self._planned_end < _CATCH_UP_S
        return (self._planned_end if back_to_back else now), base_s, dynamic

    def _run_step(self, plan: tuple[float, float, list]) -> None:
        end = self._sleep_step(*plan)
        with self._cond:
            self._planned_end = end

    def _sleep_step(self, t0: float, base_s: float,
                    dynamic: list[Callable[[], float]]) -> float:
        """Sleep one step begun at clock t0 (modelled length base_s, plus the dynamic
        overheads read as it runs); returns its planned end (clock s)."""
        if not dynamic:
            end = t0 + self._scale * base_s
            left = end - self.clock()
            while left > 0:
                if not self._running:  # every member was dropped: the step ends here
                    return self.clock()
                self.sleep(min(left, _CANCEL_POLL_S))
                left = end - self.clock()
            return end
        t, left = t0, 1.0  # share of the step still to run
        while left > 1e-9:
            if not self._running:
                return self.clock()
            length = self._scale * (base_s + sum(f() for f in dynamic))  # clock s now
            slice_s = min(left * length, _FLUID_SLICE_S)
            t += slice_s
            left -= slice_s / length
            wait = t - self.clock()
            if wait > 0:
                self.sleep(wait)
        return t

    def _step_model_s(self, works: list[StepWork]) -> float:
        """Modelled s of one step over `works` (the simulator's batch formula)."""
        return self.timing.batch_pass_s(
            sum(w.new_tokens for w in works), sum(w.flops for w in works),
            sum(w.kv_read_bytes for w in works), len(works),
            sum(w.context_tokens for w in works), sum(w.verifying for w in works)) \
            + sum(w.overhead_s for w in works)


class DecodeInstances:
    """A decode host's decode instances, one batch each (see the module docstring), made by
    `make_batch()`: StepBatch for timing-model decoding, ModelBatch for real."""

    def __init__(self, make_batch: Callable[[], ContinuousBatch], nodes: int,
                 routing: str = "least_loaded") -> None:
        if int(nodes) < 1:
            raise ValueError(f"a decode host needs decode_nodes >= 1, got {nodes}")
        self.batches = [make_batch() for _ in range(int(nodes))]
        self.routing = check_routing(routing, "decodes")
        self._routed = 0
        self._lock = threading.Lock()

    def assign(self) -> ContinuousBatch:
        """The request's instance: least_loaded, the one with the fewest requests assigned
        (the first of equals); round_robin, by the order requests are assigned. Its count
        is raised; `done` lowers it when the request ends."""
        with self._lock:
            batch = self.batches[route_index([b.assigned for b in self.batches],
                                             self.routing, self._routed)]
            self._routed += 1
            batch.assigned += 1
            return batch

    def done(self, batch: ContinuousBatch) -> None:
        with self._lock:
            if batch.assigned <= 0:
                raise RuntimeError("a request reported done on a decode instance twice")
            batch.assigned -= 1


__all__ = ["ContinuousBatch", "DecodeInstances", "StepBatch", "StepWork"]
