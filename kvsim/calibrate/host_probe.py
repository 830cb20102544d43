"""Probe this host the way `kvsim calibrate` probed the host of a profile, and decide what a
run does with a profile measured elsewhere or on another day (kvsim.model.host says why).

The probe: `PROBE_STEPS` decode steps of the real model at each context of the profile's step
curve (at most PROBE_CONTEXTS; 256 to 4096 tokens for a full calibration), one step of each in
turn so that the host's spells of slow steps fall on all alike (StepProbe.steps_s), with the
profile's thread count (in this process, or for a process that emulates next in a process of
its own: SubprocessStepProbe); beside it the fingerprint and a memory-copy bandwidth
(kvsim.model.host). About 12 s with the model load.

Every context because a step has a fixed part (the weights, read once per step) and a part
that grows with the context (the cache, read by attention), and a host's day moves them apart
and bends the curve: on 2026-11-29 this host's step was 0.73x the shipped profile's at 256
tokens and 0.66x at 2,048, and a rescale by the 256-token factor alone left the simulated
step 19% from the full grid's scenarios (4% with every context's factor).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.model.host import DriftConfig, fingerprint, memory_copy_gb_per_s, other_host

PROBE_STEPS = 24  # at each probed context, interleaved
PROBE_CONTEXTS = 6  # at most, of a profile's step curve (~1.5 s of steps each here)


class DriftRefused(ValueError):
    """drift.action=refuse and this host's decode step is beyond the tolerance."""


