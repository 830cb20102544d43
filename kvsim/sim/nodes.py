"""Prefill and decode instances (simpy actors' state) and the per-flow receive pipeline."""

from __future__ import annotations

import math

import numpy as np
import simpy

from kvsim.sim.link import Flow, Link
from kvsim.sim.policy import FlowPlan, serial_pipeline


class PrefillNode:
    """One prefill instance: runs one prefill at a time (FIFO) and owns one serial encoder
    whose chunks leave on `link`."""

    def __init__(self, env: simpy.Environment, index: int, link: Link) -> None:
        self.name = f"prefill{index}"
        self.slot = simpy.Resource(env, capacity=1)
        self.encoder_free_t = 0.0
        self.link = link
        self.queued = 0  # requests assigned and not yet through prefill


class DecodeNode:
    """One decode instance: up to `max_batch` sequences decode concurrently."""

    def __init__(self, env: simpy.Environment, index: int, max_batch: int) -> None:
        self.name = f"decode{index}"
        self.slot = simpy.Resource(env, capacity=max_batch)
        self.assigned = 0  # requests routed here and not finished

    @property
    def active(self) -> int:
        return self.slot.count


class Receiver:
    """Deserializes one flow on the decode node: a serial pipeline over its messages in
    arrival order (`pipelined`), or everything after the last arrival (monolithic).
    `ready` fires when the last message is deserialized."""

    def __init__(self, env: simpy.Environment, plan: FlowPlan, pipelined: bool) -> None:
        self.env, self.plan, self.pipelined = env, plan, pipelined
        self.ready = env.event()
        self._arrivals: list[np.ndarray] = []
        self.received_bytes = 0.0
        self.last_arrival_t = math.nan
        self.ready_t = math.nan
        self.first_arrival_t = math.nan

    def delivered(self, flow: Flow, j0: int, j1: int, arrival_t: np.ndarray) -> None:
        # arrivals come in order; the pipeline is evaluated once, when the flow is done
        # (nothing reads partial deserialization state), which keeps per-event cost low
        self._arrivals.append(arrival_t)
        self.received_bytes += flow.cum_l[j1 - 1] - (flow.cum_l[j0 - 1] if j0 else 0.0)

    def done(self, flow: Flow) -> None:
        arrival = np.concatenate(self._arrivals)  # [m] s, every message of the flow
        self.first_arrival_t, self.last_arrival_t = float(arrival[0]), float(arrival[-1])
        if self.pipelined:
            self.ready_t = float(serial_pipeline(arrival, self.plan.deserialize_s)[-1])
        else:
            self.ready_t = self.last_arrival_t + float(self.plan.deserialize_s.sum())
        timer = self.env.timeout(max(0.0, self.ready_t - self.env.now))
        timer.callbacks.append(lambda _ev: self.ready.succeed(self.ready_t))
