"""`kvsim validate`: how far the simulator is from the real transport, measured.

Every scenario (emulation x link rate x context, all codecs at once) runs emulated (`kvsim
emulate`: real frames over the emulated link, live SmolLM2 prefill, real greedy decode) and
simulated (`kvsim sim` with the profiles `kvsim calibrate` measured; see
kvsim.fidelity.runner for what the simulator is given; before each single-request scenario
a decode-step probe sets the level of its step curves, kvsim.fidelity.step_probe).
Metrics: TTFT and TT{k}T from prefill end, drafted and committed (kvsim.fidelity.errors).
The multi-request case (Poisson arrivals, one shared link; timing-model decode, or with
multi.decode=real the real model's batched forwards) compares TTFT p50 / p99 from arrival
and TPOT p50 / p99.

Writes fidelity.json (mean_abs_pct_error, max_abs_pct_error, targets, per-scenario rows),
fidelity.md (one line per scenario and codec, the signed error of every metric),
fidelity.png (simulated vs measured) and scenarios/<scenario>.json (both engines' full rows)
in the run directory; the rows are the report's too. What else ran on the host meanwhile
(kvsim.core.host_load) is measured over the calibration, the comparisons and each scenario:
its rows carry `background_cores`, the summary `host_load`. After the comparisons the step
level the simulations stood on is checked against the scenarios' own steps, and the host
probed again (kvsim.fidelity.step_level: the summary's `step_level`).

`measured_from=<report.json or run dir>` simulates a saved run's scenarios again against
the measurements it saved, with no emulation (seconds): how a change to the simulator moves
its error against real transfers (_resimulate). Its scenarios/<scenario>.json hold the
simulator's rows only (the measured ones are the saved run's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from kvsim.core.host_load import HostLoadMeter
from kvsim.core.report import finite_number, format_table
from kvsim.fidelity.batch_level import BatchSteps
from kvsim.fidelity.drafting import drafting_line
from kvsim.fidelity.first_draft import KEYS as FIRST_DRAFT_KEYS
from kvsim.fidelity.first_draft import DraftModel, draft_model_of, first_draft_keys
from kvsim.fidelity.first_draft import simulated_s as first_draft_simulated_s
from kvsim.fidelity.noise_floor import noise_floor_line
from kvsim.fidelity.step_level import step_level
from kvsim.fidelity.worker_level import (
    level_keys,
    paced_link_profile,
    scenario_worker_level,
    worker_level,
)
from kvsim.model.host import DriftConfig
from kvsim.model.spec import ModelSpec

GRIDS = ("full", "quick", "heldout")
# other work keeping more CPUs than this busy on average (over the calibration, the
# comparisons or one scenario) makes a run's figures a shared host's, said beside them
SHARED_HOST_BACKGROUND_CORES = 0.25

# grid=heldout: contexts and link rates that neither the full grid nor the calibration
# (kvsim.calibrate.pipeline: link_rates_gbps 0.1 / 0.5 / 1.0, its transfers at 0.3 and 0.8
# Gbps) uses, calibrated at the full grid's contexts only: the model is asked off its grid
FULL_GRID_CONTEXTS = [1024, 2048]  # prompt tokens of grid=full (the calibration's too)
HELDOUT_RATES_GBPS = [0.2, 0.6]
HELDOUT_CONTEXTS = [1536]
HELDOUT_CODECS = ["int8", "int4", "lynx"]
# its multi-request case: a prompt length and link rate no other case uses, at three loads
# below the one prefill instance's saturation (768-token prefills take ~2.4 s on the shipped
# profile's host: 0.35 req/s keeps it ~85% busy), decoding 64 tokens (~4.5 s, longer than a
# prefill: decodes overlap, and batch; with 32 they followed one another)
HELDOUT_MULTI = {"bandwidth_gbps": 0.6, "context_tokens": 768,
                 "rates_per_s": [0.12, 0.25, 0.35], "output_tokens": 64}
# ... and the one runs measured before the emulator batched (their configs have no
# multi.max_batch): kept so that measured_from= simulates their scenarios again
HELDOUT_MULTI_UNBATCHED = {"bandwidth_gbps": 0.6, "context_tokens": 1536,
                           "rates_per_s": [0.2, 0.4]}


# the keys each grid sets (Config.apply_grid)
GRID_KEYS = {
    "quick": ("emulations", "rates_gbps", "contexts", "codecs", "multi.rates_per_s",
              "multi.requests"),
    "heldout": ("rates_gbps", "contexts", "codecs",
                *sorted({f"multi.{k}" for k in (*HELDOUT_MULTI, *HELDOUT_MULTI_UNBATCHED)})),
}


def _config_value(cfg: Any, dotted: str) -> Any:
    """A Config's value at `dotted` (cfg None: the default)."""
    first, _, rest = dotted.partition(".")
    if cfg is None:
        f = next(f for f in dataclasses.fields(Config) if f.name == first)
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    else:
        value = getattr(cfg, first)
    return getattr(value, rest) if rest else value


@dataclass
class PrefixTraceConfig:
    """The prefix-reuse case on a trace with prefix blocks instead of the hand-made
    conversations: whole conversations of a window, each prompt scaled with its blocks
    (kvsim.scenario.trace_sample), arrival gaps scaled."""

    name: str = ""  # "": the hand-made conversations; a shipped trace's name, or a path
    start_s: float = 600.0  # the window of the trace's time the conversations come from
    duration_s: float = 600.0
    conversations: int = 4  # the first ones with >= min_turns requests, prompts short enough
    min_turns: int = 2
    trace_block_tokens: int = 512  # the trace's blocks (Mooncake's: 512 tokens)
    # a block in the replay, and the codecs' page (kvsim.transport.config: whole pages per
    # block): 64 replays Mooncake's prompts at 1/8 of their length (12,035 -> ~1,500 tokens)
    block_tokens: int = 64
    max_context_tokens: int = 2048  # after scaling: the longest prompt a conversation may have
    time_scale: float = 0.1  # arrival gaps x this (0.1: 10 minutes replayed in one)


@dataclass
class PrefixCaseConfig:
    """The prefix-reuse case: multi-turn conversations whose turns repeat the earlier turns'
    prompt (and every conversation the same first block, a system prompt), replayed by both
    engines with prefix reuse on the decode side (kvsim.transport.prefix_store,
    kvsim.sim.prefix_reuse); timing-model decode, one link, one decode instance."""

    enabled: bool = False  # run it (kvsim validate prefix.enabled=true)
    emulation: str = "token_bucket"
    bandwidth_gbps: float = 0.2  # 1e9 bit/s, one link shared by every request
    conversations: int = 3
    turns: int = 3  # per conversation
    first_tokens: int = 768  # a conversation's first prompt
    turn_tokens: int = 256  # what each later turn adds (the answer, the next question)
    block_tokens: int = 256  # prefix block size: a multiple of the codecs' pages
    gap_s: float = 20.0  # between a conversation's turns (its answer decodes in between)
    stagger_s: float = 4.0  # between the conversations' first turns
    output_tokens: int = 32  # decoded per request
    codecs: list[Any] = field(default_factory=lambda: ["int8", "lynx"])
    max_batch: int = 8  # the decode instance's batch
    trace: PrefixTraceConfig = field(default_factory=PrefixTraceConfig)


class TargetMissed(ValueError):
    """fail_on_target=true and the mean or the worst error is above its target."""


MULTI_DECODES = ("timing", "real")


@dataclass
class MultiConfig:
    enabled: bool = True  # run the multi-request case
    emulation: str = "token_bucket"  # its link emulation (token_bucket | tc | none)
    bandwidth_gbps: float = 0.2  # 1e9 bit/s, one link shared by every request
    # Poisson arrivals: three loads of the one prefill instance (512-token prefills take
    # ~1.6 s on the shipped profile's host) whose decodes overlap more and more
    rates_per_s: list[float] = field(default_factory=lambda: [0.2, 0.35, 0.5])
    requests: int = 8  # per rate and codec
    context_tokens: int = 512  # every request's prompt
    output_tokens: int = 32  # decoded per request
    codecs: list[Any] = field(default_factory=lambda: ["int8", "lynx"])
    # the decode side: timing (the profile's modelled steps slept and a synthetic KV source:
    # checks who shares which steps, each step's cost the profile's) | real (the real model's
    # batched forwards on a live prefill's KV, kvsim.transport.model_batch: the batched
    # steps' cost is measured too, the prefill and the decode sharing the host's cores)
    decode: str = "timing"
    # one decode instance batching up to this many requests, every member stepping with the
    # others in both engines (kvsim.transport.decode_batch, kvsim.sim.batch); 1: every
    # request on a decode instance of its own, decoding alone (how runs before batching
    # were measured)
    max_batch: int = 8
    # prefill instances the arrivals are routed over (least loaded), each one prompt at a
    # time; more than one shares the link (link.sharing=shared: the emulator's one link)
    prefill_nodes: int = 1