@dataclass
class StepProbe:
    """Times the real model's decode step at a context (median of `steps` after the first)."""

    model: Any  # ModelSpec of the probed model
    steps: int = 24
    threads: int = 1  # torch threads, as the transport's processes
    _lm: Any = None
    _kv: dict[int, Any] = field(default_factory=dict)  # context -> bf16 KV of its prompt

    def _prepare(self, context_tokens: int) -> tuple[Any, Any, int]:
        """(the loaded model, the calibration prompt's bf16 KV at context_tokens, its first
        token): the model loaded and the prompt prefilled once."""
        import torch

        from kvsim.calibrate.model_profile import ModelCalibration, _prompt
        from kvsim.kv.capture import cache_to_kv, prefill

        if self._lm is None:
            from kvsim.model.load import load_lm

            self._lm = load_lm(self.model, threads=self.threads, seed=0)
            torch.set_num_threads(self.threads)
        lm = self._lm
        if context_tokens not in self._kv:  # the calibration prompts (their own text seed)
            ids = _prompt(lm, context_tokens, ModelCalibration([context_tokens]))
            cache, logits = prefill(lm.model, ids)
            self._kv[context_tokens] = (cache_to_kv(cache).to(torch.bfloat16),
                                        int(torch.argmax(logits)))
        kv, token = self._kv[context_tokens]
        return lm, kv, token

    def step_s(self, context_tokens: int) -> float:
        from kvsim.calibrate.model_profile import _steps_s
        from kvsim.kv.capture import kv_to_cache

        lm, kv, token = self._prepare(context_tokens)
        dtype = next(lm.model.parameters()).dtype
        cache = kv_to_cache(kv.float(), lm.model.config, dtype)
        _first, later = _steps_s(lm, cache, token, self.steps)
        return float(statistics.median(later))

    def steps_s(self, contexts: list[int]) -> list[float]:
        """The median decode step (s) at each of `contexts`, their steps interleaved (one of
        each in turn, `steps` each after a first untimed one), so that a slow spell of the
        host lands on every context alike. The shortest context's cache is the calibration
        prompt's (as step_s); a longer one repeats that cache's tokens to its length, since
        a step's cost is its shapes', not its values' (no prefill of thousands of tokens)."""
        import torch

        from kvsim.kv.capture import kv_to_cache
        from kvsim.model.forward import lm_forward

        if not contexts or min(contexts) <= 0:
            raise ValueError(f"a step probe needs contexts > 0, got {contexts}")
        lm, kv, token = self._prepare(min(contexts))
        dtype = next(lm.model.parameters()).dtype
        caches = []
        for ctx in contexts:  # kv [layers, 2, heads, tokens, head_dim]
            reps = -(-ctx // kv.shape[3])
            tiled = kv.repeat(1, 1, 1, reps, 1)[:, :, :, :ctx]
            caches.append(kv_to_cache(tiled.float(), lm.model.config, dtype))
        ids = torch.tensor([[token]])
        times: list[list[float]] = [[] for _ in contexts]
        with torch.no_grad():
            for step in range(self.steps + 1):
                for i, cache in enumerate(caches):
                    t0 = time.perf_counter()
                    lm_forward(lm.model, ids, cache)
                    if step:  # the first on a fresh cache costs more
                        times[i].append(time.perf_counter() - t0)
        return [float(statistics.median(t)) for t in times]


@dataclass
class SubprocessStepProbe:
    """A StepProbe run by a Python process of its own (`python -m kvsim.calibrate.host_probe`,
    the request as JSON on stdin, the step on stdout), for a process that emulates next
    (`kvsim validate`). Probed in the emulating process, or in a multiprocessing child of it,
    the emulated decode host then stalled for 10-120 ms at a time in its layer
    dequantization on a 2-core host (7 runs of the prefix trace case); probed by a process
    of its own, it did not (3 runs; CHANGELOG.md, 2026-11-28)."""

    model: Any
    steps: int = 24
    threads: int = 1
    timeout_s: float = 600.0  # model load + steps; the process is killed beyond it

    def step_s(self, context_tokens: int) -> float:
        return float(self._ask({"context_tokens": int(context_tokens)})["step_s"])

    def steps_s(self, contexts: list[int]) -> list[float]:
        return [float(x) for x in self._ask({"contexts": [int(c) for c in contexts]})["steps_s"]]

    def _ask(self, what: dict) -> dict:
        import subprocess
        import sys

        doc = {"model": dataclasses.asdict(self.model), "steps": self.steps,
               "threads": self.threads, **what}
        try:
            proc = subprocess.run([sys.executable, "-m", "kvsim.calibrate.host_probe"],
                                  input=json.dumps(doc), capture_output=True, text=True,
                                  timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the decode-step probe took over {self.timeout_s:g} s"
                               ) from None
        if proc.returncode != 0:
            raise RuntimeError(f"the decode-step probe failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:]}")
        lines = proc.stdout.strip().splitlines()
        return json.loads(lines[-1])


def _probe_main() -> None:
    """python -m kvsim.calibrate.host_probe: SubprocessStepProbe's process."""
    import sys

    from kvsim.model.spec import model_from_dict

    doc = json.load(sys.stdin)
    probe = StepProbe(model_from_dict(doc["model"]), int(doc["steps"]), int(doc["threads"]))
    if "contexts" in doc:
        print(json.dumps({"steps_s": probe.steps_s([int(c) for c in doc["contexts"]])}))
    else:
        print(json.dumps({"step_s": probe.step_s(int(doc["context_tokens"]))}))


def host_record(probe: Any, contexts: list[int]) -> dict:
    """This host as a profile records it (`host`): fingerprint, memory-copy GB/s and the
    decode-step probe at `contexts` (the calibration's: probe_contexts; probe: a StepProbe
    of the profile's model)."""
    contexts = sorted(set(int(c) for c in contexts))
    steps = probe.steps_s(contexts)
    return {**fingerprint(), "hostname": socket.gethostname(),
            "memory_copy_gb_per_s": memory_copy_gb_per_s(),
            "decode_step_probe": {"context_tokens": contexts, "steps": probe.steps,
                                  "s": steps},
            "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def probe_threads(doc: dict) -> int:
    """The torch threads the profile's probe (and its step curves) ran with: a probe here
    must use as many to be comparable."""
    threads = doc.get("threads", 1)
    return threads if isinstance(threads, int) and not isinstance(threads, bool) \
        and threads >= 1 else 1


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def probe_contexts(contexts: list) -> list[int]:
    """The contexts (tokens) a probe times of a step curve measured at `contexts`: all of
    them, or PROBE_CONTEXTS of them evenly spread, the shortest and longest among them."""
    xs = sorted(set(int(c) for c in contexts))
    if len(xs) <= PROBE_CONTEXTS:
        return xs
    return [xs[round(i * (len(xs) - 1) / (PROBE_CONTEXTS - 1))] for i in range(PROBE_CONTEXTS)]


def profile_steps(doc: dict) -> tuple[list[int], list[float], str]:
    """([contexts (tokens)], [the profile's in-process decode step there (s)], where they come
    from) at the contexts a probe compares: its host's probe where it records one at several
    contexts; else its in-process step curve (`tpot_inprocess`, the curve before the
    receiver's ratio, where the calibration applied one) at its contexts (probe_contexts),
    its level anchored to its host's probe where that records one context only (profiles
    calibrated before probes took several contexts)."""
    host = doc.get("host") if isinstance(doc.get("host"), dict) else {}  # (older: a name)
    probe = host.get("decode_step_probe") if isinstance(host.get("decode_step_probe"),
                                                        dict) else {}
    at, step = probe.get("context_tokens"), probe.get("s")
    if isinstance(at, list) and isinstance(step, list) and len(at) == len(step) >= 1 and \
            all(isinstance(c, int) and c > 0 for c in at) and all(map(_positive, step)):
        pairs = sorted({int(c): float(v) for c, v in zip(at, step, strict=True)}.items())
        return [c for c, _ in pairs], [v for _, v in pairs], "its host's probe"
    curve = doc.get("tpot_inprocess") or doc["tpot"]
    xs = probe_contexts(curve["context_tokens"])
    steps = [float(np.interp(c, curve["context_tokens"], curve["s"])) for c in xs]
    if isinstance(at, int) and _positive(step):  # one recorded probe: the curve's shape
        level = float(step) / float(np.interp(at, curve["context_tokens"], curve["s"]))
        return xs, [v * level for v in steps], \
            "its host's probe, its in-process step curve's shape"
    return xs, steps, "its in-process step curve"


@dataclass
class Drift:
    """This host's decode step against a profile's, and what was done about it."""

    factor: float  # step here now / step in the profile, at the shortest probed context
    # (the lines' ratio where several contexts were probed: check_drift)
    probe_s: float  # (at the shortest probed context)
    profile_s: float
    reference: str  # where the profile's steps come from (profile_steps)
    context_tokens: int  # the shortest probed context
    outcome: str  # within | rescaled | refused | measured (act=False: nothing done)
    host: dict  # this host (fingerprint, memory-copy GB/s)
    profile_host: dict  # the profile's (empty where it records none)
    profile: str  # the profile used from here on (the rescaled copy when rescaled)
    # every probed context (tokens, increasing), its step here (the probe's median) and in
    # the profile (s), and its factor (from the lines through them: check_drift); empty in
    # a drift recorded before probes took several contexts (one factor)
    probed_context_tokens: list[int] = field(default_factory=list)
    probes_s: list[float] = field(default_factory=list)
    profiles_s: list[float] = field(default_factory=list)
    factors: list[float] = field(default_factory=list)
    # the profiles calibrated with it that were rescaled with it (rescale_companions)
    companions: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, doc: dict) -> Drift:
        """A drift saved by as_dict (a key a later version adds is left out)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})

    def points(self) -> tuple[list[int], list[float]]:
        """(contexts, factors) of the rescale (kvsim.model.host.rescaled_profile)."""
        if self.probed_context_tokens and \
                len(self.factors) == len(self.probed_context_tokens):
            return list(self.probed_context_tokens), list(self.factors)
        return [self.context_tokens], [self.factor]

    def words(self) -> str:
        """One line for the rows and the log."""
        contexts, factors = self.points()
        if len(contexts) == 1:
            what = {"within": "within tolerance, used as it is",
                    "rescaled": f"profile times x {self.factor:.3f}",
                    "refused": "refused", "measured": "measured only"}[self.outcome]
            return (f"decode step here {self.probe_s * 1e3:.1f} ms at {self.context_tokens} "
                    f"tokens vs {self.profile_s * 1e3:.1f} ms in the profile "
                    f"({self.reference}): x {self.factor:.3f}, {what}"
                    f"{self._companions()}{self._calibrated_beside()}")
        what = {"within": "within tolerance, used as it is",
                "rescaled": "step times x the factor at their context (linear in context "
                            f"between, flat beyond), prefill x {factors[0]:.3f}",
                "refused": "refused", "measured": "measured only"}[self.outcome]
        line = " (the factors from a line through them)" if len(contexts) > 1 else ""
        return (f"decode step here {self._ms(self.probes_s)} ms at "
                f"{' / '.join(map(str, contexts))} tokens{line} vs "
                f"{self._ms(self.profiles_s)} ms in the profile ({self.reference}): x "
                f"{' / '.join(f'{f:.3f}' for f in factors)}, {what}"
                f"{self._companions()}{self._calibrated_beside()}")

    def _companions(self) -> str:
        return f"; rescaled with it: {', '.join(self.companions)}" if self.companions else ""

    @staticmethod
    def _ms(steps_s: list[float]) -> str:
        return " / ".join(f"{v * 1e3:.1f}" for v in steps_s)

    def _calibrated_beside(self) -> str:
        """What ran beside the profile's calibration, where it recorded it (kvsim.core.
        host_load: its host.background): a factor taken against a busy calibration."""
        load = self.profile_host.get("background") if isinstance(self.profile_host, dict) \
            else None
        if not isinstance(load, dict) or not isinstance(load.get("background_cores"),
                                                        (int, float)):
            return ""
        return (f" (the profile was calibrated beside {load['background_cores']:.2f} of "
                f"{load.get('cpus', '?')} CPUs of other work)")

    def row_keys(self) -> dict:
        """What a result row records of the check (kvsim sim, advise, validate): the factor
        at the shortest probed context (the prefill's) and at the longest."""
        contexts, factors = self.points()
        return {"hardware_drift": self.outcome, "hardware_drift_factor": factors[0],
                "hardware_drift_factor_long": factors[-1]}

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "words": self.words()}


