"""Application-level link emulator shared by every stream of one link (the "token bucket").

A serializing link of `rate_gbps` modelled by its busy-until time: a message of n bytes
starts crossing when it is ready and the link is free, start = max(ready, busy_until), and
its last byte has crossed at start + n / rate; the sender hands it to the socket then (pay
before send), less an optional lead of `burst_bytes` / rate. The link is then busy until
start + n / rate. So a stream of messages leaves at exactly the rate, the first one waits
its own transfer time on an idle link (as the simulator's fluid link), and a link loop that
wakes up late loses no capacity: the next message's start is the earlier busy-until, not the
late wake-up. A link with messages queued is busy whatever the thread feeding it does, so
the lateness caught up is the sending thread's own: on CPython a thread that wants the
interpreter lock back waits up to its switch interval (5 ms) while another thread of the
process (the encoder) runs Python, and on a 2-core host the encoder, the link loop and the
receiver share the cores. Caught up within 2 ms only, those waits cost a split-stream
anchor 8-12 ms at 1 Gbps (240 chunks, CHANGELOG.md 2026-12-06); `MAX_LAG_S` covers a few
switch intervals. A message held back for another reason (no credit: the receiver has not
processed what is in flight) is ready when the caller finds the reason gone, which it says
(`ready_t`; the link loop: when it sees credit again, up to a poll after the ACK came): the
link idles meanwhile and no burst above the rate follows. A lag beyond
`max_lag_s` (the process stopped) counts as idle link time too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# lateness of the link loop caught up (s): four of CPython's default thread switch intervals
MAX_LAG_S = 0.020


class TokenBucket:
    def __init__(self, rate_gbps: float, burst_bytes: int = 0,
                 clock: Callable[[], float] = time.time, max_lag_s: float = MAX_LAG_S) -> None:
        """burst_bytes: how far ahead of its last byte's crossing a message may be handed to
        the socket (0: exactly then)."""
        if not (isinstance(rate_gbps, (int, float)) and math.isfinite(rate_gbps)
                and rate_gbps > 0):
            raise ValueError(f"token bucket rate_gbps must be a finite number > 0, "
                             f"got {rate_gbps!r}")
        if burst_bytes < 0:
            raise ValueError(f"token bucket burst_bytes must be >= 0, got {burst_bytes}")
        self.rate_gbps = float(rate_gbps)
        self.rate_bytes_per_s = rate_gbps * 1e9 / 8
        self.burst_bytes = int(burst_bytes)
        self.clock, self.max_lag_s = clock, float(max_lag_s)
        self.busy_until_t = -math.inf  # the link is idle
        self._start_t: float | None = None  # start of the message waiting to go

    def delay_s(self, size_bytes: int, ready_t: float | None = None) -> float:
        """Seconds until a message of `size_bytes` may go (0: now). ready_t: when it could
        first have gone, released to the link and with credit to go (clock seconds;
        default: this first call for it)."""
        now = self.clock()
        if self._start_t is None:
            ready = now if ready_t is None else min(now, ready_t)
            self._start_t = max(ready, self.busy_until_t, now - self.max_lag_s)
        elif ready_t is not None:  # another message took the head since the first call (a
            # better one released, or one that waited for credit): not before it was ready
            self._start_t = max(self._start_t, min(now, ready_t))
        leave_t = self._start_t + (size_bytes - self.burst_bytes) / self.rate_bytes_per_s
        left = leave_t - now
        return left if left > 1e-9 else 0.0  # below a nanosecond: float rounding

    def consume(self, size_bytes: int) -> None:
        """The message goes (call when delay_s() returned 0): the link is busy with it."""
        start = self._start_t if self._start_t is not None else \
            max(self.clock(), self.busy_until_t)
        self.busy_until_t = start + size_bytes / self.rate_bytes_per_s
        self._start_t = None


class Unlimited:
    """No application-level limit (the `tc` emulation or an unshaped run)."""

    rate_gbps = math.inf

    def delay_s(self, size_bytes: int, ready_t: float | None = None) -> float:
        return 0.0

    def consume(self, size_bytes: int) -> None:
        """Nothing to account: the link below paces itself."""