@dataclass
class Config:
    model: ModelSpec = MISSING
    # full | quick (CI: 1 emulation, 1 rate, 1 context, 2 codecs) | heldout (rates and a
    # context outside the full grid and the calibration: HELDOUT_*)
    grid: str = "full"
    calibrate: bool = False  # true: kvsim calibrate into <run dir>/profiles first
    profile_dir: str = ""  # where calibrated profiles are; "": data/profiles
    profile_name: str = ""  # "": local-<model>
    emulations: list[str] = field(default_factory=lambda: ["token_bucket", "tc"])
    rates_gbps: list[float] = field(default_factory=lambda: [0.1, 0.3, 1.0])  # link, 1e9 bit/s
    contexts: list[int] = field(default_factory=lambda: list(FULL_GRID_CONTEXTS))  # tokens
    codecs: list[Any] = field(default_factory=lambda: ["bf16", "int8", "int4", "lynx"])
    output_tokens: int = 64  # decoded per request (real greedy decode)
    # emulated requests per codec in each single-request scenario, the codecs' requests
    # interleaved: the measured value is their mean, their range `measured_spread_pct`
    # (the host's decode step moves by ~10% between 5-second windows)
    repeats: int = 2
    # decode steps of the probe taken before each single-request scenario (0: none): the
    # simulator's step curves, and the host's other work, are scaled to it there
    # (kvsim.fidelity.step_probe: the host's step drifts by tens of percent over a full
    # validation's ~50 minutes). Off by default: a 24-step probe (~2 s) lands as far from
    # its scenario's steps as the calibrated step does (CHANGELOG.md, "The step probe")
    step_probe_steps: int = 0
    # true: each single-request scenario's simulator takes its step level from the decode
    # steps that scenario's emulated run measured (the median over its codecs), after the
    # emulation, the host's other work with it (kvsim.fidelity.step_probe); the
    # calibration keeps the curves' shape. What is compared is then the model (transfer,
    # dequantization, first step, drafting, verification) and not the host's speed that
    # minute; the calibrated step's own error is still reported (the "decode step" line).
    # CI's gate uses it (a step calibrated three minutes earlier landed 4-27% from the
    # scenario's on this host)
    step_from_scenario: bool = False
    # true: each single-request scenario's simulator runs its on-arrival worker at the pace
    # that scenario's emulated requests measured (kvsim.fidelity.worker_level: the link
    # profile's worker_pace.alone x their jobs / the calibrated pace's), after the
    # emulation. The worker's pace moved 0.87-1.46 x between a calibration and its
    # scenarios on this host, and it moves the drafting
    worker_from_scenario: bool = False
    # % a scenario's worker level may lie from 1 (the calibrated pace) before the summary
    # says the worker was not the calibration's (reported; the verdict is the errors')
    worker_level_tolerance_pct: float = 10.0
    # the emulated transfers' sender and decode host on CPUs of their own, calibration's too
    # (transport.split_cpus, kvsim.transport.cpus); a saved run's setting is in its config
    split_cpus: bool = False
    ks: list[int] = field(default_factory=lambda: [32, 64])  # TT<k>T compared (with TTFT)
    acceptance: str = "smollm2-135m-lynx-s1-greedy"  # the simulator's acceptance curve
    samples: int = 16  # simulator runs averaged per single-request row (acceptance draws)
    multi: MultiConfig = field(default_factory=MultiConfig)
    prefix: PrefixCaseConfig = field(default_factory=PrefixCaseConfig)
    # this host against the hardware profile's, probed before anything is compared
    # (kvsim.model.host): rescale the profile's model times | refuse | off
    drift: DriftConfig = field(default_factory=DriftConfig)
    # s watching the host with this process idle before anything is measured: other work
    # above SHARED_HOST_BACKGROUND_CORES is warned of at once (0: no look; the calibration's,
    # the comparisons' and each scenario's background are measured anyway)
    host_check_s: float = 2.0
    target_mean_abs_pct: float = 5.0  # % mean absolute error over every comparison
    target_max_abs_pct: float = 10.0  # % worst absolute error
    # % the scenarios' measured decode steps may lie from the simulated one on average
    # before the run is not met on its step level (kvsim.fidelity.step_level): the mean
    # target's 5%, since a step off by more moves every decode-bound metric by about as much
    step_level_tolerance_pct: float = 5.0
    fail_on_target: bool = False  # true: exit non-zero when the mean is above its target
    figure: bool = True  # fidelity.png in the run directory
    # a validate run's report.json (or the directory holding it): simulate its scenarios
    # again and compare with the measurements it saved, without emulating anything (see
    # _resimulate: the scenarios are the saved run's, the simulator's settings this one's)
    measured_from: str = ""

    def __post_init__(self) -> None:
        if self.grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {self.grid!r}")
        # (measured_from: the saved run's output tokens bound ks; _resimulate checks them
        # against the ks that run measured)
        if not self.measured_from and any(k > self.output_tokens or k < 2 for k in self.ks):
            raise ValueError(f"ks must be in 2..output_tokens ({self.output_tokens}), "
                             f"got {self.ks}")
        if not self.host_check_s >= 0:
            raise ValueError(f"host_check_s must be >= 0 s, got {self.host_check_s}")
        if not 0 < self.step_level_tolerance_pct < 1000:
            raise ValueError(f"step_level_tolerance_pct must be in (0, 1000) %, got "
                             f"{self.step_level_tolerance_pct}")
        if not 0 < self.worker_level_tolerance_pct < 1000:
            raise ValueError(f"worker_level_tolerance_pct must be in (0, 1000) %, got "
                             f"{self.worker_level_tolerance_pct}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.step_probe_steps < 0:
            raise ValueError(f"step_probe_steps must be >= 0 (0: no probe), got "
                             f"{self.step_probe_steps}")
        if self.multi.decode not in MULTI_DECODES:
            raise ValueError(f"multi.decode must be one of {MULTI_DECODES}, got "
                             f"{self.multi.decode!r}")
        if self.step_probe_steps and self.step_from_scenario:
            raise ValueError("step_probe_steps and step_from_scenario=true both set the "
                             "simulator's step level: choose one")

    def apply_grid(self, refuse_given: bool = True) -> None:
        """grid=quick: CI's few scenarios (about 4 minutes with calibration); grid=heldout:
        HELDOUT_* (HELDOUT_MULTI_UNBATCHED for a saved run measured unbatched).
        refuse_given: a key the grid sets that the command line set too (off its default)
        is refused rather than silently replaced (False for a saved run's config, which
        holds the grid's values already)."""
        if refuse_given and self.grid in GRID_KEYS:
            given = [k for k in GRID_KEYS[self.grid]
                     if _config_value(self, k) != _config_value(None, k)]
            if given:
                raise ValueError(f"grid={self.grid} sets {', '.join(given)} itself: leave "
                                 f"{'it' if len(given) == 1 else 'them'} out, or give your "
                                 f"own grid with grid=full")
        if self.grid == "quick":
            # 0.1 Gbps: lynx's residual is still on the wire when its anchor is loaded, so
            # it drafts in both engines (at 0.3 Gbps the two race, and a flip between
            # drafting and not moves TTFT by a decode step)
            self.emulations, self.rates_gbps, self.contexts = ["token_bucket"], [0.1], [1024]
            self.codecs = ["int8", "lynx"]
            # one request's 64 steps span one ~5 s window of the host's speed, which
            # alone moves TT64T by up to ~10%: three per codec, interleaved
            self.repeats = max(self.repeats, 3)
            self.multi.rates_per_s, self.multi.requests = [0.3], 6
        elif self.grid == "heldout":
            self.rates_gbps, self.contexts = list(HELDOUT_RATES_GBPS), list(HELDOUT_CONTEXTS)
            self.codecs = list(HELDOUT_CODECS)
            multi = HELDOUT_MULTI if self.multi.max_batch > 1 else HELDOUT_MULTI_UNBATCHED
            for key, v in multi.items():
                setattr(self.multi, key, list(v) if isinstance(v, list) else v)

    @property
    def calibration_contexts(self) -> list[int]:
        """The validated contexts the calibration measures at: the grid's own, but the full
        grid's for grid=heldout (whose contexts are held out of the calibration)."""
        if self.grid == "heldout":
            return list(FULL_GRID_CONTEXTS)
        return list(self.contexts)


def _say(msg: str) -> None:
    print(f"validate: {msg}", file=sys.stderr, flush=True)


def _calibrate(cfg: Config, root: Path, name: str, emulations: list[str]) -> None:
    from kvsim.calibrate.pipeline import Config as CalConfig
    from kvsim.calibrate.pipeline import calibrate
    from kvsim.kernels.presets import resolve_codec

    quick = cfg.grid == "quick"
    grid = cfg.calibration_contexts
    contexts = {256, *grid} if quick else {256, 1024, 2048, 4096, *grid}
    # the multi-request case's prompt where the curves would extrapolate to it, or where
    # its emulator prefills and decodes with the real model (multi.decode=real: a live
    # prefill of 512 tokens took 1.68 s here where the line between 256 and 1,024 gives
    # 1.80); with the timing-model decode both engines sleep the modelled prefill and
    # steps, and between measured contexts the fitted curves serve it. grid=heldout leaves
    # it out of the calibration on purpose
    multi_ctx = cfg.multi.context_tokens
    if cfg.grid != "heldout" and (cfg.multi.decode == "real" or
                                  not min(contexts) <= multi_ctx <= max(contexts)):
        contexts.add(multi_ctx)
    contexts = sorted(contexts)
    real_multi = cfg.multi.enabled and cfg.multi.decode == "real"
    worker_codec = next((c for c in cfg.multi.codecs
                         if resolve_codec(c).build().layer_independent), None) \
        if real_multi else None
    cal = CalConfig(model=cfg.model, name=name, contexts=contexts,
                    drafted=[1, 2, 4, 8, 16] if quick else [1, 2, 4, 8, 16, 32, 64],
                    codecs=sorted({str(c) for c in [*cfg.codecs, *cfg.multi.codecs]}),
                    # every batch the multi-request and prefix cases' decode instances can
                    # step (at least 2: a profile's one-size curve gives no ratio)
                    batches=list(range(1, _largest_batch(cfg) + 1)),
                    codec_context_tokens=max(grid), links=emulations,
                    # the receiver's calibration transfers at the validated contexts (the
                    # longest; the shortest for the layer-job fit and the step there), so
                    # that neither is extrapolated to the single-request scenarios (the
                    # multi-request case's context may lie outside; on demand there is
                    # no fit and the one step ratio applies flat)
                    receiver_context_tokens=max(grid),
                    receiver_fit_context_tokens=min(grid) if min(grid) < max(grid) else -1,
                    # the multi case's real decode steps beside its live prefills (the
                    # simulator mirrors them there: workload.colocated_prefill)
                    beside_prefill_tokens=multi_ctx if real_multi else 0,
                    # ... and beside the on-arrival worker's jobs (workload.worker_slows_decode),
                    # of the first of its codecs whose layers decode alone
                    beside_worker_tokens=multi_ctx if real_multi and worker_codec else 0,
                    beside_worker_codec=worker_codec or "int8",
                    out_dir=str(root), overwrite=True, split_cpus=cfg.split_cpus)
    _say(f"calibrating into {root} (prompts, decode steps, codecs, links)")
    calibrate(cal)


def _largest_batch(cfg: Config) -> int:
    """The largest batch a decode instance of the validation's enabled cases can step
    (at least 2)."""
    return max([2] + [c.max_batch for c in (cfg.multi, cfg.prefix) if c.enabled])


def _emulations(cfg: Config) -> tuple[list[str], list[str]]:
    """(emulations to run, notes on the ones skipped)."""
    from kvsim.transport.netns import netns_available

    want = list(dict.fromkeys([*cfg.emulations] +
                              ([cfg.multi.emulation] if cfg.multi.enabled else []) +
                              ([cfg.prefix.emulation] if cfg.prefix.enabled else [])))
    notes = []
    if "tc" in want:
        ok, why = netns_available()
        if not ok:
            want.remove("tc")
            notes.append(f"tc skipped: {why}")
    return want, notes


def validate(cfg: Config) -> dict:
    from kvsim.calibrate.host_probe import SubprocessStepProbe
    from kvsim.core.outputs import out_root
    from kvsim.core.paths import DATA_DIR
    from kvsim.fidelity import errors
    from kvsim.fidelity.runner import (
        by_codec,
        emulate_rows,
        find_profiles,
        kept_decode_host,
        run_pair,
        scenario_overrides,
        sim_overrides,
        simulate,
    )

    if cfg.measured_from:
        return _resimulate(cfg)
    cfg.apply_grid()
    run_dir = out_root(None)
    emulations, notes = _emulations(cfg)
    for note in notes:
        _say(note)
    name = cfg.profile_name or f"local-{cfg.model.name}"
    root = Path(cfg.profile_dir) if cfg.profile_dir else DATA_DIR / "profiles"
    # what else ran here: first alone, then meanwhile (kvsim.core.host_load)
    host_load: dict[str, Any] = {"before": _host_before(cfg.host_check_s)}
    if cfg.calibrate:
        root = run_dir / "profiles"
        meter = HostLoadMeter()
        _calibrate(cfg, root, name, emulations)
        host_load["calibration"] = _load_dict(meter)
    profiles = find_profiles(root, name, emulations)
    if not cfg.calibrate:  # what ran beside the profile's own measurement, where it says
        host_load["profile"] = _profile_background(profiles.hardware)
    hardware = profiles.hardware  # the profile as found (the probe after is against it)
    profiles, drift = _drift(cfg, profiles, run_dir)
    started = time.time()
    comparisons = HostLoadMeter()
    rows: list[dict] = []
    single = errors.single_metrics(list(cfg.ks))
    grid = [(e, r, c) for e in cfg.emulations if e in emulations for r in cfg.rates_gbps
            for c in cfg.contexts]
    # each probe in a process of its own: probed in the emulating process, the emulation
    # after it stalled (kvsim.calibrate.host_probe.SubprocessStepProbe)
    probe = SubprocessStepProbe(cfg.model, cfg.step_probe_steps) \
        if cfg.step_probe_steps else None
    # one decode host for all of an emulation's scenarios; each context's prompt prefilled
    # once for all of them (the sender runs in this process: prefills_held)
    from kvsim.transport.source import prefills_held

    with prefills_held(), contextlib.ExitStack() as hosts:
        host, host_emulation = None, ""
        for i, (emulation, rate, ctx) in enumerate(grid):
            _say(f"[{i + 1}/{len(grid)}] {emulation} {rate:g} Gbps, {ctx} tokens, "
                 f"{len(cfg.codecs)} codecs ({time.time() - started:.0f} s so far)")
            name, workload = _single_scenario(emulation, rate, ctx, cfg.output_tokens)
            # the emulator runs each codec `repeats` times, interleaved; the simulator once
            # one prompt per context: its live prefill runs once in this process and is reused
            # by every later request of it, in this scenario and the later ones (the metrics
            # are from prefill end)
            emulated = scenario_overrides(cfg.model.name, emulation, rate,
                                          [c for _ in range(cfg.repeats) for c in cfg.codecs],
                                          workload, list(cfg.ks), profiles, cfg.split_cpus) + \
                ["transport.reuse_prefill=true"]
            if emulation != host_emulation:
                hosts.close()
                host = hosts.enter_context(kept_decode_host(emulated, max(cfg.contexts)))
                host_emulation = emulation
            common = scenario_overrides(cfg.model.name, emulation, rate, cfg.codecs, workload,
                                        list(cfg.ks), profiles)
            sim = sim_overrides(common, profiles, cfg.acceptance, cfg.samples)
            probed: dict[str, Any] = {}
            calibrated: dict[str, dict] | None = None  # the unscaled simulation, where scaled
            meter = HostLoadMeter()
            if probe is not None:  # the step's speed now (kvsim.fidelity.step_probe)
                sim, probed = _probed(sim, profiles, ctx, probe.step_s(ctx), run_dir, name)
            if cfg.step_from_scenario or cfg.worker_from_scenario:  # the emulation first
                measured = emulate_rows(emulated, host)
                if cfg.step_from_scenario:
                    calibrated = by_codec(simulate(sim))  # the calibrated step's own error
                    sim, probed = _probed(sim, profiles, _mid_context(ctx, cfg.output_tokens),
                                          _scenario_step_s(measured, name), run_dir, name,
                                          "the scenario's own step", source="scenario")
                worker = _worker_level(measured, sim, cfg.model, name)
                if cfg.worker_from_scenario:
                    sim = _worker_paced(sim, worker, run_dir, name)
                simulated = simulate(sim)
            else:
                measured, simulated = run_pair(emulated, sim, host)
                worker = _worker_level(measured, sim, cfg.model, name)
            background = _background_keys(meter)
            _keep(run_dir, name, {"measured": measured, "simulated": simulated})
            sim_by = by_codec(simulated)
            drafts = draft_model_of(sim, cfg.model.name, ctx)  # the profiles it ran on
            for codec, m in by_codec(measured).items():
                s = sim_by[codec]
                n = int(m.get("requests") or 1)  # repeats: drafts are summed over them
                scenario = {"case": "single", "emulation": emulation, "bandwidth_gbps": rate,
                            "context_tokens": ctx, "codec": codec, "repeats": n,
                            "accepted_measured": f"{m.get('accepted_tokens', 0) / n:.3g}/"
                                                 f"{m.get('proposed_tokens', 0) / n:.3g}",
                            "prefill_measured_s": m.get("prefill_s"),
                            # the decode step after the first (s/token): errors.step_error_pct
                            "tpot_measured_s": m.get("tpot_s"),
                            **_single_keys(s, probed, calibrated, codec),
                            **level_keys(worker, cfg.worker_from_scenario),
                            **first_draft_keys(m, s, drafts),
                            **_drift_keys(cfg, drift), **background}
                rows += errors.compare(scenario, m, s, single)
    distributions: list[dict] = []
    batched = None  # the multi-request case's batch level (real decode)
    if cfg.multi.enabled and cfg.multi.emulation in emulations:
        multi_rows, distributions, (batched, note) = _multi(cfg, profiles, started, run_dir)
        if note:
            _say(note)
        rows += [{**r, **_drift_keys(cfg, drift)} for r in multi_rows]
    if cfg.prefix.enabled and cfg.prefix.emulation in emulations:
        prefix_rows, prefix_distributions = _prefix(cfg, profiles, started, run_dir)
        rows += [{**r, **_drift_keys(cfg, drift)} for r in prefix_rows]
        distributions += prefix_distributions
    host_load["comparisons"] = _load_dict(comparisons)
    after = _probe_after(cfg, hardware, run_dir)
    return _conclude(cfg, rows, run_dir, profiles,
                     {"notes": notes, "drift": drift.as_dict() if drift else None,
                      "probe_after": after.as_dict() if after else None,
                      "host_load": _host_load_summary(host_load, rows),
                      "cpu_wakeup": _cpu_wakeup(run_dir), "batch_level": batched},
                     started, distributions)


def _load_dict(meter: HostLoadMeter) -> dict | None:
    """The meter's interval so far (kvsim.core.host_load.HostLoad.as_dict), None where the
    host's times cannot be read."""
    load = meter.read()
    return load.as_dict() if load is not None else None


def _host_before(check_s: float) -> dict | None:
    """The host's other work over check_s with this process idle, before anything is
    measured; said at once, with a warning where it is above SHARED_HOST_BACKGROUND_CORES
    (None: check_s 0, or the host's times unreadable)."""
    meter = HostLoadMeter()
    if not check_s or not meter.available:
        return None
    time.sleep(check_s)
    load = meter.read()
    if load is None:
        return None
    shared = load.background_cores > SHARED_HOST_BACKGROUND_CORES
    _say(f"host: {load.describe()} before this run" + (
        ": a shared host; the figures will hold for a host this busy (the summary says "
        "how busy it was during each part)" if shared else ""))
    return load.as_dict()


def _profile_background(hardware_profile: Any) -> dict | None:
    """The other work a hardware profile recorded beside its calibration (`host.background`,
    kvsim.calibrate.pipeline), None for a profile that recorded none."""
    try:
        host = json.loads(Path(hardware_profile).read_text()).get("host")
    except (OSError, ValueError, AttributeError):
        return None
    load = host.get("background") if isinstance(host, dict) else None
    return load if isinstance(load, dict) and isinstance(
        load.get("background_cores"), (int, float)) and "cpus" in load else None


def _background_keys(meter: HostLoadMeter) -> dict:
    """A scenario's row keys: the CPUs other work kept busy while it ran (none unmeasured)."""
    load = meter.read()
    return {"background_cores": round(load.background_cores, 3)} if load is not None else {}


def _host_load_summary(loads: dict[str, dict | None], rows: list[dict]) -> dict:
    """The summary's host_load: the intervals before the run (this process idle), of the
    calibration (or what the profile recorded of its own: `profile`) and of the
    comparisons, the most any one scenario had beside it, and whether the host was shared
    (some interval above SHARED_HOST_BACKGROUND_CORES); `measured` False where nothing
    could be read."""
    scenarios = [r["background_cores"] for r in rows
                 if isinstance(r.get("background_cores"), (int, float))]
    seen = [v["background_cores"] for v in loads.values() if v] + scenarios
    return {**loads, "max_scenario_background_cores": max(scenarios, default=None),
            "measured": bool(seen),
            "shared": bool(seen) and max(seen) > SHARED_HOST_BACKGROUND_CORES}


def _host_load_line(load: Any, measured_by: str = "this run") -> str:
    """One line on what else ran beside the measurements (a summary's host_load)."""
    if not isinstance(load, dict) or not load.get("measured"):
        return f"host: other work beside {measured_by} not measured"
    parts = []
    for phase, when in (("profile", "while its profile was calibrated"),
                        ("before", "before it"), ("calibration", "during the calibration"),
                        ("comparisons", "during the comparisons")):
        v = load.get(phase)
        if isinstance(v, dict):
            parts.append(f"{v['background_cores']:.2f} of {v['cpus']} CPUs {when}")
    most = load.get("max_scenario_background_cores")
    if isinstance(most, (int, float)):
        parts.append(f"at most {most:.2f} in one scenario")
    verdict = ("a shared host: these figures hold for a host this busy" if load.get("shared")
               else "a quiet host")
    return f"host: other work beside {measured_by} kept busy {', '.join(parts)}: {verdict}"


def _drift(cfg: Config, profiles: Any, run_dir: Path) -> tuple[Any, Any]:
    """This host's decode step against the hardware profile's, before anything is compared
    (kvsim.model.host): (the profiles to use, the Drift or None: drift.action=off, or
    profiles calibrated by this run, calibrate=true). A rescaled profile is written under
    run_dir/profiles-rescaled and used by both engines (it is also the emulator's timing
    model in the multi-request case); refuse raises kvsim.calibrate.host_probe.DriftRefused."""
    from kvsim.calibrate.host_probe import check_drift

    if cfg.drift.action == "off":
        return profiles, None
    if cfg.calibrate:
        # profiles measured minutes ago by this process on this host: nothing has drifted
        # that a probe could tell from its own noise (two probes of one host minutes apart
        # landed 11.7% apart, and rescaling by that made every decode-bound metric late)
        _say("host: profiles calibrated in this run, on this host: no drift probe")
        return profiles, None
    drift = check_drift(profiles.hardware, cfg.model, cfg.drift,  # (this process then
                        run_dir / "profiles-rescaled", force=True, own_process=True)  # emulates)
    assert drift is not None  # force: always probed unless off
    profiles = _with_rescaled(profiles, drift, run_dir)
    _say(f"host: {drift.words()}")
    return profiles, drift


def _probe_after(cfg: Config, hardware: Path, run_dir: Path) -> Any:
    """The host probed again after the comparisons, as before them and against the same
    hardware profile (the Drift, outcome "measured": nothing rescaled, written or refused;
    None with drift.action=off): whether the host moved during the run
    (kvsim.fidelity.step_level)."""
    from kvsim.calibrate.host_probe import check_drift

    after = check_drift(hardware, cfg.model, cfg.drift, run_dir, force=True,
                        own_process=True, act=False)
    if after is not None:
        _say(f"host after the comparisons: {after.words()}")
    return after


def _with_rescaled(profiles: Any, drift: Any, run_dir: Path,
                   only: list[str] | None = None) -> Any:
    """The profiles with a rescaled drift's hardware profile and, rescaled with it, the codec
    timing and link profiles calibrated together with their hardware profile
    (host_probe.rescale_companions; only: those a saved run rescaled)."""
    from dataclasses import replace

    from kvsim.calibrate.host_probe import rescale_companions

    if drift.outcome != "rescaled":
        return profiles
    timing, links = rescale_companions(drift, json.loads(profiles.hardware.read_text()),
                                       profiles.codec_timing, profiles.links,
                                       run_dir / "profiles-rescaled", only)
    return replace(profiles, hardware=Path(drift.profile), codec_timing=timing, links=links)


def _drift_keys(cfg: Config, drift: Any) -> dict:
    """A comparison row's record of the host check (as kvsim sim's rows: Drift.row_keys):
    "calibrated_in_run" where the profiles were made by this run (not probed), "off" where
    drift.action=off."""
    if drift is not None:
        return drift.row_keys()
    return {"hardware_drift": "calibrated_in_run" if cfg.calibrate and
            cfg.drift.action != "off" else "off"}


def _resimulate(cfg: Config) -> dict:
    """measured_from=: the scenarios of a saved run simulated again, with this simulator,
    against the measurements that run saved (its report's rows): a change to the simulator
    checked against real transfers in seconds (the shipped full run's 304 comparisons: 4 s
    here), without emulating anything.

    From the saved run: the model, the scenarios it compared (emulations, rates, contexts,
    codecs, output tokens, the multi-request case) and their step probes. From this
    command: acceptance, samples, ks (among those the saved run compared), profile_dir /
    profile_name, the targets, figure. Profiles: profile_dir= when given; else the
    profiles/ beside the report (a calibrate=true run's directory, or a shipped copy under
    data/fidelity/); else the saved run's profile_dir (data/profiles by default)."""
    from kvsim.core.outputs import out_root
    from kvsim.core.paths import DATA_DIR
    from kvsim.fidelity import errors
    from kvsim.fidelity.runner import find_profiles, scenario_overrides, sim_overrides, simulate

    if cfg.calibrate:
        raise ValueError("calibrate=true and measured_from= together: a re-simulation uses "
                         "the measured run's profiles (or profile_dir=), it measures nothing")
    report_path, report, saved = _saved_run(cfg.measured_from)
    unsaved = sorted(set(cfg.ks) - set(saved.ks))
    if unsaved:
        raise ValueError(f"ks={list(cfg.ks)}: {report_path} compared TT<k>T for ks="
                         f"{list(saved.ks)} only (no measurement of k={unsaved})")
    groups: dict[tuple, list[dict]] = {}  # errors.SCENARIO_KEYS -> rows
    for r in report["rows"]:
        groups.setdefault(tuple(r.get(k) for k in errors.SCENARIO_KEYS), []).append(r)
    name = cfg.profile_name or saved.profile_name or f"local-{saved.model.name}"
    beside = report_path.parent / "profiles"
    if cfg.profile_dir:
        root = Path(cfg.profile_dir)
    elif beside.is_dir():
        root = beside
    elif saved.calibrate:
        raise FileNotFoundError(
            f"{report_path}: that run calibrated into its run directory's profiles/, which "
            f"is not beside the report; give profile_dir= (the directory holding hardware/, "
            f"codec_timing/ and link/)")
    else:
        root = Path(saved.profile_dir) if saved.profile_dir else DATA_DIR / "profiles"
    profiles = find_profiles(root, name, sorted({str(k[1]) for k in groups}))
    run_dir = out_root(None)
    profiles = _saved_drift(report, profiles, run_dir, other=bool(cfg.profile_dir))
    started = time.time()
    provenance = report.get("provenance") if isinstance(report.get("provenance"), dict) else {}
    notes = [f"{key}={mine} (the measured run's simulator had {theirs})"
             for key, mine, theirs in (("acceptance", cfg.acceptance, saved.acceptance),
                                       ("samples", cfg.samples, saved.samples))
             if mine != theirs]
    for note in notes:
        _say(note)
    _say(f"simulating the {len(groups)} scenarios of {report_path} against its measurements "
         f"(profiles {root}/{name}; measured at "
         f"{provenance.get('git_describe', 'an unknown commit')})")
    rows: list[dict] = []
    single = errors.single_metrics(list(cfg.ks))
    # the saved run's per-request comparisons (a run before they were kept has none)
    saved_distributions: dict[tuple, list[dict]] = {}
    for d in report.get("distributions") or []:
        if isinstance(d, dict) and isinstance(d.get("measured_s"), list):
            saved_distributions.setdefault(
                (d.get("emulation"), d.get("bandwidth_gbps"), d.get("context_tokens"),
                 d.get("rate_per_s")), []).append(d)
    distributions: list[dict] = []
    batched = _batch_steps(saved.multi)  # from the run's scenario files, where it kept them
    colocated = _colocated(saved.multi, profiles)  # (its simulator's, as in _multi)
    for (case, emulation, rate, ctx, per_s), saved_rows in groups.items():
        calibrated: dict[str, dict] | None = None  # the unscaled simulation, where needed
        measured_by: dict[str, dict] = {}
        worker: float | None = None
        if case == "single":
            scenario, workload = _single_scenario(emulation, rate, ctx, saved.output_tokens)
            common = scenario_overrides(saved.model.name, emulation, rate, saved.codecs,
                                        workload, list(cfg.ks), profiles)
            sim = sim_overrides(common, profiles, cfg.acceptance, cfg.samples)
            probe_s = saved_rows[0].get("step_probe_s")  # s, or absent (no probe)
            source = str(saved_rows[0].get("step_level_from") or "probe")
            probe_ctx = saved_rows[0].get("step_probe_context_tokens")
            if cfg.step_from_scenario:  # asked of this re-simulation: the saved steps' level
                probe_s = _scenario_step_s(  # one step per codec
                    [{"tpot_s": t} for t in {str(r["codec"]): r.get("tpot_measured_s")
                                             for r in saved_rows}.values()], scenario)
                source, probe_ctx = "scenario", _mid_context(ctx, saved.output_tokens)
            probed: dict[str, Any] = {}
            if isinstance(probe_s, (int, float)) and probe_s > 0:  # applied to these profiles
                if source == "scenario":  # the calibrated step's own error, as measured
                    calibrated = {str(r["codec"]): r for r in simulate(sim)}
                sim, probed = _probed(sim, profiles,
                                      probe_ctx if isinstance(probe_ctx, int) else ctx,
                                      probe_s, run_dir, scenario,
                                      f"the saved step ({source})", source=source)
            # the emulated requests' rows, where the run's scenario files are beside its
            # report: the worker level again, on this simulation's profiles
            measured_by = _saved_measured(report_path.parent, scenario)
            worker = _worker_level(list(measured_by.values()), sim, saved.model, scenario) \
                if measured_by else \
                _saved_worker_level(saved_rows, probed, other_profiles=root != beside)
            if cfg.worker_from_scenario:
                if not measured_by:
                    raise RuntimeError(
                        f"{report_path}: worker_from_scenario=true needs the emulated "
                        f"requests' rows (scenarios/{scenario}.json beside the report), "
                        "which this run did not keep")
                sim = _worker_paced(sim, worker, run_dir, scenario)
            metrics = single
        elif case == "prefix":
            scenario, codecs, workload = _prefix_scenario(saved.prefix)
            common = scenario_overrides(saved.model.name, emulation, rate, codecs, workload,
                                        [], profiles)
            sim, requests_path = _with_request_log(
                sim_overrides(common, profiles, cfg.acceptance, 1), run_dir, scenario)
            compared = {r["metric"] for r in saved_rows}
            metrics = [m for m in errors.PREFIX_METRICS if m.name in compared]
        else:
            m = saved.multi
            scenario = _multi_name(emulation, per_s)
            if (emulation, rate, ctx) != (m.emulation, m.bandwidth_gbps, m.context_tokens):
                raise ValueError(
                    f"{report_path}: its {scenario} rows were measured over {emulation} at "
                    f"{rate:g} Gbps with {ctx}-token prompts, its config's multi case is "
                    f"{m.emulation} at {m.bandwidth_gbps:g} Gbps with {m.context_tokens}")
            common = scenario_overrides(saved.model.name, emulation, rate, m.codecs,
                                        _multi_workload(m, per_s), [], profiles)
            sim, requests_path = _with_request_log(  # seed 0's arrivals
                sim_overrides(common, profiles, cfg.acceptance, 1) + colocated, run_dir,
                scenario)
            if batched.real:
                batched.add(list(_saved_measured(report_path.parent, scenario).values()), sim)
            # (a run measured before the multi case compared TPOT percentiles has none)
            compared = {r["metric"] for r in saved_rows}
            metrics = [m for m in errors.MULTI_METRICS if m.name in compared]
        _say(f"{scenario} ({time.time() - started:.0f} s so far)")
        simulated = {str(r["codec"]): r for r in simulate(sim)}
        if case in ("multi", "prefix"):  # the per-request comparisons the saved run measured
            logged: dict[tuple, dict[str, list[float]]] = {}  # the log read once per codec
            for d in saved_distributions.get((emulation, rate, ctx, per_s), []):
                seqs = d.get("seq") or list(range(len(d["measured_s"])))
                key = (str(d["codec"]), tuple(seqs))
                if key not in logged:
                    logged[key] = _simulated_requests(
                        requests_path, key[0], seqs,
                        PREFIX_PER_REQUEST_METRICS if case == "prefix" else PER_REQUEST_METRICS)
                again = logged[key]
                measured_requests = {d["metric"]: [errors.number(v) for v in d["measured_s"]]}
                distributions += _distribution_rows(
                    {**{k: d[k] for k in (*errors.SCENARIO_KEYS, "codec", "requests")},
                     "seq": seqs}, measured_requests, {d["metric"]: again[d["metric"]]})
        _keep(run_dir, scenario, {"measured_from": str(report_path),
                                  "simulated": list(simulated.values())})
        by_codec: dict[str, list[dict]] = {}
        for r in saved_rows:
            by_codec.setdefault(str(r["codec"]), []).append(r)
        drafts: DraftModel | None = None
        if case == "single":
            drafts = draft_model_of(sim, saved.model.name, ctx)
        for codec, codec_rows in by_codec.items():
            s = simulated.get(codec)
            if s is None:
                raise ValueError(f"{report_path}: its {scenario} rows name codec {codec!r}, "
                                 f"which its config's codecs do not ({', '.join(simulated)})")
            update = {}
            if case == "single":
                update = {**_single_keys(s, probed, calibrated, codec),
                          **level_keys(worker, cfg.worker_from_scenario),
                          **_first_draft_again(codec_rows[0], s, measured_by.get(codec), drafts,
                                               other_profiles=root != beside)}
            rows += errors.recompare(codec_rows, s, metrics, update)
    saved_summary = report.get("fidelity") if isinstance(report.get("fidelity"), dict) else {}
    batch, note = batched.level()
    if note:
        _say(note)
    return _conclude(cfg, rows, run_dir, profiles, {
        "notes": notes, "measured_from": str(report_path),
        "measured_provenance": provenance,
        "measured_host_load": saved_summary.get("host_load"),
        "measured_cpu_wakeup": _summary_cpu_wakeup(saved_summary),
        "batch_level": batch}, started, distributions)


def _saved_drift(report: dict, profiles: Any, run_dir: Path, other: bool = False) -> Any:
    """The profiles of a re-simulation with the saved run's host rescale applied again (its
    factor, not a new probe: the measurements are that run's, on that host that day). Not
    to other profiles (`other`: profile_dir= given), whose level the factor says nothing of."""
    from dataclasses import replace

    from kvsim.calibrate.host_probe import Drift
    from kvsim.model.host import write_rescaled_profile

    drift = (report.get("fidelity") or {}).get("drift")
    if not isinstance(drift, dict) or drift.get("outcome") != "rescaled":
        return profiles
    saved = Drift.from_dict(drift)
    contexts, factors = saved.points()
    said = " / ".join(f"{f:.3f}" for f in factors) + \
        ("" if len(contexts) == 1 else f" at {' / '.join(map(str, contexts))} tokens")
    if other:
        _say(f"the measured run rescaled its own profile x {said}; profile_dir= gives "
             "others: not applied to them")
        return profiles
    path = write_rescaled_profile(
        json.loads(profiles.hardware.read_text()),
        run_dir / "profiles-rescaled" / profiles.hardware.name, factors,
        {"from_profile": str(profiles.hardware), "from_report": "the measured run's rescale"},
        contexts)
    _say(f"the measured run rescaled its hardware profile x {said} (its host probe): "
         "applied again")
    # the codec timing and links it rescaled with it, again (none: a run that rescaled its
    # hardware profile alone)
    return _with_rescaled(profiles, replace(saved, profile=str(path), companions=[]),
                          run_dir, list(saved.companions))


def _saved_run(where: str) -> tuple[Path, dict, Config]:
    """(report path, report, its validate config) of measured_from=: a report.json that
    `kvsim validate` wrote, or the run directory holding it."""
    from omegaconf import OmegaConf

    from kvsim.fidelity.errors import SCENARIO_KEYS

    path = Path(where)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise FileNotFoundError(f"measured_from={where}: no such report (a `kvsim validate` "
                                f"run directory, or its report.json)")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"measured_from={where}: {path} is not JSON ({e})") from e
    if not isinstance(report, dict) or report.get("command") != "validate" \
            or not isinstance(report.get("rows"), list) or "config" not in report:
        raise ValueError(f"measured_from={where}: {path} is not a `kvsim validate` report "
                         f"(command {report.get('command') if isinstance(report, dict) else None})")
    rows = report["rows"]
    if not rows:
        raise ValueError(f"measured_from={where}: {path} has no comparison rows")
    bad = [i for i, r in enumerate(rows) if not _comparison_row(r)]
    if bad:
        raise ValueError(f"measured_from={where}: rows {bad[:5]} of {path} are not comparison "
                         f"rows (case single|multi|prefix, emulation, codec and metric names, "
                         f"bandwidth_gbps, context_tokens, a multi row's rate_per_s, "
                         f"measured_s)")
    seen: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        key = tuple(r.get(k) for k in (*SCENARIO_KEYS, "codec", "metric"))
        if key in seen:
            raise ValueError(f"measured_from={where}: rows {seen[key]} and {i} of {path} are "
                             f"the same comparison ({', '.join(map(str, key))})")
        seen[key] = i
    if (report.get("config") or {}).get("measured_from"):
        raise ValueError(f"measured_from={where}: {path} is itself a re-simulation (of "
                         f"{report['config']['measured_from']}); its config is not that of "
                         f"the measured run: point measured_from= at the measured run")
    doc = report["config"]
    if isinstance(doc, dict) and isinstance(doc.get("multi"), dict) \
            and "max_batch" not in doc["multi"]:  # measured before the emulator batched
        doc = {**doc, "multi": {**doc["multi"], "max_batch": 1}}
    try:
        saved = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), doc))
    except Exception as e:  # OmegaConf's errors: an unknown key, a wrong type
        raise ValueError(f"measured_from={where}: the config in {path} is not one of this "
                         f"kvsim validate's ({e})") from e
    assert isinstance(saved, Config)
    saved.apply_grid(refuse_given=False)
    return path, report, saved