def check_drift(profile_path: str | Path, model: Any, cfg: DriftConfig, out_dir: Path,
                probe: Any = None, force: bool = False, own_process: bool = False,
                act: bool = True) -> Drift | None:
    """Probe this host against the hardware profile at profile_path (of `model`, a
    ModelSpec) and act by cfg: None when not probed (action off, or `kvsim sim`'s when=
    other_host and the profile names this kind of host or none: force=True probes anyway,
    as validate does). Beyond the tolerance at any probed context, rescale writes the
    profile with its model times x the factors to out_dir/<name> (Drift.profile;
    kvsim.model.host.rescaled_profile) and refuse raises DriftRefused. probe: a StepProbe
    (one is made for `model`; own_process=True: a SubprocessStepProbe, for a process that
    emulates next). act=False: the figures only (outcome "measured"; nothing rescaled,
    written or refused), as validate's probe after its comparisons takes them."""
    from kvsim.calibrate.step_fit import fit_step_line
    from kvsim.model.hardware_profile import load_profile
    from kvsim.model.host import write_rescaled_profile

    if cfg.action == "off":
        return None
    path = Path(profile_path)
    doc = load_profile(str(path), model.name)  # checked (and of this model) before probing
    recorded = doc.get("host") if isinstance(doc.get("host"), dict) else {}
    here = fingerprint()
    if not force and (cfg.when == "other_host" and not other_host(recorded, here)):
        return None
    if probe is None:
        probe = (SubprocessStepProbe if own_process else StepProbe)(
            model, PROBE_STEPS, probe_threads(doc))
    contexts, profiles_s, reference = profile_steps(doc)
    try:
        probes_s = [float(v) for v in probe.steps_s(contexts)]
    except Exception as exc:  # no weights here, out of memory, ...
        raise RuntimeError(f"hardware profile {path}: this host's decode step could not be "
                           f"probed ({type(exc).__name__}: {exc}); drift.action=off uses the "
                           f"profile as it is") from exc
    # the probe's medians as the calibration's are taken: a line over context (step_fit),
    # so that one noisy median does not bend the rescaled curves at its context; the
    # profile's own probe likewise, while its in-process curve is what its step curves were
    # made from (a bend there is in them too, and its factor takes it out)
    line_s = fit_step_line(contexts, probes_s)["s"] if len(contexts) > 1 else probes_s
    reference_s = fit_step_line(contexts, profiles_s)["s"] \
        if len(contexts) > 1 and reference == "its host's probe" else profiles_s
    factors = [float(p / r) for p, r in zip(line_s, reference_s, strict=True)]
    within = all(abs(f - 1.0) * 100.0 <= cfg.tolerance_pct for f in factors)
    outcome = "measured" if not act else "within" if within else \
        ("rescaled" if cfg.action == "rescale" else "refused")
    drift = Drift(factors[0], probes_s[0], profiles_s[0], reference, contexts[0], outcome,
                  {**here, "memory_copy_gb_per_s": memory_copy_gb_per_s()}, recorded,
                  str(path), contexts, probes_s, profiles_s, factors)
    if outcome == "refused":
        raise DriftRefused(f"hardware profile {path}: {drift.words()}: beyond "
                           f"drift.tolerance_pct={cfg.tolerance_pct:g}% (drift.action=rescale "
                           f"scales it; kvsim calibrate measures this host)")
    if outcome == "rescaled":
        drift.profile = str(write_rescaled_profile(doc, Path(out_dir) / path.name, factors, {
            "from_profile": str(path), "probe_s": probes_s, "profile_s": profiles_s,
            "context_tokens": contexts, "host": drift.host}, contexts))
    return drift


