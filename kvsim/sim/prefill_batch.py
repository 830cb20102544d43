"""Chunked prefill batching on one prefill instance (`workload.prefill_chunk_tokens` > 0).

The instance runs forward steps of at most `chunk_tokens` prompt tokens, filled first come,
first served from its queue: a step takes the rest of the oldest request's prompt, then
the head of the next one, and so on, so a step can carry the tail of one prompt and the
start of another (Sarathi-style chunks; decoding runs on the decode instances, so a
prefill step holds prompt tokens only). Step time (TimingModel.prefill_step_s): the
roofline of one forward over the step's parts, each part n new tokens of a request after
the c tokens of its prompt already prefilled (FLOPs of n queries over c + n keys, the KV of
c + n tokens read); the weights are read once per step, which is what batching short
prompts gains. A prompt of at most chunk_tokens alone on the instance takes one step of
exactly prefill_s(tokens).

A request learns its prefill times when its last chunk's step starts: every layer of its
cache is complete `(layer + 1) / layers` of that step later (its earlier chunks have
passed every layer already), so its chunks are released to the encoder from then on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import simpy

from kvsim.scenario.timing_model import TimingModel


@dataclass
class PrefillJob:
    """One request's prompt in the chunked prefill queue (tokens; times in s)."""

    seq: int
    tokens: int
    last_step: simpy.Event  # succeeds (no value) at the start of the step with its last tokens
    done_tokens: int = 0
    first_step_t: float = -1.0  # start of the first step carrying its tokens
    last_step_s: float = 0.0  # duration of the step carrying its last tokens


class ChunkedPrefill:
    """The step loop of one prefill instance (a simpy process started on first use)."""

    def __init__(self, env: simpy.Environment, timing: TimingModel, chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.env, self.timing, self.chunk_tokens = env, timing, int(chunk_tokens)
        self.queue: deque[PrefillJob] = deque()
        self._wake: simpy.Event | None = None
        self.steps = 0
        env.process(self._run())

    def submit(self, seq: int, tokens: int, cached_tokens: int = 0) -> PrefillJob:
        """Queue a prompt of `tokens`, the first `cached_tokens` of them already computed
        (a prefix cache's hit: prefilled as if by earlier chunks)."""
        job = PrefillJob(seq, int(tokens), self.env.event(), done_tokens=int(cached_tokens))
        self.queue.append(job)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        return job

    def _run(self):
        env = self.env
        while True:
            if not self.queue:
                self._wake = env.event()
                yield self._wake
                continue
            # fill the step first come, first served: [(job, new tokens)]
            budget, parts = self.chunk_tokens, []
            for job in self.queue:
                n = min(budget, job.tokens - job.done_tokens)
                parts.append((job, n))
                budget -= n
                if budget == 0:
                    break
            step_s = self.timing.prefill_step_s([(n, job.done_tokens) for job, n in parts])
            now = env.now
            for job, n in parts:
                if job.first_step_t < 0:
                    job.first_step_t = now
                job.done_tokens += n
                if job.done_tokens == job.tokens:  # its last chunk: tell the request now
                    job.last_step_s = step_s
                    self.queue.remove(job)
                    # no value: an event holding its job, held by the job, would be a
                    # reference cycle per request (freed only by the cyclic collector)
                    job.last_step.succeed()
            self.steps += 1
            yield env.timeout(step_s)