def _comparison_row(r: Any) -> bool:
    """A report row `_resimulate` can use: its scenario's keys typed as validate wrote them."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    return (isinstance(r, dict) and r.get("case") in ("single", "multi", "prefix")
            and isinstance(r.get("emulation"), str) and isinstance(r.get("codec"), str)
            and isinstance(r.get("metric"), str) and number(r.get("bandwidth_gbps"))
            and isinstance(r.get("context_tokens"), int) and "measured_s" in r
            and (r["case"] != "multi" or number(r.get("rate_per_s"))))


def _conclude(cfg: Config, rows: list[dict], run_dir: Path, profiles: Any, extra: dict,
              started: float, distributions: list[dict] | None = None) -> dict:
    """Summary against the targets, printed and written (fidelity.json, fidelity.md,
    fidelity.png); raises TargetMissed under fail_on_target. distributions: the
    multi-request case's per-request comparisons (_distribution_rows), reported beside."""
    distributions = distributions or []
    from kvsim.core.report import json_safe
    from kvsim.fidelity import errors

    summary = errors.summary(rows)
    met_mean = bool(summary["compared"]) and \
        summary["mean_abs_pct_error"] <= cfg.target_mean_abs_pct
    met_max = bool(summary["compared"]) and \
        summary["max_abs_pct_error"] <= cfg.target_max_abs_pct
    # the decode-step level the simulation stood on, against the scenarios' own steps and
    # the host probes before and after the comparisons (kvsim.fidelity.step_level)
    level = step_level(float(summary.get("step_mean_abs_pct_error", math.nan)),
                       cfg.step_level_tolerance_pct, extra.get("drift"),
                       extra.get("probe_after"),
                       from_scenario=_level_from_scenario(rows),
                       run=str(extra.get("measured_from") or run_dir))
    summary.update(target_mean_abs_pct=cfg.target_mean_abs_pct,
                   target_max_abs_pct=cfg.target_max_abs_pct,
                   met_mean=met_mean, met_max=met_max,
                   met=met_mean and met_max and level.trusted, step_level=level.as_dict(),
                   # the on-arrival worker's pace in the scenarios (kvsim.fidelity.worker_level)
                   worker_level=_worker_check(cfg, rows, run_dir, extra).as_dict(),
                   profiles={"hardware": str(profiles.hardware),
                             "codec_timing": str(profiles.codec_timing),
                             **{f"link.{k}": str(v) for k, v in profiles.links.items()}},
                   **extra, wall_s=time.time() - started)
    _print(rows, summary, distributions)
    doc = {"summary": summary, "rows": rows, "distributions": distributions}
    (run_dir / "fidelity.json").write_text(json.dumps(json_safe(doc), indent=1) + "\n")
    (run_dir / "fidelity.md").write_text(errors.markdown_table(rows) + (
        "\n" + errors.distributions_table(distributions) if distributions else ""))
    if cfg.figure and rows:
        from kvsim.plots.fidelity import draw
        from kvsim.plots.style import save

        paths = save(draw(rows, summary, model=cfg.model.name), run_dir / "fidelity.png",
                     ["png"], 150)
        _say(f"figure: {paths[0]} (kvsim plot kind=fidelity input=<report.json> redraws it)")
    if cfg.fail_on_target and not met_mean:  # CI's gate: the mean (the worst is reported)
        raise TargetMissed(f"fidelity target missed: mean |error| "
                           f"{summary['mean_abs_pct_error']:.2f}% > "
                           f"{cfg.target_mean_abs_pct}% (worst "
                           f"{summary['max_abs_pct_error']:.2f}%, target "
                           f"{cfg.target_max_abs_pct}%); see fidelity.json in the run directory")
    return {"rows": rows, **{k: summary[k] for k in ("mean_abs_pct_error",
                                                      "max_abs_pct_error")},
            "fidelity": summary, "distributions": distributions}


