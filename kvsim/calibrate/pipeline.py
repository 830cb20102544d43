"""`kvsim calibrate`: measure this machine and its emulated links for the simulator.

Writes, under out_dir (default: the run directory):
  hardware/<name>.json        the real model's prefill / decode step / batch / verification /
                              first-step times here (`hardware.profile=`)
  codec_timing/<name>.json    each codec's encode (as the sender) and dequantize (as the
                              receiver: per layer on arrival, the default, or the whole
                              cache on demand: `dequantize=`) GB/s (`codec_timing=`); on
                              arrival the hardware profile gets the cache build rate
  link/<name>-<emulation>.json  the emulated link's goodput fraction, first-byte latency and
                              per-message cost, fitted to real transfers (`link.profile=`),
                              and the receiver's draft step measured on that link (a
                              calibration transfer of the split-stream codecs over it)
  transfers/<name>.jsonl      with receiver_loads, every calibration transfer's request rows
                              (kvsim emulate's, trace spans included), one JSON object per
                              line: what the receiver's timing, the draft step and the
                              paces were fitted on, to be inspected or fitted again
and prints the overrides that make `kvsim sim` use them. With out_dir=data/profiles they
ship with the repository and load by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from kvsim.core.checks import check_choice
from kvsim.core.host_load import HostLoadMeter
from kvsim.core.report import format_table
from kvsim.model.spec import ModelSpec
from kvsim.transport.config import DEQUANTIZE_MODES

if TYPE_CHECKING:
    from kvsim.scenario.codec_timing import CodecTiming

LINK_EMULATIONS = ("token_bucket", "tc", "none")
# a draft-step fit whose rms miss exceeds this share of its median draft window is said to
# be poor: busy_ratio 9.85 (rms 53 ms) and 2.25 (6 ms, over windows of 253 ms median) came
# out of two calibrations of one day (CHANGELOG.md, 2026-11-28)
FIT_RMS_WARN = 0.15


@dataclass
class Config:
    model: ModelSpec = MISSING
    name: str = ""  # profile name; "": local-<model>
    # prompt tokens: prefill, decode step and first-step extra at each
    contexts: list[int] = field(default_factory=lambda: [256, 1024, 2048, 4096])
    steps: int = 12  # decode steps timed per context (median)
    repeats: int = 3  # prefill / codec / verification repeats (median)
    # decode batch sizes, every one timed at every context (a BLAS's cost is not smooth in
    # the batch: kvsim.calibrate.model_profile._batch_steps_s)
    batches: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 7, 8])
    # > 0: decode steps of every batch size also timed beside a live prefill of this many
    # prompt tokens in another process (kvsim.calibrate.beside_prefill; the simulator's
    # workload.colocated_prefill), at the calibration context nearest to it; 0: not timed
    beside_prefill_tokens: int = 0
    # > 0: decode steps of every batch size also timed beside a thread running the
    # on-arrival worker's layer jobs of `beside_worker_codec` back to back
    # (kvsim.calibrate.beside_worker; the simulator's workload.worker_slows_decode), at the
    # calibration context nearest to this many tokens; 0: not timed
    beside_worker_tokens: int = 0
    beside_worker_codec: Any = "int8"  # a codec whose layers decode alone
    # drafted tokens per verification pass, timed at every context
    drafted: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    codecs: list[Any] = field(default_factory=lambda: ["bf16", "int8", "int4", "lynx"])
    codec_context_tokens: int = 2048  # the real KV codecs are timed on (one of contexts)
    threads: int = 1  # torch threads, as transport.threads (each process of a transfer)
    # the calibration transfers' sender and decode host on CPUs of their own
    # (transport.split_cpus: kvsim.transport.cpus); the profiles are then for such runs
    split_cpus: bool = False
    text_source: str = "stdlib-docs"  # the real text of the calibration prompts
    seed: int = 1009  # the calibration prompts' text seed (validation prompts use others)
    # time the receiver's loads and decode step on a calibration transfer (and the draft
    # step on each link, into the link profiles)
    receiver_loads: bool = True
    receiver_context_tokens: int = 1024  # its prompts' tokens
    receiver_repeats: int = 3  # requests per codec (medians)
    # the draft step's slowdown on each link is fitted (kvsim.calibrate.draft_ingest) on
    # transfers of the split-stream codecs at two rates: 0.3 Gbps (the calibration
    # transfer's) and this one, fast enough that the worker's jobs dominate
    draft_fit_rate_gbps: float = 0.8
    # on arrival, a second calibration transfer at this shorter context splits each codec's
    # layer job into a fixed part and a part in proportion to its bytes
    # (receiver_timing.fit_layer_jobs), and measures the receiver's step there too (its
    # ratio to the in-process step, interpolated between the two contexts); -1:
    # min(512, receiver_context_tokens // 2), none below 16 tokens; 0: none (jobs in
    # proportion to their bytes, the step ratio of the one transfer applied flat)
    receiver_fit_context_tokens: int = -1
    # the receiver mode the load rates are for (transport.dequantize; kvsim sim's
    # deserializer of the same name): on_arrival | on_demand
    dequantize: str = "on_arrival"
    # link emulations to profile (tc needs root: skipped with a note)
    links: list[str] = field(default_factory=lambda: ["token_bucket", "tc"])
    link_rates_gbps: list[float] = field(default_factory=lambda: [0.1, 0.5, 1.0])  # 1e9 bit/s
    out_dir: str = ""  # "": the run directory; data/profiles: the shipped profiles
    overwrite: bool = False  # replace existing profile files (else refused before measuring)
    progress: bool = True  # progress lines on stderr

    def __post_init__(self) -> None:
        for key in ("steps", "repeats", "threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("beside_prefill_tokens", "beside_worker_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not (value == 0 or value >= 16):
                raise ValueError(f"{key} must be 0 (not timed) or a prompt of >= 16 tokens, "
                                 f"got {value!r}")
        if self.beside_worker_tokens:  # refused before anything is measured
            from kvsim.kernels.presets import resolve_codec

            if not resolve_codec(self.beside_worker_codec).build().layer_independent:
                raise ValueError(f"beside_worker_codec {self.beside_worker_codec!r}: its layers "
                                 "do not decode alone, so the receiver has no layer jobs for "
                                 "it; pick a codec that has (int8, int4, lynx)")
        if not self.contexts or min(self.contexts) < 16:
            raise ValueError(f"contexts must be prompt lengths >= 16 tokens, got {self.contexts}")
        if self.receiver_repeats < 1 or self.receiver_context_tokens < 16:
            raise ValueError("receiver_repeats must be >= 1 and receiver_context_tokens >= 16")
        check_choice("dequantize", self.dequantize, DEQUANTIZE_MODES)
        fit = self.receiver_fit_context_tokens
        if fit not in (-1, 0) and not 16 <= fit < self.receiver_context_tokens:
            raise ValueError(f"receiver_fit_context_tokens must be -1 (auto), 0 (no fit) or in "
                             f"[16, receiver_context_tokens={self.receiver_context_tokens}), "
                             f"got {fit}")
        if self.codec_context_tokens not in self.contexts:
            raise ValueError(f"codec_context_tokens={self.codec_context_tokens} must be one of "
                             f"contexts {list(self.contexts)}")
        if not self.batches or min(self.batches) < 1 or 1 not in self.batches or \
                any(b <= a for a, b in zip(self.batches, self.batches[1:], strict=False)):
            raise ValueError(f"batches must include 1 and increase, got {self.batches}")
        if not self.drafted or min(self.drafted) < 1:
            raise ValueError(f"drafted must be >= 1, got {self.drafted}")
        for e in self.links:
            if e not in LINK_EMULATIONS:
                raise ValueError(f"links: unknown emulation {e!r}; one of {LINK_EMULATIONS}")
        if any(not r > 0 for r in self.link_rates_gbps):
            raise ValueError(f"link_rates_gbps must be > 0, got {self.link_rates_gbps}")
        from kvsim.calibrate.receiver_timing import CALIBRATION_RATE_GBPS

        if not 0 < self.draft_fit_rate_gbps < math.inf or \
                self.draft_fit_rate_gbps == CALIBRATION_RATE_GBPS:
            raise ValueError(f"draft_fit_rate_gbps must be a rate > 0 other than the "
                             f"calibration transfer's {CALIBRATION_RATE_GBPS} Gbps, got "
                             f"{self.draft_fit_rate_gbps}")

    @property
    def fit_context_tokens(self) -> int:
        """The layer-job fit's calibration transfer context (0: none)."""
        if self.receiver_fit_context_tokens != -1:
            return self.receiver_fit_context_tokens
        auto = min(512, self.receiver_context_tokens // 2)
        return auto if auto >= 16 else 0


def profile_name(cfg: Config) -> str:
    return cfg.name or f"local-{cfg.model.name}"


def output_paths(cfg: Config, root: Path) -> dict[str, Path]:
    name = profile_name(cfg)
    out = {"hardware": root / "hardware" / f"{name}.json",
           "codec_timing": root / "codec_timing" / f"{name}.json"}
    for e in cfg.links:
        out[f"link:{e}"] = root / "link" / f"{name}-{e.replace('_', '-')}.json"
    # with receiver_loads=false none are made: an older file there is removed (it would
    # describe another calibration than the profiles beside it)
    out["transfers"] = root / "transfers" / f"{name}.jsonl"
    return out


def _provenance(cfg: Config) -> dict:
    from kvsim.core.report import git_state

    return {"source": "measured", "host": socket.gethostname(), "cpus": os.cpu_count(),
            "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "kvsim calibrate " + " ".join(sys.argv[2:]), "git": git_state()}


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _write_rows(path: Path, rows: list[dict]) -> None:
    """The calibration transfers' request rows, one JSON object per line (rewritten whole)."""
    from kvsim.core.report import json_safe

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(json_safe(r)) + "\n" for r in rows))