def _one_calibration(hardware: dict, doc: dict) -> bool:
    """Whether `doc` (a codec timing or link profile) was written by the `kvsim calibrate`
    run that wrote the hardware profile `hardware`: the same code (git) and measured within
    an hour of it (a calibration takes minutes; profiles of one name from other runs exist:
    `local-<model>` is the default name)."""
    import datetime as dt

    def when(d: dict) -> float | None:
        try:
            return dt.datetime.strptime(str(d.get("measured_utc")), "%Y-%m-%dT%H:%M:%SZ"
                                        ).timestamp()
        except ValueError:
            return None

    a, b = when(hardware), when(doc)
    return hardware.get("git") == doc.get("git") and a is not None and b is not None and \
        abs(a - b) <= 3600.0


def rescale_companions(drift: Drift, hardware_doc: dict, codec_timing: Path | None,
                       links: dict[str, Path], out_dir: Path, only: list[str] | None = None
                       ) -> tuple[Path | None, dict[str, Path]]:
    """The codec timing and link profiles calibrated together with a rescaled hardware
    profile (`hardware_doc`), rescaled with it by the shortest probed context's factor
    (kvsim.model.host.rescaled_codec_timing, rescaled_link_profile) and written to out_dir:
    (codec timing, {emulation: link}) to use, each the given path where nothing was
    rescaled. Together means what one `kvsim calibrate` run writes: a measured codec timing
    whose `hardware` is the profile's name, link profiles named <profile name>-<emulation>
    that measured the receiver's time per byte, all of one run (_one_calibration); another
    file (a preset's assumption, another run's measurement) says nothing of this host's
    day. only: the names to rescale, as a saved drift lists them (a re-simulation repeats
    what its run did). drift.companions names what was rescaled."""
    from kvsim.model.host import rescaled_codec_timing, rescaled_link_profile

    if drift.outcome != "rescaled":
        return codec_timing, dict(links)
    name = str(hardware_doc.get("name", ""))
    factor = drift.points()[1][0]
    record = {"from_hardware_profile": drift.profile, "context_tokens": drift.points()[0]}
    out_dir = Path(out_dir)

    def write(kind: str, path: Path, doc: dict) -> Path:
        out = out_dir / kind / Path(path).name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        return out

    if codec_timing is not None:
        doc = json.loads(Path(codec_timing).read_text())
        ours = doc.get("source") == "measured" and doc.get("hardware") == name and \
            _one_calibration(hardware_doc, doc)
        if ("codec_timing" in only) if only is not None else ours:
            codec_timing = write("codec_timing", codec_timing, rescaled_codec_timing(
                doc, factor, {**record, "from_profile": str(codec_timing)}))
            drift.companions.append("codec_timing")
    moved = {}
    for emulation, path in links.items():
        doc = json.loads(Path(path).read_text())
        step = doc.get("draft_step") if isinstance(doc.get("draft_step"), dict) else {}
        ours = doc.get("name") == f"{name}-{emulation.replace('_', '-')}" and \
            isinstance(step.get("ingest_s_per_byte"), (int, float)) and \
            _one_calibration(hardware_doc, doc)
        label = f"link {emulation}"
        if (label in only) if only is not None else ours:
            path = write("link", path, rescaled_link_profile(
                doc, factor, {**record, "from_profile": str(path)}))
            drift.companions.append(label)
        moved[emulation] = Path(path)
    return codec_timing, moved