def _worker_check(cfg: Config, rows: list[dict], run_dir: Path, extra: dict) -> Any:
    """The worker level's check (kvsim.fidelity.worker_level) of this run, or of the saved
    run a re-simulation compared against (whose scenario files may not have been kept)."""
    saved = extra.get("measured_from")
    return worker_level(rows, cfg.worker_level_tolerance_pct, str(saved or run_dir),
                        resimulable=not saved or (Path(saved).parent / "scenarios").is_dir())


def _cpu_wakeup(run_dir: Path) -> dict:
    """Whether the decode hosts held the CPUs awake (kvsim.core.wakeup_latency), over every
    emulated request of the scenarios kept under run_dir (a re-simulation takes the saved
    run's summary instead): {"requests", "held": how many, "held_us": the latencies held,
    "not_recorded": rows without the field (a sender's own row, or a run from before it)}."""
    held_us: set[int] = set()
    held = requests = not_recorded = 0
    for path in sorted((run_dir / "scenarios").glob("*.json")):
        for row in json.loads(path.read_text()).get("measured") or []:
            requests += int(row.get("requests") or 1)
            if "cpu_wakeup_held_us" not in row:
                not_recorded += int(row.get("requests") or 1)
            elif row["cpu_wakeup_held_us"] is not None:
                held += int(row.get("requests") or 1)
                held_us.add(int(row["cpu_wakeup_held_us"]))
    return {"requests": requests, "held": held, "held_us": sorted(held_us),
            "not_recorded": not_recorded}


