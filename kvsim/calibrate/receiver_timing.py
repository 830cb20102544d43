"""How long the transport's receiver takes to make a cache usable, measured on a real transfer.

The decode side dequantizes a request's streams either layer by layer as they arrive
(`transport.dequantize=on_arrival`, the default: a worker per request) or when it starts on
them (`on_demand`: the anchor alone, or every stream), then builds the model's cache. In a
separate process, on freshly received frames, with the receiver's threads beside it, that
costs more and varies more than the same codec call repeated in one process: so calibration
times it where it happens, in the receiver mode the profiles are for.

One calibration transfer (`kvsim emulate` on loopback through the token bucket at 0.3 Gbps,
slow enough that a split-stream codec's residual is still on the wire when its anchor is
loaded) of calibration prompts (their own text seed), `repeats` requests per codec (medians:
one load varies by tens of percent from the next). On demand, the decode loop's spans give
  "dequantize stream 0"       the anchor (split-stream) or the whole cache (one stream)
  "dequantize streams 0-N"    every stream of a split-stream codec
as GB/s of bf16 cache (the codec timing's unit). On arrival, the worker's per-layer spans
("dequantize layer L stream 0" / "... streams 0-N") summed over the layers give the anchor's
and the full cache's rates, and the decode loop's spans (on arrival they only build the cache
from the dequantized layers) the cache build rate (hardware `cache_build`). Each request's decode
steps on its full cache give tpot_s: the same model step as the in-process calibration
measures, in the receiver's process. The sender's encoder is timed there too (its FIN's
encode_work_s: encode + checksum over the layers, beside its link loop and the receiver on
the same cores: 2-4x slower on a 2-core host than the same calls alone). A split-stream
request that drafted gives its draft steps' length over its later decode steps
(`draft_step_ratio`): drafts run while the receiver's worker dequantizes the residual as it
lands, and share the cores (and the interpreter) with it. On arrival, the worker's layer
spans inside the drafting window split it into busy and idle time, which gives the draft
step while the worker works (`draft_busy_ratio`, see draft_busy_ratio): the simulator
weighs it by the worker's load at each rate (kvsim.sim.worker_load; each link profile's own
busy ratio, with the receiver's cost per later-stream byte, is fitted on transfers at two
rates instead: kvsim.calibrate.draft_ingest). `apply_receiver_timing` puts these into the
profiles. The draft step depends on the link as well: over a `tc`-shaped veth it measured
slower than on the token bucket (likely cause, not measured: the kernel's shaping and
packet processing on the decoder's cores), so `kvsim calibrate` repeats the transfer there
for the split-stream codecs (`emulation=`, draft_step_doc), taking for the first step's
extra the value the token bucket's transfers measured (`first_step_extra_s`), and writes its
draft step into that link's profile.

A worker's layer job has a fixed part as well as a part in proportion to the layer's
bytes (its Python, kernel calls and cache update): one context cannot tell them apart, and
a rate taken at one context and extrapolated doubles the jobs from 1024 to 2048 tokens
where the real ones grow far less (the measured jobs: CHANGELOG.md, 2026-11-25). A second
calibration transfer at a shorter context (`fit_layer_jobs`) splits them: the simulator's
on-arrival layer jobs cost fixed + bytes / rate (kvsim.scenario.codec_timing).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from kvsim.calibrate.step_fit import fitted_curve
from kvsim.model.hardware_profile import STEP_CURVES, scaled_profile

DECODE_STEPS = 16  # decode steps per request of the calibration transfer
# the calibration transfer's link rate: slow enough that a split-stream codec's residual is
# still on the wire when its anchor is loaded (1e9 bit/s)
CALIBRATION_RATE_GBPS = 0.3


def _spans(row: dict) -> dict[str, float]:
    """The decode loop's load spans of one request row: name -> seconds (the longest of a
    name if it repeats)."""
    out: dict[str, float] = {}
    for name, process, t0, t1 in row.get("trace_spans") or []:
        if process == "decode" and name.startswith("dequantize stream") and \
                not name.startswith("dequantize streams 0.."):
            out[name] = max(out.get(name, 0.0), float(t1) - float(t0))
    return out


def _layer_job_s(row: dict) -> dict[str, float]:
    """The on-arrival worker's spans of one request row, summed over the layers:
    "stream 0" (anchor jobs) / "streams 0-N" (full jobs) -> seconds."""
    out: dict[str, float] = {}
    for name, process, t0, t1 in row.get("trace_spans") or []:
        if process == "decode" and name.startswith("dequantize layer "):
            kind = name.split(" ", 3)[3]  # "dequantize layer L <streams>"
            out[kind] = out.get(kind, 0.0) + float(t1) - float(t0)
    return out


def receiver_loads(model: str, codecs: list[Any], context_tokens: int, seed: int,
                   text_source: str, bandwidth_gbps: float = CALIBRATION_RATE_GBPS,
                   repeats: int = 3,
                   threads: int = 1, dequantize: str = "on_arrival",
                   emulation: str = "token_bucket", first_step_extra_s: float | None = None,
                   keep_rows: list[dict] | None = None, split_cpus: bool = False
                   ) -> dict[str, dict[str, float]]:
    """codec label -> {"decode_gb_per_s": every stream, "anchor_decode_gb_per_s": stream 0
    (split-stream codecs whose anchor was loaded alone), "tpot_s", "first_step_s" and
    "first_step_extra_s" (plain requests: the first step, and it less the request's own
    later steps), "encode_gb_per_s" (the sender's encoder, FIN's encode_work_s), "draft_step_ratio"
    (requests that drafted: a draft step over a later step), and on arrival
    "cache_build_gb_per_s" and "draft_busy_ratio" (the same while the worker is busy), or
    "dequantized_on_demand" (1.0: its layers do not decode alone, so the receiver loaded
    it on demand, and its rates are that mode's)}:
    medians over `repeats` requests per codec of one calibration transfer (a load's time
    varies by tens of percent from one request to the next, so one request is not a
    measurement), and "tpot_mean_s", the mean of its requests' steps (the step level: see
    apply_receiver_timing). `emulation`: the transfer's link (transport.emulation; tc needs root).
    `first_step_extra_s`: the first step's extra on a fresh cache (s) to take out of the
    drafting windows when no request of this transfer decoded plainly (a transfer of
    split-stream codecs only: their requests all draft); with plain requests, theirs.
    keep_rows: the transfer's request rows are appended to it (kvsim.calibrate.draft_ingest
    replays their drafts)."""
    from kvsim.core.compose import compose
    from kvsim.transport.config import EmulateConfig
    from kvsim.transport.emulate import emulate

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    entries = ",".join(str(c) for _ in range(repeats) for c in codecs)
    # transfer=seeds: monolithic / split_stream, the policies the receiver's loads are
    # calibrated under (the split-stream requests draft)
    overrides = [f"model={model}", "hardware=local-cpu", "link=emulated", "transfer=seeds",
                 f"link.bandwidth_gbps={bandwidth_gbps}", f"transport.emulation={emulation}",
                 "transport.decode=real", "transport.kv_source=live",
                 f"transport.text_source={text_source}", f"transport.threads={threads}",
                 f"transport.dequantize={dequantize}", f"transport.split_cpus={split_cpus}",
                 # the repeats' one prompt is prefilled once (its time is not used here)
                 "transport.reuse_prefill=true",
                 "workload=emulated", f"workload.context_tokens={context_tokens}",
                 f"workload.output_tokens={DECODE_STEPS + 1}", f"seed={seed}",
                 f"codecs=[{entries}]"]
    cfg, _ = compose("transport", overrides, EmulateConfig)
    rows = emulate(cfg)
    if keep_rows is not None:
        keep_rows.extend(rows)
    samples: dict[str, dict[str, list[float]]] = {}
    # (codec, window s, worker busy s within it, drafts, step s)
    drafted: list[tuple[str, float, float, int, float]] = []
    first_extra: list[float] = []  # plain requests: first step - later step (s)
    for row in rows:
        if row.get("status") != "done":
            raise RuntimeError(f"calibration transfer of {row.get('codec')} failed: "
                               f"{row.get('status')}: {row.get('error')}")
        bf16_bytes = float(cfg.model.kv_bytes_bf16(int(row["context_tokens"])))
        spans = _spans(row)
        n = int(row["streams"])
        full_name = "stream 0" if n == 1 else f"streams 0-{n - 1}"
        full = spans.get(f"dequantize {full_name}")
        if full is None:
            raise RuntimeError(f"calibration transfer of {row['codec']}: no load span of its "
                               f"full cache in {sorted(spans)}")
        got = samples.setdefault(str(row["codec"]), {})
        got.setdefault("tpot_s", []).append(float(row["tpot_s"]))
        if row.get("dequantize") == "on_arrival":  # worker jobs; the loop only builds
            jobs = _layer_job_s(row)
            if not jobs.get(full_name):
                raise RuntimeError(f"calibration transfer of {row['codec']}: no on-arrival "
                                   f"layer spans of its full cache in {sorted(jobs)}")
            got.setdefault("decode_gb_per_s", []).append(bf16_bytes / jobs[full_name] / 1e9)
            if n > 1 and jobs.get("stream 0"):
                got.setdefault("anchor_decode_gb_per_s", []).append(
                    bf16_bytes / jobs["stream 0"] / 1e9)
            # the decoder's cache grows as layers are dequantized: what is left after the
            # last one is taking it (a few microseconds: floored at 1 us)
            got.setdefault("cache_build_gb_per_s", []).append(
                bf16_bytes / max(full, 1e-6) / 1e9)
        else:  # on demand (asked for, or on arrival for a codec whose layers do not
            # decode alone: the receiver fell back, as the simulator does for it)
            if dequantize == "on_arrival":
                got["dequantized_on_demand"] = [1.0]
            got.setdefault("decode_gb_per_s", []).append(bf16_bytes / full / 1e9)
            if n > 1 and spans.get("dequantize stream 0"):
                got.setdefault("anchor_decode_gb_per_s", []).append(
                    bf16_bytes / spans["dequantize stream 0"] / 1e9)
        encode_s = row.get("encode_work_s")
        if isinstance(encode_s, (int, float)) and math.isfinite(encode_s) and encode_s > 0:
            got.setdefault("encode_gb_per_s", []).append(bf16_bytes / encode_s / 1e9)
        proposed = int(row.get("proposed_tokens") or 0)
        if proposed == 0:  # plain: the first step's own length
            first = float(row["ttft_from_prefill_end_s"]) - \
                float(row["full_ready_from_prefill_end_s"])
            got.setdefault("first_step_s", []).append(first)
            # less the request's own later steps (not another request's: the host's speed
            # runs in spells of seconds, which one request's steps share)
            got.setdefault("first_step_extra_s", []).append(first - float(row["tpot_s"]))
            first_extra.append(first - float(row["tpot_s"]))
        else:
            t0, t1 = _draft_window(row)
            if t1 > t0:
                drafted.append((str(row["codec"]), t1 - t0, _worker_busy_s(row, t0, t1),
                                proposed, float(row["tpot_s"])))
    # a draft step beside the receiver's dequantization of the later streams: its length
    # over the same request's later decode steps. The drafting window [anchor cache ready,
    # last draft's end] holds the first step's extra on a fresh cache (the plain requests'
    # first step - step here), which the simulator adds on its own. This transfer's own
    # extra, not the profile's (apply_receiver_timing pools both transfers' later): the two
    # differ by a few ms, and on arrival draft_ingest refits busy_ratio with the profile's
    if first_extra:
        extra = max(0.0, statistics.median(first_extra))
    else:
        extra = max(0.0, first_step_extra_s or 0.0)
    for codec, window, busy, proposed, tpot in drafted:
        samples[codec].setdefault("draft_step_ratio", []).append(
            max(window - extra, 0.0) / proposed / tpot)
        busy_ratio = draft_busy_ratio(window, busy, extra, proposed, tpot)
        if busy_ratio is not None:
            samples[codec].setdefault("draft_busy_ratio", []).append(busy_ratio)
    out = {codec: {k: float(statistics.median(v)) for k, v in got.items()}
           for codec, got in samples.items()}
    for codec, got in samples.items():  # the step's mean as well: a run's decode time sums
        out[codec]["tpot_mean_s"] = float(statistics.fmean(got["tpot_s"]))  # its steps
    return out


def _draft_window(row: dict) -> tuple[float, float]:
    """(first draft step's start, last one's end) in the row's clock (s): the decode loop's
    draft_accepted / draft_rejected spans of one request row; (0, 0) without them."""
    spans = [(float(t0), float(t1)) for name, _process, t0, t1 in row.get("trace_spans") or []
             if name in ("draft_accepted", "draft_rejected")]
    if not spans:
        return 0.0, 0.0
    return min(t0 for t0, _t1 in spans), max(t1 for _t0, t1 in spans)


def _worker_busy_s(row: dict, t0: float, t1: float) -> float:
    """Seconds of [t0, t1] during which the on-arrival worker dequantized a layer (its
    "dequantize layer ..." spans: one worker, so they do not overlap)."""
    busy = 0.0
    for name, process, a, b in row.get("trace_spans") or []:
        if process == "decode" and name.startswith("dequantize layer "):
            busy += max(0.0, min(float(b), t1) - max(float(a), t0))
    return busy


def draft_busy_ratio(window_s: float, busy_s: float, extra_s: float, proposed: int,
                     tpot_s: float) -> float | None:
    """A draft step's length over a decode step while the receiver's worker dequantizes
    beside it, from one request that drafted `proposed` tokens in `window_s` seconds, the
    worker busy for `busy_s` of them: drafts advance at one step per tpot_s while the
    worker is idle and one per ratio x tpot_s while it works, and the first step's extra on
    a fresh cache (`extra_s`) is taken from the idle time first (then from the busy time).
    So ratio = busy' / (proposed x tpot_s - idle'), with idle' = max(0, idle - extra) and
    busy' = window - extra - idle'. None when the worker's share cannot be told apart: it
    never ran beside the drafts, or the idle time alone accounts for (nearly) every draft."""
    idle = max(0.0, window_s - busy_s - extra_s)
    busy = window_s - extra_s - idle
    contended_s = proposed * tpot_s - idle  # decode-step seconds of progress made while busy
    if busy <= 0.0 or contended_s < 0.1 * tpot_s:
        return None
    return busy / contended_s


def apply_receiver_timing(measured: dict[str, dict[str, float]], hw_doc: dict, timing_doc: dict,
                          context_tokens: int, dequantize: str = "on_arrival",
                          fit: dict[str, dict[str, float]] | None = None,
                          fit_context_tokens: int = 0) -> None:
    """Put a calibration transfer's figures into the profiles (in place): the codecs' encode
    (the sender's) and load rates (the receiver's) replace the in-process ones (kept as
    inprocess_*; `receiver_dequantize` names the receiver mode they are for, the simulator's
    deserializer of the same name), on arrival the cache build rate (hardware `cache_build`,
    median over codecs), the draft step's ratio to a decode step (hardware `draft_step`, when
    a request drafted; `busy_ratio` with the worker busy, where measured), and the
    decode-step curves (tpot, tpot_batch, verify) are scaled by
    the receiver's mean step over the in-process step at the transfer's context (kept as
    tpot_inprocess / receiver_step_ratio): the receiver's process runs the same step at its
    own speed. With the second (layer-job fit) transfer's figures (`fit`, at
    `fit_context_tokens`), the ratio is measured at both contexts and interpolated between
    them (flat outside): one ratio measured at one context carries the in-process curve's
    own error at every other (CHANGELOG.md, 2026-11-25); they are kept in
    receiver_step_ratio ("context_tokens", "ratio": lists, shortest context first)."""
    for label, entry in timing_doc["codecs"].items():
        for key in ("encode_gb_per_s", "decode_gb_per_s", "anchor_decode_gb_per_s"):
            if key in measured.get(label, {}):
                entry[f"inprocess_{key}"] = entry.get(key)
                entry[key] = measured[label][key]
        mode = dequantize
        if measured.get(label, {}).get("dequantized_on_demand"):
            mode = entry["receiver_dequantize"] = "on_demand"  # its layers do not decode alone
        entry["what"] += ("; encode: timed in the sender of a calibration transfer; decode / "
                          "anchor_decode: timed in its receiver, dequantizing "
                          f"{mode.replace('_', ' ')} (inprocess_*: the same call "
                          "repeated in one process)")
    timing_doc["receiver_dequantize"] = dequantize
    builds = [m["cache_build_gb_per_s"] for m in measured.values()
              if "cache_build_gb_per_s" in m]
    if builds:
        hw_doc["cache_build"] = {
            "gb_per_s": float(statistics.median(builds)),
            "measured": f"receiver of the calibration transfer at {context_tokens} tokens "
                        "(the model's cache built from dequantized layers; median over codecs)"}
    transfers = [(context_tokens, measured)]
    if fit is not None:
        if not 0 < fit_context_tokens < context_tokens:
            raise ValueError(f"fit_context_tokens must be in (0, {context_tokens}), got "
                             f"{fit_context_tokens}")
        transfers.insert(0, (fit_context_tokens, fit))
    contexts, ratios, receiver_steps = [], [], []
    for ctx, got in transfers:
        steps = [m.get("tpot_mean_s", m["tpot_s"]) for m in got.values()
                 if m.get("tpot_s", 0) > 0]
        if not steps:
            raise RuntimeError(f"calibration transfer at {ctx} tokens: no decode step time in "
                               "its rows")
        inprocess = float(np.interp(ctx, hw_doc["tpot"]["context_tokens"],
                                    hw_doc["tpot"]["s"]))
        contexts.append(ctx)
        # the mean, not the median: the host's step runs in spells (~80 and ~105 ms at 1536
        # tokens on the 2-core host, seconds each), a scenario's decode time sums every step
        # through them, and the median of a few requests drops the slow spells
        # (CHANGELOG.md, 2026-11-29)
        ratios.append(statistics.fmean(steps) / inprocess)
        receiver_steps.append(steps)
    hw_doc["tpot_inprocess"] = dict(hw_doc["tpot"])
    hw_doc["receiver_step_ratio"] = {"context_tokens": contexts, "ratio": ratios,
                                     "receiver_tpot_s": receiver_steps}
    hw_doc.update(scaled_profile(hw_doc, STEP_CURVES,
                                 lambda c: float(np.interp(c, contexts, ratios))))
    # the ratio, interpolated between two noisy medians, can bend the fitted line: the
    # scaled step curves are fitted again (kvsim.calibrate.step_fit), so the simulator's
    # step stays a non-decreasing line in context
    for key in ("tpot", "verify"):
        hw_doc[key] = fitted_curve(hw_doc[key])
    # the first step on a freshly built cache, in the receiver's new decode thread, costs
    # more than in a warm process: the transfers' plain requests measure it, each codec's
    # median of its requests' first step less their own later steps, and the median over
    # the codecs of both transfers (applied flat, the in-process curve kept as
    # first_step_extra_inprocess). One request's first step varies by +-10 ms about a
    # 10-15 ms extra, so the median of one transfer's three codecs came out at 0 in one run
    # whose comparisons measured 13 ms on average (CHANGELOG.md, 2026-12-06)
    firsts = [m.get("first_step_extra_s", m["first_step_s"] - m["tpot_s"])
              for _ctx, got in transfers for m in got.values() if "first_step_s" in m]
    if firsts:
        extra = max(0.0, statistics.median(firsts))
        hw_doc["first_step_extra_inprocess"] = dict(hw_doc["first_step_extra"])
        hw_doc["first_step_extra"] = {
            "context_tokens": hw_doc["first_step_extra"]["context_tokens"],
            "s": [extra] * len(hw_doc["first_step_extra"]["s"]),
            "measured": "receiver of the calibration transfers at "
                        f"{' and '.join(str(c) for c in contexts)} tokens (median of "
                        f"{len(firsts)} codec medians, one per codec and transfer)"}
    draft = draft_step_doc(measured, context_tokens, "the calibration transfer")
    if draft is not None:
        hw_doc["draft_step"] = draft


def draft_step_doc(measured: dict[str, dict[str, float]], context_tokens: int, where: str
                   ) -> dict[str, Any] | None:
    """The profiles' `draft_step` entry from receiver_loads' figures: `ratio`, a draft step
    (beside the dequantization of the later streams) over a later decode step, and
    `busy_ratio`, the same while the on-arrival worker works (where measured), medians over
    the codecs that drafted, never below 1 (noise can say a draft is faster than a step);
    None when no request drafted. `where` names the transfer in its `measured` text."""
    drafts = [m["draft_step_ratio"] for m in measured.values() if "draft_step_ratio" in m]
    if not drafts:
        return None
    doc: dict[str, Any] = {
        "ratio": max(1.0, float(statistics.median(drafts))), "context_tokens": context_tokens,
        "measured": f"receiver of {where} at {context_tokens} tokens: a draft step (beside "
                    "the dequantization of the later streams) over a later decode step, "
                    "without the first step's extra"}
    busy = [m["draft_busy_ratio"] for m in measured.values() if "draft_busy_ratio" in m]
    if busy:  # the same while the worker dequantizes (on arrival: its layer spans)
        doc["busy_ratio"] = max(1.0, float(statistics.median(busy)))
    return doc


def fit_layer_jobs(measured: dict[str, dict[str, float]], fit: dict[str, dict[str, float]],
                   layer_bf16_bytes: float, fit_layer_bf16_bytes: float
                   ) -> dict[str, dict[str, float]]:
    """codec label -> the codec timing's layer-job fields (kvsim.scenario.codec_timing:
    layer_job_fixed_s / layer_job_gb_per_s, and the anchor's with an anchor rate): a line
    through the mean on-arrival job of two calibration transfers, `measured` with layers of
    `layer_bf16_bytes` and `fit` with layers of `fit_layer_bf16_bytes` (receiver_loads'
    rates: a job is its layer's bf16 bytes at that rate). A line that says a bigger layer
    is not slower, or has a negative fixed part, is noise at this host's jitter: that codec
    gets no fit at all (the plain rates then time its jobs, in proportion to their bytes;
    fitting one of its pairs and not the other would make its anchor job outgrow its full
    job at long contexts)."""
    if not 0 < fit_layer_bf16_bytes < layer_bf16_bytes:
        raise ValueError(f"the fit's layers ({fit_layer_bf16_bytes} B) must be smaller than the "
                         f"calibration transfer's ({layer_bf16_bytes} B) and > 0")
    out: dict[str, dict[str, float]] = {}
    for codec, rates in measured.items():
        if rates.get("dequantized_on_demand"):  # whole-cache loads: no layer jobs
            continue
        fields: dict[str, float] = {}
        for prefix, key in (("", "decode_gb_per_s"), ("anchor_", "anchor_decode_gb_per_s")):
            if key not in rates or key not in fit.get(codec, {}):
                continue
            job_s = layer_bf16_bytes / (rates[key] * 1e9)
            fit_job_s = fit_layer_bf16_bytes / (fit[codec][key] * 1e9)
            slope = (job_s - fit_job_s) / (layer_bf16_bytes - fit_layer_bf16_bytes)  # s / B
            fixed = job_s - slope * layer_bf16_bytes
            if not (slope > 0 and fixed >= 0):
                fields = {}
                break
            fields[f"{prefix}layer_job_fixed_s"] = fixed
            fields[f"{prefix}layer_job_gb_per_s"] = 1.0 / slope / 1e9
        if fields:
            out[codec] = fields
    return out