# where check_host shares its checks between processes (shared_checks), else None
_shared_dir: Path | None = None
_SHARED_LOCK_TIMEOUT_S = 600.0  # waiting for another process's check (a probe: ~12 s)


@contextmanager
def shared_checks(folder: Path) -> Iterator[None]:
    """Within the block, check_host shares its checks through `folder`: the first process
    to check a (hardware profile, model, drift settings, host) probes and leaves its result
    there, and every later check of the same reads it. kvsim sweep's jobs run inside one:
    one probe per sweep rather than per job, so that its points share one factor (jobs
    probing side by side would each measure the others' load). The setting is the whole
    process's: enter it from one thread (a job), not from several at once."""
    global _shared_dir
    before, _shared_dir = _shared_dir, Path(folder)
    try:
        yield
    finally:
        _shared_dir = before


def _shared_check(path: Path, cfg: Any, check: Callable[[Path], Drift | None]
                  ) -> Drift | None:
    """check(out_dir) once per key among the processes sharing _shared_dir (see
    shared_checks): its Drift, None, or its refusal, kept as JSON under a file lock."""
    import fcntl
    import hashlib

    assert _shared_dir is not None
    folder = _shared_dir
    key = hashlib.sha256(json.dumps(
        [hashlib.sha256(path.read_bytes()).hexdigest(), cfg.model.name,
         dataclasses.asdict(cfg.drift), fingerprint()], sort_keys=True).encode()).hexdigest()
    key = key[:16]
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / f"{key}.json"
    with open(folder / ".lock", "a") as lock:
        deadline = time.monotonic() + _SHARED_LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held the host checks in {folder} "
                                       f"for over {_SHARED_LOCK_TIMEOUT_S:g} s") from None
                time.sleep(0.05)
        try:
            if record.is_file():
                doc = json.loads(record.read_text())
            else:
                try:
                    drift = check(folder / key)
                    doc = {"drift": None if drift is None else dataclasses.asdict(drift)}
                except DriftRefused as exc:
                    doc = {"refused": str(exc)}
                part = record.with_suffix(".part")
                part.write_text(json.dumps(doc, indent=1) + "\n")
                part.replace(record)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if "refused" in doc:
        raise DriftRefused(doc["refused"])
    return None if doc["drift"] is None else Drift(**doc["drift"])