def _record_background(doc: dict, meter: HostLoadMeter, what: str, say) -> None:
    """doc["background"]: the CPUs other work kept busy on this host while `what` (the
    meter's interval so far; kvsim.core.host_load), said; nothing where unreadable."""
    load = meter.read()
    if load is None:
        return
    doc["background"] = load.as_dict()
    say(f"host: {load.describe()} while {what}")


def calibrate(cfg: Config) -> list[dict]:
    import torch

    from kvsim.calibrate.model_profile import ModelCalibration, measure_codecs, measure_model
    from kvsim.core.outputs import check_new, out_root
    from kvsim.kernels.presets import resolve_codec
    from kvsim.model.load import load_lm
    from kvsim.transport.memory import retain_freed_memory

    root = out_root(cfg.out_dir or None)
    paths = output_paths(cfg, root)
    check_new(paths.values(), cfg.overwrite)  # before anything is measured
    meter = HostLoadMeter()  # other work on the host while this measures (recorded)
    say = (lambda msg: print(f"calibrate: {msg}", file=sys.stderr, flush=True)) \
        if cfg.progress else (lambda msg: None)
    specs = [resolve_codec(c) for c in cfg.codecs]
    prov = _provenance(cfg)
    rows: list[dict] = []

    retain_freed_memory("calibrate")  # as the transport's nodes run (kvsim.transport.memory)
    lm = load_lm(cfg.model, threads=cfg.threads, seed=0)
    torch.set_num_threads(cfg.threads)
    say(f"{lm.name}: {torch.get_num_threads()} torch thread(s)")
    cal = ModelCalibration(list(cfg.contexts), cfg.steps, cfg.repeats, tuple(cfg.batches),
                           tuple(cfg.drafted), cfg.repeats, cfg.text_source, cfg.seed)
    hw_doc, kvs = measure_model(lm, cfg.model.name, cal, say)
    if cfg.beside_prefill_tokens:  # the step beside a live prefill in another process
        from kvsim.calibrate.beside_prefill import measure_beside_prefill
        from kvsim.kv.text import assemble

        near = min(kvs, key=lambda c: (abs(c - cfg.beside_prefill_tokens), c))
        prompt = assemble(lm.tokenizer, cfg.beside_prefill_tokens, cfg.text_source,
                          cfg.seed + cfg.beside_prefill_tokens + 1).ids
        try:
            hw_doc["tpot_beside_prefill"] = measure_beside_prefill(
                lm, cfg.model, cfg.threads, kvs[near], list(prompt), list(cfg.batches),
                max(4, cfg.steps // 2), say, cfg.split_cpus)
        except (RuntimeError, TimeoutError, OSError) as exc:  # the rest still stands
            print(f"calibrate: warning: the decode steps beside a prefill were not timed "
                  f"({exc}); the profile has no tpot_beside_prefill", file=sys.stderr)
    if cfg.beside_worker_tokens:  # the step beside the on-arrival worker's jobs
        from kvsim.calibrate.beside_worker import measure_beside_worker

        near = min(kvs, key=lambda c: (abs(c - cfg.beside_worker_tokens), c))
        spec = resolve_codec(cfg.beside_worker_codec)
        try:
            hw_doc["tpot_beside_worker"] = measure_beside_worker(
                lm, spec.build(), kvs[near], list(cfg.batches), max(4, cfg.steps // 2), say,
                cfg.split_cpus, spec.label)
        except (RuntimeError, TimeoutError, OSError) as exc:  # the rest still stands
            print(f"calibrate: warning: the decode steps beside the on-arrival worker were "
                  f"not timed ({exc}); the profile has no tpot_beside_worker", file=sys.stderr)
    hw_doc.update(name=profile_name(cfg), **prov)
    # the host, probed as `kvsim sim` / `kvsim validate` probe theirs (kvsim.model.host)
    from kvsim.calibrate.host_probe import PROBE_STEPS, StepProbe, host_record, probe_contexts

    host = host_record(StepProbe(cfg.model, PROBE_STEPS, cfg.threads, _lm=lm),
                       probe_contexts(list(cfg.contexts)))
    hw_doc["host"], probe = host, host["decode_step_probe"]
    say(f"host: {host['cpu_model']}, {host['logical_cpus']} CPUs, memory copy "
        f"{host['memory_copy_gb_per_s']:.1f} GB/s, decode step probe "
        f"{' / '.join(f'{v * 1e3:.1f}' for v in probe['s'])} ms at "
        f"{' / '.join(map(str, probe['context_tokens']))} tokens")
    timing_doc = measure_codecs(lm, specs, kvs[cfg.codec_context_tokens], cfg.repeats,
                                prov["command"], say)
    timing_doc.update(hardware=profile_name(cfg), **{k: v for k, v in prov.items()
                                                      if k != "command"})
    del lm, kvs
    main_rows: list[dict] = []  # the calibration transfer's rows (the token bucket's draft fit)
    kept: list[dict] = []  # every calibration transfer's rows (paths["transfers"])
    if cfg.receiver_loads:  # load rates and decode step timed in a real transfer's receiver
        from kvsim.calibrate.receiver_timing import apply_receiver_timing, receiver_loads

        say(f"calibration transfer ({cfg.receiver_repeats} x {len(specs)} codecs, "
            f"{cfg.receiver_context_tokens} tokens) for the receiver's load and step times")
        measured = receiver_loads(cfg.model.name, list(cfg.codecs),
                                  cfg.receiver_context_tokens, cfg.seed, cfg.text_source,
                                  repeats=cfg.receiver_repeats, threads=cfg.threads,
                                  split_cpus=cfg.split_cpus,
                                  dequantize=cfg.dequantize, keep_rows=main_rows)
        kept += main_rows
        fit_ctx = cfg.fit_context_tokens if cfg.dequantize == "on_arrival" else 0
        fit = None
        if fit_ctx:
            say(f"calibration transfer at {fit_ctx} tokens: each codec's layer job split into "
                "a fixed part and a part in proportion to its bytes, and the receiver's step "
                "there")
            # prompts of their own (emulate seeds request i's text at seed + i)
            fit = receiver_loads(cfg.model.name, list(cfg.codecs), fit_ctx, cfg.seed + 10_000,
                                 cfg.text_source, repeats=cfg.receiver_repeats,
                                 threads=cfg.threads, dequantize=cfg.dequantize,
                                 split_cpus=cfg.split_cpus, keep_rows=kept)
        apply_receiver_timing(measured, hw_doc, timing_doc, cfg.receiver_context_tokens,
                              cfg.dequantize, fit, fit_ctx)
        steps = hw_doc["receiver_step_ratio"]
        say("receiver's decode step / in-process: " + ", ".join(
            f"{r:.3f} at {c} tokens" for c, r in zip(steps["context_tokens"], steps["ratio"],
                                                       strict=True)) +
            " (the step curves are scaled by it, interpolated over context)")
        if fit is not None:
            from kvsim.calibrate.receiver_timing import fit_layer_jobs

            layer_bytes, fit_bytes = (shape.bf16_bytes / shape.layers for shape in (
                cfg.model.kv_shape(cfg.receiver_context_tokens), cfg.model.kv_shape(fit_ctx)))
            fitted = fit_layer_jobs(measured, fit, layer_bytes, fit_bytes)
            for label, fields in fitted.items():
                timing_doc["codecs"][label].update(fields)
                timing_doc["codecs"][label]["layer_job_contexts"] = \
                    [fit_ctx, cfg.receiver_context_tokens]
            for label, rates in measured.items():  # the jobs the fit is made of, per codec
                if rates.get("dequantized_on_demand"):
                    say(f"{label}: loaded on demand (its layers do not decode alone): no "
                        "layer jobs to fit")
                    continue
                jobs = ", ".join(
                    f"{kind} {fit_bytes / fit[label][key] / 1e6:.2f} / "
                    f"{layer_bytes / rates[key] / 1e6:.2f} ms"
                    for kind, key in (("full", "decode_gb_per_s"),
                                      ("anchor", "anchor_decode_gb_per_s"))
                    if key in rates and key in fit.get(label, {}))
                say(f"{label}: mean layer job at {fit_ctx} / {cfg.receiver_context_tokens} "
                    f"tokens: {jobs or 'not measured'}; " +
                    ("fitted" if label in fitted else "no fit (a bigger layer was not "
                     "slower, or the line's fixed part is negative): jobs in proportion to "
                     "their bytes"))
    _record_background(hw_doc["host"], meter, "the model, codecs and receiver were timed", say)
    _write(paths["hardware"], hw_doc)
    _write(paths["codec_timing"], timing_doc)
    if kept:
        _write_rows(paths["transfers"], kept)
    else:
        paths["transfers"].unlink(missing_ok=True)
    for ctx, p, t, x in zip(hw_doc["prefill"]["tokens"], hw_doc["prefill"]["s"],
                            hw_doc["tpot"]["s"], hw_doc["first_step_extra"]["s"], strict=True):
        rows.append({"what": "model", "item": f"context {ctx}", "prefill_s": p,
                     "decode_step_ms": t * 1e3, "first_step_extra_ms": x * 1e3})
    for label, e in timing_doc["codecs"].items():
        rows.append({"what": "codec", "item": label, "encode_gb_per_s": e["encode_gb_per_s"],
                     "decode_gb_per_s": e["decode_gb_per_s"],
                     "anchor_decode_gb_per_s": e.get("anchor_decode_gb_per_s"),
                     "layer_job_fixed_ms": 1e3 * e["layer_job_fixed_s"]
                     if "layer_job_fixed_s" in e else None,
                     "layer_job_gb_per_s": e.get("layer_job_gb_per_s")})
    for emulation in cfg.links:
        rows.append(_link(cfg, emulation, paths[f"link:{emulation}"], prov, say, hw_doc,
                          main_rows, paths["codec_timing"], kept))
        if kept:  # after each link: a later link's failure keeps the earlier transfers
            _write_rows(paths["transfers"], kept)
    if "cache_build" in hw_doc:
        rows.append({"what": "model", "item": "cache build",
                     "cache_build_gb_per_s": hw_doc["cache_build"]["gb_per_s"]})
    _print(rows, paths, root, cfg.dequantize)
    return rows


def _link(cfg: Config, emulation: str, path: Path, prov: dict, say, hw_doc: dict,
          main_rows: list[dict], timing_path: Path, kept: list[dict]) -> dict:
    """Measure one emulated link into its profile at `path`: the fit of real transfers,
    the receiver's draft step on that link (_link_draft_step), a transfer's handshake
    (the median over the calibration transfers made on it: handshake_entry), and the
    on-arrival worker's and the encoder's pace there (kvsim.calibrate.worker_pace and
    encoder_pace, on the same transfers' requests against the codec timing at
    `timing_path`). The rows of the transfers it makes are appended to `kept`."""
    from kvsim.calibrate.link_profile import handshake_entry, measure_link_profile

    if emulation == "tc":
        from kvsim.transport.netns import netns_available

        ok, why = netns_available()
        if not ok:
            say(f"link tc skipped: {why}")
            return {"what": "link", "item": emulation, "status": f"skipped: {why}"}
    name = path.stem
    meter = HostLoadMeter()
    doc = measure_link_profile(emulation, list(cfg.link_rates_gbps), name=name)
    doc.update({k: v for k, v in prov.items() if k not in doc})
    _write(path, doc)  # the link's fit is kept even if its draft-step transfer fails
    # every calibration transfer's requests over this link (the handshake's median)
    link_rows = list(main_rows) if emulation == "token_bucket" else []
    draft = _link_draft_step(cfg, emulation, say, hw_doc, main_rows, link_rows)
    # this link's own transfers (the token bucket's main one is kept already)
    kept += [r for r in link_rows if not any(r is m for m in main_rows)]
    if draft is not None:
        doc["draft_step"] = draft
    handshake = handshake_entry(link_rows)
    if handshake is not None:
        doc.update(handshake)
        say(f"link {emulation}: a transfer's handshake {handshake['handshake_s'] * 1e3:.2f} ms "
            f"(median of {handshake['handshake']['requests']} requests, "
            f"{handshake['handshake']['min_s'] * 1e3:.2f}-"
            f"{handshake['handshake']['max_s'] * 1e3:.2f})")
    timing_of = _timing_of(cfg, timing_path) if link_rows else None  # (none: no paces)
    encoder = _encoder_pace(cfg, link_rows, timing_of) if timing_of else None
    if encoder is not None:
        doc["encoder_pace"] = encoder
        say(f"link {emulation}: a pipelined request's encoder " + ", ".join(
            f"{x:.3f} x the codec timing's at {r:g} Gbps ({n} requests)" for r, x, n in zip(
                encoder["rates_gbps"], encoder["ratio"], encoder["requests"], strict=True)))
    pace = _worker_pace(cfg, link_rows, timing_of) if timing_of else None
    if pace is not None:
        doc["worker_pace"] = pace
        say(f"link {emulation}: the on-arrival worker's layer job {pace['alone']:.3f} x the "
            f"codec timing's, x (1 + {pace['encoder']:.3f} beside its request's encoder + "
            f"{pace['ingest']:.3f} while its bytes arrive) ({pace['jobs']} jobs of "
            f"{pace['requests']} requests, rms {pace['rms_s'] * 1e3:.2f} ms; alone: " +
            (f"the median of {pace['alone_jobs']} jobs after both)" if pace["alone_jobs"]
             else "fitted with the rest, too few jobs after both)"))
    elif link_rows and cfg.dequantize == "on_arrival":
        say(f"link {emulation}: the on-arrival worker's pace did not fit (too few jobs, "
            "transfers at one rate only, or beyond its bounds): its jobs take the codec "
            "timing's time there")
    _record_background(doc, meter, f"link {emulation} was measured", say)
    _write(path, doc)
    say(f"link {emulation}: efficiency {doc['efficiency']:.4f}, latency "
        f"{doc['latency_s'] * 1e3:.2f} ms, {doc['message_overhead_bytes']:.0f} B/message "
        f"(fit within {doc['fit_max_abs_pct_error']:.2f}%)" +
        (f"; draft step {draft['ratio']:.3f} x a decode step" +
         (f" ({draft['busy_ratio']:.3f} x while the receiver is busy)"
          if "busy_ratio" in draft else "") +
         (f", {draft['ingest_s_per_byte'] * 1e9:.1f} ns of receiver time per later-stream "
          "byte" + (" (a lower bound: both rates saturate the receiver)"
                    if draft.get("fit", {}).get("saturated") else "")
          if "ingest_s_per_byte" in draft else "") if draft else ""))
    return {"what": "link", "item": emulation, "efficiency": doc["efficiency"],
            "latency_ms": doc["latency_s"] * 1e3,
            "message_overhead_bytes": doc["message_overhead_bytes"],
            "fit_max_abs_pct_error": doc["fit_max_abs_pct_error"],
            "draft_step_ratio": draft["ratio"] if draft else None,
            "draft_busy_ratio": draft.get("busy_ratio") if draft else None,
            "draft_ingest_ns_per_byte": 1e9 * draft["ingest_s_per_byte"]
            if draft and "ingest_s_per_byte" in draft else None,
            "handshake_ms": 1e3 * handshake["handshake_s"] if handshake else None,
            "worker_alone": pace["alone"] if pace else None,
            "worker_encoder": pace["encoder"] if pace else None,
            "worker_ingest": pace["ingest"] if pace else None,
            "encoder_ratios": " / ".join(f"{x:.3f}" for x in encoder["ratio"])
            if encoder else None,
            "status": "measured"}


def _timing_of(cfg: Config, timing_path: Path) -> Callable[[dict], CodecTiming]:
    """row -> the codec timing (at `timing_path`) of its codec."""
    from kvsim.scenario.codec_timing import load_codec_timing

    table = load_codec_timing(profile_name(cfg), timing_path)
    return lambda row: table.lookup(str(row["codec"]), str(row["codec_name"]))


def _worker_pace(cfg: Config, rows: list[dict], timing_of: Callable[[dict], CodecTiming]
                 ) -> dict | None:
    """The link profile's `worker_pace` from its calibration transfers' rows (None without
    on-arrival rows, or where they do not fit)."""
    from kvsim.calibrate.worker_pace import pace_entry

    return pace_entry(rows, timing_of,
                      lambda tokens: cfg.model.kv_bytes_bf16(tokens) / cfg.model.layers,
                      cfg.model.name)


def _encoder_pace(cfg: Config, rows: list[dict], timing_of: Callable[[dict], CodecTiming]
                  ) -> dict | None:
    """The link profile's `encoder_pace` from its calibration transfers' rows (None without
    pipelined requests at two rates)."""
    from kvsim.calibrate.encoder_pace import pace_entry

    return pace_entry(rows, timing_of, cfg.model.kv_bytes_bf16, cfg.model.name)


def _link_draft_step(cfg: Config, emulation: str, say, hw_doc: dict, main_rows: list[dict],
                     link_rows: list[dict]) -> dict | None:
    """The receiver's draft step on `emulation` (the link profile's `draft_step`, for this
    model: `model` names it). Its `ratio` (a draft step over a decode step, averaged over the
    drafting) is the token bucket's calibration transfer's (it ran there, into hw_doc) or, on
    another link, that of a transfer of the split-stream codecs over it (their own prompts,
    0.3 Gbps). Its `busy_ratio` and `ingest_s_per_byte` are fitted
    (kvsim.calibrate.draft_ingest) on the drafts of that transfer and of one more at
    `draft_fit_rate_gbps`: the slowdown grows with the later streams' arrival rate
    (kvsim.calibrate.draft_ingest), which one rate cannot tell from the worker's jobs. None
    without receiver timing, without a split-stream codec, or when no request drafted.
    link_rows: the request rows of every transfer it makes over the link are appended."""
    if not cfg.receiver_loads:
        return None
    import numpy as np

    from kvsim.calibrate import draft_ingest
    from kvsim.calibrate.receiver_timing import (
        CALIBRATION_RATE_GBPS,
        draft_step_doc,
        receiver_loads,
    )
    from kvsim.kernels.presets import resolve_codec

    split = [c for c in cfg.codecs if resolve_codec(c).build().num_streams > 1]
    if not split:
        return None
    # these requests all draft: the first step's extra is the token bucket's transfers'
    # (pooled into hw_doc by apply_receiver_timing)
    extra = hw_doc.get("first_step_extra")
    extra_s = float(np.interp(cfg.receiver_context_tokens, extra["context_tokens"],
                              extra["s"])) if extra else None
    rows: list[dict] = []
    if emulation == "token_bucket":
        draft = hw_doc.get("draft_step")
        labels = {str(c) for c in split}
        rows += [r for r in main_rows if str(r.get("codec")) in labels]
    else:
        say(f"calibration transfer over {emulation} ({cfg.receiver_repeats} x {len(split)} "
            f"split-stream codecs, {cfg.receiver_context_tokens} tokens) for the draft step "
            "there")
        measured = receiver_loads(cfg.model.name, split, cfg.receiver_context_tokens,
                                  cfg.seed + 20_000, cfg.text_source,
                                  repeats=cfg.receiver_repeats, threads=cfg.threads,
                                  split_cpus=cfg.split_cpus,
                                  dequantize=cfg.dequantize, emulation=emulation,
                                  first_step_extra_s=extra_s, keep_rows=rows)
        link_rows.extend(rows)
        draft = draft_step_doc(measured, cfg.receiver_context_tokens,
                               f"a calibration transfer over {emulation}")
    if draft is None:
        return None
    draft = {**draft, "model": cfg.model.name}
    if cfg.dequantize != "on_arrival":  # no worker beside the drafts: nothing to fit
        return draft

    def fit_rate_transfer(seed: int, what: str) -> list[dict]:
        say(f"calibration transfer over {emulation} at {cfg.draft_fit_rate_gbps:g} Gbps "
            f"({cfg.receiver_repeats} x {len(split)} split-stream codecs) {what}")
        got: list[dict] = []
        receiver_loads(cfg.model.name, split, cfg.receiver_context_tokens, seed,
                       cfg.text_source, bandwidth_gbps=cfg.draft_fit_rate_gbps,
                       repeats=cfg.receiver_repeats, threads=cfg.threads,
                       split_cpus=cfg.split_cpus, dequantize=cfg.dequantize,
                       emulation=emulation, first_step_extra_s=extra_s, keep_rows=got)
        link_rows.extend(got)
        return got

    def fitted(of: list[dict]) -> tuple[Any, float, list[Any]] | None:
        """(fit, median window s, windows) of these rows' drafts; None without any."""
        windows = draft_ingest.windows_from_rows(of)
        if not windows:
            return None
        return (draft_ingest.fit(windows, extra_s or 0.0),
                float(np.median([w.end_s - w.start_s for w in windows])), windows)

    first_rows = fit_rate_transfer(cfg.seed + 30_000,
                                   "for the draft step's slowdown with the arrival rate")
    made = fitted(rows + first_rows)
    if made is None:
        return draft
    fit, window_s, windows = made
    first_fit: dict | None = None
    if fit.rms_s > FIT_RMS_WARN * window_s:
        # a poor fit rests on a few windows, some disturbed (the per-request step alone varies
        # as much as the fit's miss: CHANGELOG.md, 2026-11-28), and least squares follows the
        # disturbed ones: once, one more transfer at the fit rate is made, and the fit that
        # misses least (relative to its windows) of: with it in place of the first, with both
        say(f"the draft step's fit on {emulation} misses its requests' last drafts by "
            f"{fit.rms_s * 1e3:.0f} ms (rms) over windows of {window_s * 1e3:.0f} ms "
            f"(median, busy_ratio {fit.busy_ratio:g}): one more transfer, to fit again")
        first_fit = {"busy_ratio": fit.busy_ratio, "ingest_s_per_byte": fit.ingest_s_per_byte,
                     "rms_s": fit.rms_s, "requests": fit.requests,
                     "median_window_s": window_s}
        second_rows = fit_rate_transfer(cfg.seed + 40_000, "more, to fit the draft step again")
        candidates = [m for m in (fitted(rows + second_rows),
                                  fitted(rows + first_rows + second_rows)) if m is not None]
        fit, window_s, windows = min(candidates, key=lambda m: m[0].rms_s / m[1])
    poor = fit.rms_s > FIT_RMS_WARN * window_s
    if poor:
        say(f"the draft step's fit on {emulation} misses its requests' last drafts by "
            f"{fit.rms_s * 1e3:.0f} ms (rms) over windows of {window_s * 1e3:.0f} ms "
            f"(median): busy_ratio {fit.busy_ratio:g} is poorly determined (a disturbed "
            f"transfer?); its windows are in the profile (draft_step.fit.windows); "
            f"calibrating again may give another")
    return {**draft, "busy_ratio": fit.busy_ratio, "ingest_s_per_byte": fit.ingest_s_per_byte,
            "fit": {"requests": fit.requests, "steps_matched": fit.steps_matched,
                    "rms_s": fit.rms_s, "saturated": fit.saturated,
                    "median_window_s": window_s, "poor": poor,
                    # the poor first fit that one more transfer replaced (None: none was)
                    "first_fit": first_fit,
                    "rates_gbps": [CALIBRATION_RATE_GBPS, cfg.draft_fit_rate_gbps],
                    "measured": "busy_ratio and ingest_s_per_byte replay these requests' "
                                "drafts on their worker spans and arrivals, matched on each "
                                "draft step's end (kvsim.calibrate.draft_ingest); "
                                "`busy_ratio` before the "
                                "fit: the median of per-request ratios",
                    "median_busy_ratio": draft.get("busy_ratio"),
                    # what was fitted, to be inspected or fitted again (Unix s)
                    "windows": [dataclasses.asdict(w) for w in windows]}}


def _print(rows: list[dict], paths: dict[str, Path], root: Path, dequantize: str) -> None:
    model = [r for r in rows if r["what"] == "model" and "prefill_s" in r]
    print(format_table(model, [("item", "model", ""), ("prefill_s", "prefill s", ".3f"),
                               ("decode_step_ms", "decode step ms", ".1f"),
                               ("first_step_extra_ms", "first step +ms", ".1f")]))
    for r in rows:
        if "cache_build_gb_per_s" in r:
            print(f"cache build from dequantized layers: {r['cache_build_gb_per_s']:.3f} GB/s "
                  "of bf16 cache")
    codec = [r for r in rows if r["what"] == "codec"]
    print(f"codec GB/s of bf16 cache; with receiver_loads, encode: in the sender of the "
          f"calibration transfer, dequantize: in its receiver, {dequantize.replace('_', ' ')}")
    print(format_table(codec, [("item", "codec", ""),
                               ("encode_gb_per_s", "encode GB/s", ".3f"),
                               ("decode_gb_per_s", "dequantize GB/s", ".3f"),
                               ("anchor_decode_gb_per_s", "anchor dequantize GB/s", ".3f"),
                               ("layer_job_fixed_ms", "layer job fixed ms", ".2f"),
                               ("layer_job_gb_per_s", "+ GB/s", ".3f")]))
    links = [r for r in rows if r["what"] == "link"]
    if links:
        print(format_table(links, [("item", "link", ""), ("efficiency", "efficiency", ".4f"),
                                   ("latency_ms", "latency ms", ".2f"),
                                   ("message_overhead_bytes", "B/message", ".0f"),
                                   ("fit_max_abs_pct_error", "fit max %", ".2f"),
                                   ("draft_step_ratio", "draft step x", ".3f"),
                                   ("draft_busy_ratio", "busy x", ".3f"),
                                   ("draft_ingest_ns_per_byte", "ns/B in", ".1f"),
                                   ("handshake_ms", "handshake ms", ".2f"),
                                   ("worker_alone", "worker x", ".3f"),
                                   ("worker_encoder", "+ encoder", ".3f"),
                                   ("worker_ingest", "+ ingest", ".3f"),
                                   ("encoder_ratios", "encoder x", ""),
                                   ("status", "status", "")]))
    link_keys = [k for k in paths if k.startswith("link:") and paths[k].is_file()]
    print(f"profiles written under {root}; use them with:\n  kvsim sim hardware=local-cpu "
          f"hardware.profile={paths['hardware']} codec_timing={paths['codec_timing']} "
          f"deserializer={dequantize}" +
          "".join(f"\n    link.profile={paths[k]}  # transport.emulation={k[5:]}"
                  for k in link_keys))