def _summary_cpu_wakeup(summary: dict) -> Any:
    """A summary's wake-up count (_cpu_wakeup): its own run's, or, for a re-simulation, the
    measured run's (None where neither is recorded)."""
    return summary.get("cpu_wakeup", summary.get("measured_cpu_wakeup"))


def _cpu_wakeup_line(wakeup: Any) -> str | None:
    """One line on the CPUs' idle states under the emulated requests (None: not recorded)."""
    if not isinstance(wakeup, dict) or wakeup.get("requests", 0) == wakeup.get("not_recorded"):
        return None
    n, held = wakeup["requests"] - wakeup["not_recorded"], wakeup["held"]
    if held == n:
        return (f"CPUs held awake (wake-up latency {'/'.join(map(str, wakeup['held_us']))} us) "
                f"under all {n} emulated requests")
    return (f"CPUs not held awake under {n - held} of {n} emulated requests "
            "(transport.cpu_wakeup_us=-1, or the decode host could not take the hold and said "
            "why): a decode step after an idle wait may have run slower")


def _level_from_scenario(rows: list[dict]) -> bool:
    """Every single-request comparison took its step level from its scenario's own
    measured steps (step_from_scenario, or a re-simulation of a run that did)."""
    single = [r for r in rows if r.get("case") == "single"]
    return bool(single) and all(r.get("step_level_from") == "scenario" for r in single)