def check_host(cfg: Any, who: str, own_process: bool = False) -> Drift | None:
    """The check a run makes (kvsim sim, advise, emulate) with a measured hardware profile
    (cfg: a SimConfig or EmulateConfig): the Drift, its rescaled profile now cfg's (written
    to the run directory), or None when not probed; `who` names the command on stderr.
    own_process: probe in a process of its own (SubprocessStepProbe), for a process that
    emulates next."""
    if not cfg.hardware.profile or cfg.drift.action == "off":
        return None
    import sys

    from kvsim.core.outputs import out_root
    from kvsim.core.profiles import profile_path

    path = Path(profile_path("hardware", cfg.hardware.profile))

    def check(out_dir: Path) -> Drift | None:
        return check_drift(path, cfg.model, cfg.drift, out_dir, own_process=own_process)

    drift = check(out_root(None) / "profiles-rescaled") if _shared_dir is None else \
        _shared_check(path, cfg, check)
    if drift is not None:
        cfg.hardware.profile = drift.profile
        _rescale_cfg_companions(cfg, path, drift)
        print(f"{who}: host: {drift.words()}", file=sys.stderr)
    return drift


def _rescale_cfg_companions(cfg: Any, hardware_path: Path, drift: Drift) -> None:
    """cfg's codec timing and link profile, where calibrated together with its rescaled
    hardware profile (rescale_companions), replaced by their rescaled copies in the run
    directory."""
    if drift.outcome != "rescaled":
        return
    from kvsim.core.outputs import out_root
    from kvsim.core.profiles import profile_path

    hardware_doc = json.loads(hardware_path.read_text())
    timing = profile_path("codec_timing", cfg.codec_timing) if cfg.codec_timing else None
    link = getattr(cfg.link, "profile", "") or ""
    emulation = getattr(getattr(cfg, "transport", None), "emulation", None)
    if link:  # the emulation it measured (kvsim emulate's own; else the profile's)
        emulation = emulation or json.loads(profile_path("link", link).read_text()).get(
            "emulation", "")
    links = {str(emulation): profile_path("link", link)} if link else {}
    timing, links = rescale_companions(drift, hardware_doc, timing, links,
                                       out_root(None) / "profiles-rescaled")
    if timing is not None:
        cfg.codec_timing = str(timing)
    if links:
        cfg.link.profile = str(next(iter(links.values())))


if __name__ == "__main__":
    _probe_main()
