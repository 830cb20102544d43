"""How fast the receiver's on-arrival worker dequantizes on a host that runs both ends.

`kvsim emulate` runs the sender (prefill, encoder, link loop) and the decode host (receiver,
on-arrival worker, decode loop) on the same cores. The worker's layer jobs then take longer
while the request's encoder runs beside them and while the request's bytes are taken in
(sockets, frame checks, copies; over a `tc`-shaped veth the kernel's shaping too), and less
once both are over: on the 2-core host a 2048-token lynx anchor's layer job took 3.1-4.5 ms
at 0.1 / 0.3 Gbps and 5.1-7.1 ms at 1 Gbps, where the encoder runs beside the whole anchor
(CHANGELOG.md, 2026-12-06). The codec timing's layer job (kvsim.scenario.codec_timing,
fitted on the calibration transfer at 0.3 Gbps, where most jobs run while bytes arrive)
holds only there.

The simulator's model (kvsim.sim.nodes.WorkPace, applied by kvsim.sim.run): a job of
the codec timing's length b takes

    b x alone x (1 + encoder x E + ingest x G)

where E is the share of the job during which its request's encoder runs and G the share
during which its request's bytes arrive (from the first send to the last arrival). The
extra while bytes arrive is one share, not one per byte: over the full grid's jobs, a term
in proportion to the arrival rate, fitted at 0.3 Gbps and on lynx at 1 Gbps, put the
monolithic codecs' jobs at 1 Gbps 19-38% above the measured ones, and a share within 1.4%.
`fit` finds (alone, encoder, ingest) from every on-arrival layer job of a link's calibration
transfers, at two rates at least (at one, nearly every job runs while bytes arrive); the link
profile keeps them as `worker_pace`. `alone` is the median of job / codec timing over the
jobs that run after both spans, where there are MIN_ALONE_JOBS of them, and encoder and
ingest are then fitted by non-negative least squares with it held. A joint least squares
of all three lets `alone` take the ingest term's share: nine in ten jobs run while bytes
arrive, so the sum of squares hardly sees the few jobs that measure `alone`. In one
calibration of 2026-12-07 it put `alone` at 1.08 with ingest 0.00 where the jobs after
both spans took 0.77-0.89 of the codec timing (CHANGELOG.md, 2026-12-07). With fewer such
jobs the joint fit stands. The fit takes E and G as shares of a job's time, the simulator's
work clock as shares of its work (a job runs 1 + extra times slower in a span): the two agree
for a job wholly inside or outside each span, and differ a little for the one or two jobs of
a request that straddle a span's edge.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvsim.scenario.codec_timing import CodecTiming
from kvsim.scenario.link_profile import WORKER_PACE_FIELDS

FIELDS_MAX = {name: high for name, _low, high in WORKER_PACE_FIELDS}  # the profile's bounds
MIN_JOBS = 30  # fewer jobs than this do not fit three terms on a noisy host
MIN_ALONE_JOBS = 15  # jobs after both spans for `alone` from them alone (else a joint fit)


@dataclass(frozen=True)
class JobSamples:
    """On-arrival layer jobs of calibration requests, one entry per job."""

    job_s: np.ndarray  # [j] measured length (s)
    base_s: np.ndarray  # [j] the codec timing's length (s)
    encoder_share: np.ndarray  # [j] share of the job while its request's encoder ran
    ingest_share: np.ndarray  # [j] share while its request's bytes arrived
    requests: int
    rates_gbps: tuple[float, ...]


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def job_samples(rows: list[dict], timing_of: Callable[[dict], CodecTiming],
                layer_bf16_bytes: Callable[[int], float]) -> JobSamples:
    """The on-arrival layer jobs of `kvsim emulate` request rows (trace spans: the sender's
    "encode", the link's "transfer <stream>" spans, the worker's "dequantize layer L
    <streams>"). timing_of(row): the codec timing of its codec; layer_bf16_bytes(tokens):
    one layer's bf16 cache at that context (B). Rows without these spans are skipped."""
    cols: list[list[float]] = [[], [], [], []]
    requests, rates = 0, set()
    for row in rows:
        spans = row.get("trace_spans") or []
        if row.get("status") != "done" or row.get("dequantize") != "on_arrival":
            continue
        encode = [(float(a), float(b)) for name, process, a, b in spans
                  if name == "encode" and process == "prefill"]
        links = [(float(a), float(b)) for name, process, a, b in spans
                 if process == "link" and name.startswith("transfer ")]
        jobs = [(name.split(" ", 3)[3], float(a), float(b)) for name, process, a, b in spans
                if process == "decode" and name.startswith("dequantize layer ")]
        if not (encode and links and jobs):
            continue
        e0, e1 = encode[0]
        g0, g1 = min(a for a, _b in links), max(b for _a, b in links)
        timing = timing_of(row)
        layer_bytes = layer_bf16_bytes(int(row["context_tokens"]))
        split = int(row.get("streams") or 1) > 1
        for kind, a, b in jobs:
            if not b > a:
                continue
            cols[0].append(b - a)
            cols[1].append(float(timing.layer_job_s(layer_bytes,
                                                    anchor=split and kind == "stream 0")))
            cols[2].append(_overlap(a, b, e0, e1) / (b - a))
            cols[3].append(_overlap(a, b, g0, g1) / (b - a))
        requests += 1
        rates.add(float(row["bandwidth_gbps"]))
    arrays = [np.asarray(c, dtype=float) for c in cols]
    return JobSamples(*arrays, requests=requests, rates_gbps=tuple(sorted(rates)))


@dataclass(frozen=True)
class PaceFit:
    alone: float  # a job alone over the codec timing's job
    encoder: float  # its extra share while the request's encoder runs
    ingest: float  # its extra share while the request's bytes arrive
    jobs: int
    rms_s: float  # the fit's root-mean-square error per job (s)
    alone_jobs: int  # jobs after both spans that `alone` is the median of (0: a joint fit)


def fit(samples: JobSamples) -> PaceFit | None:
    """job_s = base x alone x (1 + encoder x encoder_share + ingest x ingest_share), every
    term >= 0 (scipy's nnls). With MIN_ALONE_JOBS jobs after both spans, alone = their
    median of job_s / base and (encoder, ingest) least squares of job_s / alone - base on
    (base x encoder_share, base x ingest_share); else one least squares of job_s on (base,
    base x encoder_share, base x ingest_share) = (alone, a, c), encoder = a / alone, ingest
    = c / alone. None with fewer than MIN_JOBS jobs, from transfers at one rate only, or
    where a term comes out beyond the profile's bounds (alone must be > 0)."""
    from scipy.optimize import nnls

    n = len(samples.job_s)
    if n < MIN_JOBS or len(samples.rates_gbps) < 2:
        return None
    b = samples.base_s
    after = (samples.encoder_share == 0) & (samples.ingest_share == 0)
    alone_jobs = int(after.sum()) if after.sum() >= MIN_ALONE_JOBS else 0
    if alone_jobs:
        alone = float(np.median(samples.job_s[after] / b[after]))
        if not 0 < alone <= FIELDS_MAX["alone"]:
            return None
        coef, _ = nnls(np.column_stack([b * samples.encoder_share, b * samples.ingest_share]),
                       samples.job_s / alone - b)
        encoder, ingest = float(coef[0]), float(coef[1])
    else:
        design = np.column_stack([b, b * samples.encoder_share, b * samples.ingest_share])
        coef, _ = nnls(design, samples.job_s)
        alone = float(coef[0])
        if not 0 < alone <= FIELDS_MAX["alone"]:
            return None
        encoder, ingest = float(coef[1]) / alone, float(coef[2]) / alone
    if encoder > FIELDS_MAX["encoder"] or ingest > FIELDS_MAX["ingest"]:
        return None
    predicted = b * alone * (1 + encoder * samples.encoder_share + ingest * samples.ingest_share)
    rms = math.sqrt(float(np.mean((predicted - samples.job_s) ** 2)))
    return PaceFit(alone, encoder, ingest, n, rms, alone_jobs)


def pace_entry(rows: list[dict], timing_of: Callable[[dict], CodecTiming],
               layer_bf16_bytes: Callable[[int], float], model_name: str
               ) -> dict | None:
    """A link profile's `worker_pace` from its calibration transfers' request rows, or None
    where they do not fit (too few jobs, one rate, out of bounds: see fit)."""
    samples = job_samples(rows, timing_of, layer_bf16_bytes)
    got = fit(samples)
    if got is None:
        return None
    return {"alone": got.alone, "encoder": got.encoder, "ingest": got.ingest,
            "model": model_name,
            "jobs": got.jobs, "requests": samples.requests, "rms_s": got.rms_s,
            # how many jobs after both spans `alone` is the median of (0: a joint fit)
            "alone_jobs": got.alone_jobs,
            "rates_gbps": list(samples.rates_gbps),
            "measured": "the on-arrival worker's layer jobs in the calibration transfers "
                        "over this link: a job = the codec timing's x alone x (1 + encoder "
                        "while its request's encoder runs + ingest while its bytes arrive); "
                        "alone: the median over the jobs after both (alone_jobs; 0: fitted "
                        "with the rest), encoder and ingest: non-negative least squares "
                        "(kvsim.calibrate.worker_pace)"}