def _saved_measured(run_dir: Path, name: str) -> dict[str, dict]:
    """A saved run's emulated rows of scenario `name` by codec, from the scenario file it
    kept (_keep); {} where there is none (a shipped run keeps its report only)."""
    path = run_dir / "scenarios" / f"{name}.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    measured = doc.get("measured") if isinstance(doc, dict) else None
    return {str(r["codec"]): r for r in measured or []
            if isinstance(r, dict) and "codec" in r}


def _saved_worker_level(saved_rows: list[dict], probed: dict, other_profiles: bool
                        ) -> float | None:
    """A saved scenario's worker level where its emulated rows are not at hand: the saved
    one where this simulation's worker pace and codec timing are those it was measured
    against (the same profiles, at the same step scale), else None (a level is a ratio to
    one profile's pace on one codec timing)."""
    saved = finite_number(saved_rows[0].get("worker_level"))
    scale, saved_scale = (finite_number(probed.get("step_scale")),
                          finite_number(saved_rows[0].get("step_scale")))
    same_scale = (scale is None and saved_scale is None) or (
        scale is not None and saved_scale is not None
        and math.isclose(scale, saved_scale, rel_tol=1e-9))
    return None if other_profiles or not same_scale else saved


def _first_draft_again(saved_row: dict, s: dict, measured: dict | None,
                       drafts: DraftModel | None, other_profiles: bool) -> dict:
    """A re-simulated row's first-draft keys (kvsim.fidelity.first_draft): all three again
    where the emulated requests are at hand (None over saved ones where neither engine
    drafts now); else the saved measured and replayed times are carried, the replay dropped
    where the profiles are others than those beside the run's report (it was the run's
    model's: `profile_dir=`, or data/profiles, recalibrated since), and the simulated time
    is this simulation's."""
    if measured is not None:
        keys = first_draft_keys(measured, s, drafts)
        if not keys and any(k in saved_row for k in FIRST_DRAFT_KEYS):
            return dict.fromkeys(FIRST_DRAFT_KEYS)
        return keys
    simulated = first_draft_simulated_s(s)
    if simulated is None and not any(k in saved_row for k in FIRST_DRAFT_KEYS):
        return {}
    keys: dict[str, Any] = {"first_draft_simulated_s": simulated}
    if other_profiles and "first_draft_replayed_s" in saved_row:
        keys["first_draft_replayed_s"] = None
    return keys


def _keep(run_dir: Path, name: str, doc: dict) -> None:
    """A scenario's full rows (both engines', or the simulator's against saved
    measurements), for tracing any error to its phases."""
    from kvsim.core.report import json_safe

    path = run_dir / "scenarios" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(doc)) + "\n")


def _simulated_keys(s: dict) -> dict:
    """A scenario's keys that the simulator gives: its accepted / proposed drafts (per
    request), its prefill and its decode step after the first (s)."""
    return {"accepted_simulated": f"{s.get('accepted_tokens', 0):.3g}/"
                                  f"{s.get('proposed_tokens', 0):.3g}",
            "prefill_simulated_s": s.get("prefill_s"), "tpot_simulated_s": s.get("tpot_s")}


def _single_keys(s: dict, probed: dict, calibrated: dict[str, dict] | None,
                 codec: str) -> dict:
    """A single-request row's simulated keys: _simulated_keys, the step level's keys
    (_probed), and where the compared simulation was scaled to the scenario's own step, the
    calibrated simulation's step as tpot_simulated_s (its own error)."""
    keys = {**_simulated_keys(s), **probed}
    if calibrated is not None:
        keys["tpot_simulated_s"] = calibrated[codec].get("tpot_s")
    return keys


def _probed(sim: list[str], profiles: Any, ctx: int, probe_s: float, run_dir: Path,
            name: str, what: str = "step probe", source: str = "probe"
            ) -> tuple[list[str], dict[str, Any]]:
    """The simulator's overrides with the hardware profile scaled to a decode step of
    probe_s seconds at ctx tokens, and the codec timing and link profile it names scaled with
    it (the host's other CPU work: kvsim.fidelity.step_probe), written under
    run_dir/profiles-probed; and the scenario's probe keys: step_probe_s,
    step_probe_context_tokens, step_scale and step_level_from (probe: a step probe;
    scenario: the scenario's own measured step)."""
    from kvsim.fidelity.step_probe import probed_companions, probed_profile

    out_dir = run_dir / "profiles-probed"
    path = out_dir / f"{name}.json"
    scale = probed_profile(profiles.hardware, ctx, probe_s, path)

    timing, link = probed_companions(
        *_sim_profiles(sim), scale, out_dir, name,
        {"step_level_from": source, "context_tokens": ctx, "step_s": probe_s})
    _say(f"{what} at {ctx} tokens: {probe_s * 1e3:.1f} ms ({scale:.3f} x the "
         "calibrated step; the codecs, cache build, ingest and handshake with it)")
    return (_swapped(sim, {"hardware.profile": path, "codec_timing": timing,
                           "link.profile": link}),
            {"step_probe_s": probe_s, "step_probe_context_tokens": ctx,
             "step_scale": scale, "step_level_from": source})


def _override_key(override: str) -> str:
    return override.split("=", 1)[0]


def _sim_profiles(sim: list[str]) -> tuple[Path, Path]:
    """(codec timing, link profile) the simulator's overrides name."""
    given = {_override_key(o): o.split("=", 1)[1] for o in sim}
    return Path(given["codec_timing"]), Path(given["link.profile"])


def _swapped(sim: list[str], swap: dict[str, Any]) -> list[str]:
    """The overrides with those of swap's keys set to its values."""
    return [f"{_override_key(o)}={swap[_override_key(o)]}" if _override_key(o) in swap
            else o for o in sim]


def _worker_level(measured: list[dict], sim: list[str], model: ModelSpec, name: str
                  ) -> float | None:
    """The scenario's worker level (kvsim.fidelity.worker_level) against the profiles its
    simulation runs on; None, said, where its rows cannot be read for one (a malformed row
    loses the level, not the validation)."""
    try:
        return scenario_worker_level(measured, *_sim_profiles(sim), model)
    except (KeyError, TypeError, ValueError, OSError, json.JSONDecodeError) as exc:
        _say(f"{name}: no worker level ({type(exc).__name__}: {exc})")
        return None


def _worker_paced(sim: list[str], level: float | None, run_dir: Path, name: str
                  ) -> list[str]:
    """The simulator's overrides with its link profile's worker at `level` x the pace it
    had (kvsim.fidelity.worker_level), written to run_dir/profiles-worker; as they were,
    said, where the scenario has no level (no on-arrival jobs measured, or no worker pace
    for this model in its link profile): its rows then say worker_level_from
    "calibration"."""
    if level is None:
        _say(f"{name}: no on-arrival layer jobs measured against a worker pace (or its link "
             "profile has none for this model): simulated on the calibrated worker")
        return sim
    link = paced_link_profile(_sim_profiles(sim)[1], level,
                              run_dir / "profiles-worker" / f"{name}-link.json",
                              {"worker_level_from": "scenario"})
    _say(f"the scenario's own worker: {level:.3f} x the simulated pace")
    return _swapped(sim, {"link.profile": link})


def _mid_context(context_tokens: int, output_tokens: int) -> int:
    """The context (tokens) at which a request's mean decode step is taken: its steps after
    the first run from context + 1 to context + output_tokens - 1."""
    return context_tokens + output_tokens // 2


def _scenario_step_s(measured: list[dict], name: str) -> float:
    """The decode step (s) a single-request scenario's emulated run measured: the median over
    its codecs of their mean step on the full cache (`tpot_s`)."""
    import math
    import statistics

    steps = [float(r["tpot_s"]) for r in measured
             if isinstance(r.get("tpot_s"), (int, float)) and math.isfinite(r["tpot_s"])
             and r["tpot_s"] > 0]
    if not steps:
        raise RuntimeError(f"{name}: the emulated run measured no decode step (tpot_s), so "
                           "step_from_scenario=true has no level to take")
    return statistics.median(steps)


def _single_scenario(emulation: str, bandwidth_gbps: float, context_tokens: int,
                     output_tokens: int) -> tuple[str, list[str]]:
    """A single-request scenario's name (its files under scenarios/ and profiles-probed/)
    and its workload keys (both engines)."""
    return (f"single-{emulation}-{bandwidth_gbps:g}gbps-{context_tokens}",
            ["workload=emulated", f"workload.context_tokens={context_tokens}",
             f"workload.output_tokens={output_tokens}"])


def _multi_name(emulation: str, rate_per_s: float) -> str:
    """The multi-request case's name at one arrival rate (its file under scenarios/)."""
    return f"multi-{emulation}-{rate_per_s:g}per-s"


def _multi_workload(m: MultiConfig, rate_per_s: float) -> list[str]:
    """The multi-request case's workload keys at one arrival rate (both engines)."""
    # max_batch 1: an instance per request, each decoding alone
    nodes, batch = (m.requests, 1) if m.max_batch <= 1 else (1, m.max_batch)
    shared = ["link.sharing=shared"] if m.prefill_nodes > 1 else []
    return ["workload=poisson", f"workload.requests={m.requests}",
            f"workload.rate_per_s={rate_per_s}", f"workload.context_tokens={m.context_tokens}",
            "workload.context_dist=fixed", f"workload.output_tokens={m.output_tokens}",
            f"workload.prefill_nodes={m.prefill_nodes}", f"workload.decode_nodes={nodes}",
            f"workload.decode_max_batch={batch}", f"transport.decode={m.decode}",
            f"transport.kv_source={'synthetic' if m.decode == 'timing' else 'live'}", *shared]


def _multi(cfg: Config, profiles: Any, started: float, run_dir: Path
           ) -> tuple[list[dict], list[dict], tuple[dict | None, str]]:
    """The multi-request case's comparisons, its per-request distributions, and its batch
    level (kvsim.fidelity.batch_level: the record or None, and a note where it could not be
    measured)."""
    from kvsim.fidelity import errors
    from kvsim.fidelity.runner import (
        by_codec,
        kept_decode_host,
        run_pair,
        scenario_overrides,
        sim_overrides,
    )

    m = cfg.multi
    rows, distributions = [], []
    if not m.rates_per_s:
        return rows, distributions, (None, "")
    batched = _batch_steps(m)
    colocated = _colocated(m, profiles)
    if m.decode == "real":
        _say_colocated(colocated)
    # one decode host for the three loads (they differ in arrivals alone)
    first = scenario_overrides(cfg.model.name, m.emulation, m.bandwidth_gbps, m.codecs,
                               _multi_workload(m, m.rates_per_s[0]), [], profiles,
                               cfg.split_cpus)
    with kept_decode_host(first) as host:
        for rate in m.rates_per_s:
            _say(f"multi-request: {m.requests} Poisson arrivals at {rate:g}/s on "
                 f"{m.prefill_nodes} prefill instance(s) over "
                 f"{m.bandwidth_gbps:g} Gbps ({m.emulation}), "
                 f"{'timing-model' if m.decode == 'timing' else 'real batched'} decode "
                 f"({time.time() - started:.0f} s so far)")
            name = _multi_name(m.emulation, rate)
            common = scenario_overrides(cfg.model.name, m.emulation, m.bandwidth_gbps, m.codecs,
                                        _multi_workload(m, rate), [], profiles, cfg.split_cpus)
            # one sample: the emulator replays the arrivals of seed 0 and so must the simulator
            # (percentiles of other arrival draws are not the same quantity)
            sim, requests_path = _with_request_log(
                sim_overrides(common, profiles, cfg.acceptance, 1) + colocated, run_dir, name)
            meter = HostLoadMeter()
            measured, simulated = run_pair(common, sim, host)
            background = _background_keys(meter)
            _keep(run_dir, name, {"measured": measured, "simulated": simulated})
            batched.add(measured, sim)
            sim_by = by_codec(simulated)
            for codec, row in by_codec(measured).items():
                scenario = {"case": "multi", "emulation": m.emulation,
                            "bandwidth_gbps": m.bandwidth_gbps, "context_tokens": m.context_tokens,
                            "codec": codec, "rate_per_s": rate, "requests": m.requests,
                            **({"prefill_nodes": m.prefill_nodes} if m.prefill_nodes > 1 else {}),
                            **({"decode": m.decode} if m.decode != "timing" else {}),
                            **background}
                rows += errors.compare(scenario, row, sim_by[codec], errors.MULTI_METRICS)
                requests = _measured_requests(row)
                if requests is not None:
                    seqs = requests.pop("seq")
                    distributions += _distribution_rows(
                        {**scenario, "seq": seqs}, requests,
                        _simulated_requests(requests_path, codec, seqs))
    return rows, distributions, batched.level()


# the simulator's overrides that mirror the emulator's one host in the real-decode multi
# case, each where the hardware profile has the measurement it needs: (profile entry,
# override, what it slows the decode steps beside)
_HOST_OVERRIDES = (
    ("tpot_beside_prefill", "workload.colocated_prefill=true", "a prefill"),
    ("tpot_beside_worker", "workload.worker_slows_decode=true", "the on-arrival workers"))


def _colocated(m: MultiConfig, profiles: Any) -> list[str]:
    """The simulator's overrides that mirror the emulator's one host in the multi-request
    case, where the emulator decodes with the real model: workload.colocated_prefill (its
    decode steps slowed while a prefill runs) where the hardware profile timed a step
    beside a prefill (kvsim.calibrate.beside_prefill), workload.worker_slows_decode (slowed
    while a request's on-arrival worker dequantizes) where it timed one beside the worker
    (kvsim.calibrate.beside_worker) and the receiver dequantizes on arrival (its codec
    timing's mode: on demand there is no worker); none otherwise (the timing-model decode
    sleeps the profile's steps, which neither slows)."""
    if m.decode != "real":
        return []
    doc = json.loads(profiles.hardware.read_text())
    return [override for entry, override, _ in _HOST_OVERRIDES if doc.get(entry) and
            (entry != "tpot_beside_worker" or profiles.dequantize == "on_arrival")]


def _say_colocated(overrides: list[str]) -> None:
    """One line on what the simulator's decode steps are slowed beside (real decode)."""
    beside = [what for _, override, what in _HOST_OVERRIDES if override in overrides]
    missing = [entry for entry, override, _ in _HOST_OVERRIDES if override not in overrides]
    # (a worker measurement left out because the receiver dequantizes on demand is said
    # as missing: calibrate=true measures both with dequantize=on_arrival)
    _say("multi-request: the simulator's decode steps " +
         (f"slowed beside {' and '.join(beside)}, as the profile measured them "
          f"({', '.join(o.split('=')[0] for o in overrides)})" if beside else "as alone") +
         (f"; the profile has no {' or '.join(missing)} (calibrate=true measures them)"
          if missing else ""))


def _batch_steps(m: MultiConfig) -> BatchSteps:
    """The multi-request case's batch level (kvsim.fidelity.batch_level), measured where
    its one decode instance batches the real model's forwards with a slot for every request
    (the timing-model decode sleeps the profile's steps; one slot per request runs lone
    forwards side by side; more requests than slots would count a waiting one)."""
    return BatchSteps(m.decode == "real" and 1 < m.max_batch and m.requests <= m.max_batch,
                      _mid_context(m.context_tokens, m.output_tokens))


PREFIX_CASE = "prefix-reuse"  # the prefix-reuse case's scenario name
PREFIX_TRACE_CASE = "prefix-trace"  # ... replaying a trace's conversations (prefix.trace)


def _prefix_turns(p: PrefixCaseConfig) -> list[tuple[float, int, tuple[int, ...]]]:
    """(arrival s, prompt tokens, block ids) of every request of the prefix-reuse case, in
    arrival order: the hand-made conversations (block 0 shared by all), or prefix.trace's."""
    tr = p.trace
    if tr.name:
        from kvsim.scenario.request_trace import read_trace, replay
        from kvsim.scenario.trace_sample import sample_conversations, scale_blocks

        window = replay(read_trace(tr.name), tr.start_s, tr.duration_s)
        sample = sample_conversations(
            scale_blocks(window, tr.trace_block_tokens, tr.block_tokens), tr.conversations,
            tr.min_turns, tr.max_context_tokens)
        return [(round(float(t) * tr.time_scale, 6), int(n), b) for t, n, b in zip(
            sample.arrival_s, sample.context_tokens, sample.prefix_blocks or (), strict=True)]
    bt = p.block_tokens
    turns = []
    for c in range(p.conversations):
        for t in range(p.turns):
            tokens = p.first_tokens + t * p.turn_tokens
            blocks = (0, *(1000 * (c + 1) + j for j in range(1, -(-tokens // bt))))
            turns.append((c * p.stagger_s + t * p.gap_s, tokens, blocks))
    return sorted(turns, key=lambda x: x[0])


def _prefix_scenario(p: PrefixCaseConfig) -> tuple[str, list[Any], list[str]]:
    """The prefix-reuse case's scenario name, codecs and workload keys (both engines). On a
    trace, the codecs' pages are its blocks (a preset name becomes the preset with
    page_tokens = the replay's block, keeping its label; a mapping is taken as given)."""
    from kvsim.fidelity.runner import override_list as _list

    turns = _prefix_turns(p)
    bt, name, codecs = p.block_tokens, PREFIX_CASE, list(p.codecs)
    if p.trace.name:
        bt, name = p.trace.block_tokens, PREFIX_TRACE_CASE
        codecs = [f"{{preset:{c},label:{c},params:{{page_tokens:{bt}}}}}"
                  if isinstance(c, str) else c for c in codecs]
    return name, codecs, [
        "workload.kind=trace", f"workload.arrivals_t={_list([a for a, _, _ in turns])}",
        f"workload.arrivals_context_tokens={_list([n for _, n, _ in turns])}",
        "workload.arrivals_prefix_blocks=[" + ",".join(_list(b) for _, _, b in turns) + "]",
        f"workload.output_tokens={p.output_tokens}", "workload.prefill_nodes=1",
        "workload.decode_nodes=1", f"workload.decode_max_batch={p.max_batch}",
        "prefix_cache.enabled=true", "prefix_cache.prefill_capacity_gb=0",
        f"prefix_cache.block_tokens={bt}", "transport.decode=timing",
        "transport.kv_source=synthetic"]


def _prefix(cfg: Config, profiles: Any, started: float, run_dir: Path
            ) -> tuple[list[dict], list[dict]]:
    """The prefix-reuse case: the emulated decode node's prefix store against the
    simulator's decode-side prefix delta, per codec (errors.PREFIX_METRICS) and per request
    (PREFIX_PER_REQUEST_METRICS)."""
    from kvsim.fidelity.runner import by_codec, run_pair, scenario_overrides, sim_overrides

    p = cfg.prefix
    name, codecs, workload = _prefix_scenario(p)
    n = len(_prefix_turns(p))
    what = (f"{n} requests of {p.trace.conversations} conversations of {p.trace.name} "
            f"(blocks of {p.trace.block_tokens} tokens)") if p.trace.name else \
        f"{p.conversations} conversations x {p.turns} turns"
    _say(f"prefix reuse: {what} over {p.bandwidth_gbps:g} Gbps ({p.emulation}), timing-model "
         f"decode ({time.time() - started:.0f} s so far)")
    common = scenario_overrides(cfg.model.name, p.emulation, p.bandwidth_gbps, codecs,
                                workload, [], profiles, cfg.split_cpus)
    sim, requests_path = _with_request_log(
        sim_overrides(common, profiles, cfg.acceptance, 1), run_dir, name)
    meter = HostLoadMeter()
    measured, simulated = run_pair(common, sim)
    background = _background_keys(meter)
    _keep(run_dir, name, {"measured": measured, "simulated": simulated})
    rows, distributions = _prefix_rows(p, by_codec(measured), by_codec(simulated),
                                       requests_path, n)
    return [{**r, **background} for r in rows], distributions


def _prefix_rows(p: PrefixCaseConfig, measured: dict[str, dict], simulated: dict[str, dict],
                 requests_path: Path, n: int) -> tuple[list[dict], list[dict]]:
    """Comparison rows and per-request distributions of the prefix-reuse case; the two
    engines must have reused the same tokens request by request (else refused: the times
    would not be of the same transfers)."""
    import pandas as pd

    from kvsim.fidelity import errors

    rows, distributions = [], []
    log = pd.read_csv(requests_path)
    # the first prompt of the hand-made case; a trace's mean prompt (both labels only)
    prompts = [tokens for _, tokens, _ in _prefix_turns(p)]
    context = round(sum(prompts) / len(prompts)) if p.trace.name else p.first_tokens
    trace = {"trace": p.trace.name} if p.trace.name else {}
    for codec, row in measured.items():
        scenario = {"case": "prefix", "emulation": p.emulation, "rate_per_s": None,
                    "bandwidth_gbps": p.bandwidth_gbps, "context_tokens": context,
                    "codec": codec, "requests": n, **trace}
        per = row.get("per_request") if isinstance(row.get("per_request"), list) else []
        hits = {r.get("seq"): r.get("prefix_hit_tokens") for r in per}
        mine = log[log["codec"].astype(str) == codec].set_index("request")
        sim_hits = {int(q): int(mine.at[q, "prefix_hit_tokens"]) for q in mine.index}
        if hits != sim_hits:
            raise ValueError(f"prefix reuse: the engines reused different prompt tokens for "
                             f"{codec} (emulated {hits}, simulated {sim_hits})")
        scenario["reused_tokens"] = sum(sim_hits.values())
        # (its requests are different requests, not repeats: no spread among them)
        rows += errors.compare(scenario, {k: v for k, v in row.items() if k != "per_request"},
                               simulated[codec], errors.PREFIX_METRICS)
        requests = _measured_requests(row, PREFIX_PER_REQUEST_METRICS)
        if requests is not None:
            seqs = requests.pop("seq")
            distributions += _distribution_rows(
                {**scenario, "seq": seqs}, requests,
                _simulated_requests(requests_path, codec, seqs, PREFIX_PER_REQUEST_METRICS))
    return rows, distributions


# per-request times compared in a multi-request run: (metric, request row key), from arrival
PER_REQUEST_METRICS = (("ttft", "ttft_s"), ("ttft_c", "ttft_committed_s"))
# ... and in the prefix-reuse case also from prefill end (the part the reuse changes: both
# engines take the prefill from the same profile)
PREFIX_PER_REQUEST_METRICS = (*PER_REQUEST_METRICS, ("ttft_pe", "ttft_from_prefill_end_s"))


def _with_request_log(sim: list[str], run_dir: Path, name: str) -> tuple[list[str], Path]:
    """The simulator's overrides writing its per-request rows beside the scenario's file."""
    path = run_dir / "scenarios" / f"{name}-simulated-requests.csv"
    return [*sim, f"requests_path={path}"], path


def _measured_requests(row: dict, metrics: tuple = PER_REQUEST_METRICS
                       ) -> dict[str, list[float]] | None:
    """metric -> the emulated requests' values (s) by arrival number (`seq`: request i of
    the workload's arrivals, as the simulator numbers them); None for a row that keeps no
    requests of its own (`per_request`). Refused when a request has no number or two
    share one."""
    from kvsim.fidelity.errors import number

    if not isinstance(row.get("per_request"), list):
        return None
    seqs = [r.get("seq") for r in row["per_request"]]
    if any(not isinstance(q, int) or isinstance(q, bool) for q in seqs) or \
            len(set(seqs)) != len(seqs):
        raise ValueError(f"the emulated requests of {row.get('codec')} need distinct arrival "
                         f"numbers (seq) to be paired with the simulator's, got {seqs}")
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    return {metric: [number(row["per_request"][i].get(key)) for i in order]
            for metric, key in metrics} | {"seq": [seqs[i] for i in order]}


def _simulated_requests(path: Path, codec: str, seqs: list[int],
                        metrics: tuple = PER_REQUEST_METRICS) -> dict[str, list[float]]:
    """metric -> the simulated requests' values (s) of one codec for the arrival numbers
    `seqs` (the request log kvsim sim wrote at `path`: one sample, requests numbered by
    arrival); refused when the two engines' requests differ."""
    import pandas as pd

    log = pd.read_csv(path)
    mine = log[log["codec"].astype(str) == codec].set_index("request")
    if sorted(int(q) for q in mine.index) != sorted(seqs):
        raise ValueError(f"{path}: the simulator's requests of {codec!r} "
                         f"({sorted(int(q) for q in mine.index)}) are not the emulated ones "
                         f"({sorted(seqs)})")
    return {metric: [float(mine.at[q, key]) for q in seqs] for metric, key in metrics}


def _distribution_rows(scenario: dict, measured: dict[str, list[float]],
                       simulated: dict[str, list[float]]) -> list[dict]:
    """One row per per-request metric of `measured`: MAPE, Pearson r and the KS test of the
    two engines' per-request times (kvsim.fidelity.statistics.per_request), and the times
    themselves."""
    from kvsim.fidelity.statistics import per_request

    return [{**scenario, "metric": metric,
             **per_request(measured[metric], simulated[metric]),
             "measured_s": measured[metric], "simulated_s": simulated[metric]}
            for metric in measured]


def _print(rows: list[dict], summary: dict, distributions: list[dict]) -> None:
    print(format_table(rows, [
        ("case", "case", ""), ("emulation", "link", ""), ("bandwidth_gbps", "Gbps", "g"),
        ("context_tokens", "ctx", "d"), ("rate_per_s", "req/s", "g"), ("codec", "codec", ""),
        ("metric", "metric", ""), ("measured_s", "measured s", ".3f"),
        ("simulated_s", "simulated s", ".3f"), ("error_pct", "error %", "+.1f"),
        ("measured_spread_pct", "runs apart %", ".1f")]))
    spread = summary.get("mean_measured_spread_pct", float("nan"))
    if spread == spread:  # repeated runs: how far apart the emulator's own runs land
        print(f"repeated emulated runs of one scenario land {spread:.1f}% apart on average; "
              f"{summary['inside_spread']} of the {summary['with_spread']} simulated values "
              f"with repeated runs lie inside their range; beyond it: mean "
              f"{summary['mean_abs_pct_beyond_spread']:.2f}%, worst "
              f"{summary['max_abs_pct_beyond_spread']:.2f}%")
    floor = summary.get("noise_floor")
    if floor:
        print(noise_floor_line(floor))
    drafting = drafting_line(summary.get("drafting") or {})
    if drafting:
        print(drafting)
    tests = summary.get("tost") or {}
    if tests:
        margin = next(iter(tests.values()))["margin_pct"]
        print(f"each metric's bias (its mean signed error) equivalent to 0 within "
              f"+-{margin:g}% (TOST, alpha {next(iter(tests.values()))['alpha']:g}; errors "
              "of opposite signs cancel in it):")
        print(format_table([{"metric": metric, **t, "low": t["interval_pct"][0],
                             "high": t["interval_pct"][1],
                             "verdict": "equivalent" if t["equivalent"] else "not shown"}
                            for metric, t in tests.items()],
                           [("metric", "metric", ""), ("n", "n", "d"),
                            ("mean_error_pct", "mean error %", "+.2f"),
                            ("low", "90% from", "+.2f"), ("high", "to", "+.2f"),
                            ("p", "p", ".3g"), ("verdict", "TOST", "")]))
    if distributions:
        print("multi-request, per request (same arrivals in both engines):")
        print(format_table(distributions, [
            ("rate_per_s", "req/s", "g"), ("codec", "codec", ""), ("metric", "metric", ""),
            ("pairs", "pairs", "d"), ("mape_pct", "MAPE %", ".2f"),
            ("pearson_r", "Pearson r", ".3f"), ("ks_statistic", "KS D", ".3f"),
            ("ks_p", "KS p", ".3g")]))
    step = summary.get("step_mean_abs_pct_error", float("nan"))
    if step == step:  # the host's step against its calibration: what TT<k>T errors inherit
        print(f"decode step, simulated (calibrated) vs measured in the scenario: mean |error| "
              f"{step:.1f}%, worst {summary['step_max_abs_pct_error']:.1f}%")
    if "host_load" in summary:
        print(_host_load_line(summary["host_load"]))
    elif "measured_host_load" in summary:
        print(_host_load_line(summary["measured_host_load"], "the measured run"))
    wakeup = _cpu_wakeup_line(_summary_cpu_wakeup(summary))
    if wakeup:
        print(wakeup)
    cases = summary.get("by_case") or {}
    if len(cases) > 1:
        print("by case: " + "; ".join(
            f"{case} {c['mean_abs_pct_error']:.2f}% mean, {c['max_abs_pct_error']:.2f}% worst "
            f"over {c['compared']}" for case, c in cases.items()))
    level = summary.get("step_level") or {}
    if level:
        print(level["words"])
    worker = (summary.get("worker_level") or {}).get("words")
    if worker:
        print(worker)
    batched = (summary.get("batch_level") or {}).get("words")
    if batched:
        print(batched)
    missed = " and ".join(w for w, ok in (("mean", summary["met_mean"]),
                                          ("worst", summary["met_max"])) if not ok)
    print(f"mean |error| {summary['mean_abs_pct_error']:.2f}% (target "
          f"{summary['target_mean_abs_pct']}%), worst {summary['max_abs_pct_error']:.2f}% "
          f"(target {summary['target_max_abs_pct']}%) over {summary['compared']} comparisons"
          + (f": {missed} above target" if missed else "")
          + ("" if level.get("trusted", True) else
             ("; and " if missed else ": not met, ") + "the step level was not the scenarios'"))
