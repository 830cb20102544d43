"""Simulate every candidate (codec preset x transfer policy) of one setting in-process
(kvsim.sim.run.run_all), attach each codec's measured quality, rank the admissible ones by
the objective time and pick one with its reason."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvsim.advise.config import (
    DEFAULT_FLOOR,
    DEFAULT_OBJECTIVE,
    DEFAULT_TIE_S,
    AdviseConfig,
)
from kvsim.advise.floor import (
    LOSSLESS,
    SERVING_CODEC,
    CodecQuality,
    QualityFloor,
    admissible,
    codec_qualities,
    parse_floor,
)
from kvsim.advise.pareto import pareto_front
from kvsim.kernels.presets import preset_names, resolve_codec
from kvsim.scenario.config import VARIANT_KEYS
from kvsim.scenario.objective import objective_key, objective_words
from kvsim.scenario.policy import POLICIES, applicable


@dataclass
class Candidate:
    """One simulated (codec, transfer policy): times in seconds from request arrival."""

    codec: str
    transfer: str
    streams: int
    total_bytes: float  # wire bytes per request
    ttft_s: float
    ttft_committed_s: float
    ttkt_s: float | None  # drafted TTKT at the objective's k (None for a TTFT objective)
    ttkt_committed_s: float | None
    objective_s: float  # the ranked time
    objective_ci95_s: float | None  # half-width of its 95% interval (None: one sample)
    vnmse: float | None  # output quality (every stream used); None: not measured
    acceptance: str  # the acceptance model its drafts were drawn from
    admissible: bool
    excluded_because: str = ""
    rank: int | None = None  # 1 = recommended (admissible ones only)
    on_front: bool = False  # on the Pareto front of (objective_s, vnmse)
    samples: int = 1  # runs averaged into its times
    tied: bool = False  # admissible and within tie_s of the fastest: ordered by the tie rule


@dataclass
class Advice:
    floor: QualityFloor
    objective: str
    candidates: list[Candidate]  # ranked admissible first, then the excluded by time
    front: list[Candidate]  # Pareto front over measured candidates, by time
    recommended: Candidate | None
    reason: str  # one sentence, then its details after "; " (the report keeps it whole)
    notes: list[str] = field(default_factory=list)

    @property
    def reason_lines(self) -> list[str]:
        """The reason as printed: its first sentence, then one line per detail."""
        return self.reason.rstrip(".").split("; ")


def metric(row: dict, name: str, k: int | None) -> float | None:
    """A row's scalar metric, or its dict metric at k (keys are ints in-process, strings
    once a report went through JSON)."""
    value = row.get(name)
    if k is None:
        return value
    if not isinstance(value, dict):
        return None
    return value.get(k, value.get(str(k)))


def half_width(row: dict, key: str) -> float | None:
    iv = (row.get("spread") or {}).get(key) or {}
    high, mean = iv.get("ci95_high"), iv.get("mean")
    return None if high is None or mean is None else high - mean


def candidate_policies(cfg: AdviseConfig) -> list[tuple[str | dict, list[str]]]:
    """(codecs entry, policies) pairs: every preset (or cfg.codecs: preset names or `kvsim
    sim` mappings, which may pin a transfer or an acceptance) with every listed policy, the
    split-stream ones only for codecs with several streams. With cfg.acceptance_files, a
    several-stream codec with a measured acceptance file drafts with it."""
    from kvsim.scenario.acceptance import ACCEPTANCE_DIR

    entries = list(cfg.codecs) if cfg.codecs else preset_names()
    transfers = cfg.transfer if isinstance(cfg.transfer, (list, tuple)) else [cfg.transfer]
    for t in transfers:
        if t not in POLICIES:
            raise ValueError(f"advise: transfer {t!r} is not a policy; choose from {POLICIES}")
    out: list[tuple[str | dict, list[str]]] = []
    for entry in entries:
        entry = dict(entry) if isinstance(entry, dict) else str(entry)
        pinned = entry.get("transfer") if isinstance(entry, dict) else None
        spec = resolve_codec({k: v for k, v in entry.items()
                              if k not in VARIANT_KEYS}
                             if isinstance(entry, dict) else entry)
        streams = spec.build().num_streams
        if cfg.acceptance_files and streams > 1 and not (
                isinstance(entry, dict) and entry.get("acceptance")):
            name = cfg.acceptance_files.replace("CODEC", spec.label)
            if (ACCEPTANCE_DIR / f"{name}.json").is_file():
                entry = {**entry, "acceptance": name} if isinstance(entry, dict) \
                    else {"preset": entry, "acceptance": name}
        policies = [str(pinned)] if pinned else [
            t for t in transfers if applicable(t, streams)]
        if policies:
            out.append((entry, policies))
    return out


def simulate(cfg: AdviseConfig, progress: bool = False,
             candidates: list[tuple[str | dict, list[str]]] | None = None) -> list[dict]:
    """One `kvsim sim` row per candidate (candidate_policies(cfg) unless given), run in this
    process with the user's setting."""
    from kvsim.sim.run import run_all

    rows: list[dict] = []
    for entry, policies in (candidates if candidates is not None else candidate_policies(cfg)):
        one = dataclasses.replace(cfg, codecs=[entry], transfer=list(policies),
                                  trace_path="", requests_path="")
        got, _ = run_all(one, progress=progress)
        for row, policy in zip(got, policies, strict=True):
            assert row["transfer"] == policy, (row["transfer"], policy)
        rows += got
    return rows


def load_qualities(names: list[str]) -> dict[str, CodecQuality]:
    from kvsim.quality.vnmse import load_vnmse_table

    return codec_qualities([load_vnmse_table(n) for n in names])


def advise(cfg: AdviseConfig, rows: list[dict],
           qualities: dict[str, CodecQuality]) -> Advice:
    """Rank simulated rows under cfg's floor and objective (pure: no simulation here)."""
    floor = parse_floor(cfg.floor)
    cands = candidates(rows, qualities, floor, cfg.objective)
    measured = [c for c in cands if c.vnmse is not None]
    front = [measured[i] for i in
             pareto_front([(c.objective_s, c.vnmse) for c in measured])]  # type: ignore[misc]
    for c in front:
        c.on_front = True
    ranked = rank(cands, cfg.tie_s)
    recommended = ranked[0] if ranked and ranked[0].admissible else None
    reason = explain(recommended, ranked, cands, floor, cfg.objective, cfg.tie_s)
    notes = []
    tables = sorted({q.source for q in qualities.values()})
    if floor.kind != "none":
        notes.append(f"quality: vNMSE measured by `kvsim quality` in {', '.join(tables)} "
                     f"(model {cfg.model.name} is simulated; the measurement's model may "
                     "differ: rerun `kvsim quality` on yours to tighten this)")
    unmeasured = sorted({c.codec for c in cands if c.vnmse is None})
    if unmeasured and floor.kind != "none":
        notes.append(f"not admissible for want of a vNMSE measurement: {', '.join(unmeasured)}")
    return Advice(floor, cfg.objective, ranked, front, recommended, reason, notes)


def pick(rows: list[dict], qualities: dict[str, CodecQuality],
         floor: QualityFloor | None = None, objective: str = DEFAULT_OBJECTIVE,
         tie_s: float = DEFAULT_TIE_S) -> Candidate | None:
    """The row advise would recommend among these rows, by advise's defaults (floor, objective,
    tie rule): what `kvsim sim` and the sweep summary name, so every command gives one answer
    for one setting."""
    floor = floor or parse_floor(DEFAULT_FLOOR)
    ranked = rank(candidates(rows, qualities, floor, objective), tie_s)
    return ranked[0] if ranked and ranked[0].admissible else None


def candidates(rows: list[dict], qualities: dict[str, CodecQuality], floor: QualityFloor,
               objective: str) -> list[Candidate]:
    """One candidate per row: its times at the objective's k, its quality and whether it is
    admissible under the floor."""
    name, k = objective_key(objective)
    if floor.kind == LOSSLESS and "committed" not in name:
        raise ValueError(f"floor=lossless ranks committed times only (a drafted token is shown "
                         f"before verification and may be rejected); objective "
                         f"{objective!r} is drafted: use ttkt_committed_s.K or "
                         "ttft_committed_s")
    serving = qualities.get(SERVING_CODEC)
    spread_key = name if k is None else f"{name}.{k}"
    cands = []
    for row in rows:
        time_s = metric(row, name, k)
        if time_s is None:
            raise ValueError(f"objective {objective!r}: row {row.get('codec')}/"
                             f"{row.get('transfer')} has no such metric (is {k} among "
                             "metrics.ks and <= workload.output_tokens?)")
        q = qualities.get(row["codec"])
        ok, why = admissible(floor, q, serving)
        cands.append(Candidate(
            codec=row["codec"], transfer=row["transfer"],
            streams=int(row.get("streams") or len(row.get("stream_bytes") or {}) or 1),
            total_bytes=float(row["total_bytes"]), ttft_s=row["ttft_s"],
            ttft_committed_s=row.get("ttft_committed_s", row["ttft_s"]),
            ttkt_s=metric(row, "ttkt_s", k) if k else None,
            ttkt_committed_s=metric(row, "ttkt_committed_s", k) if k else None,
            objective_s=float(time_s), objective_ci95_s=half_width(row, spread_key),
            vnmse=None if q is None else q.vnmse, acceptance=str(row.get("acceptance", "")),
            admissible=ok, excluded_because=why, samples=int(row.get("samples") or 1)))
    return cands


def rank(cands: list[Candidate], tie_s: float) -> list[Candidate]:
    """Admissible candidates by objective time, then the excluded ones. Among admissible
    candidates within tie_s of the fastest, the lowest vNMSE then the fewest bytes goes
    first (so a tie is not decided by noise in favour of a lossier codec)."""
    ok = sorted((c for c in cands if c.admissible),
                key=lambda c: (c.objective_s, c.total_bytes))
    if ok:
        fastest = ok[0].objective_s
        tied = [c for c in ok if c.objective_s <= fastest + tie_s]
        rest = [c for c in ok if c.objective_s > fastest + tie_s]
        tied.sort(key=lambda c: (float("inf") if c.vnmse is None else c.vnmse,
                                 c.total_bytes, c.objective_s))
        if len(tied) > 1:
            for c in tied:
                c.tied = True
        ok = tied + rest
    for i, c in enumerate(ok, 1):
        c.rank = i
    excluded = sorted((c for c in cands if not c.admissible), key=lambda c: c.objective_s)
    return ok + excluded


def _fmt(c: Candidate) -> str:
    ci = f" ±{c.objective_ci95_s:.3f}" if c.objective_ci95_s else ""
    return f"{c.codec}/{c.transfer} {c.objective_s:.3f} s{ci}"


def explain(best: Candidate | None, ranked: list[Candidate], cands: list[Candidate],
            floor: QualityFloor, objective: str, tie_s: float) -> str:
    """One paragraph: what wins, by how much over the runner-up of another codec or policy,
    and what faster candidate the floor excluded."""
    if best is None:
        return (f"no candidate meets the floor ({floor.describe()}); loosen it or measure "
                "the codecs' vNMSE (`kvsim quality`)")
    what = ("ties for" if best.tied else "has") + f" the shortest {objective_words(objective)}"
    parts = [f"{best.codec} / {best.transfer} {what} meeting the floor: {best.objective_s:.3f} s"
             + (f", vNMSE {best.vnmse:.3g}" if best.vnmse is not None else "")]
    others = [c for c in ranked if c.admissible and c is not best]
    tied = [c for c in others if c.objective_s <= ranked[0].objective_s + tie_s
            and c.objective_s <= best.objective_s + tie_s]
    faster_tied = [c for c in tied if c.objective_s < best.objective_s]
    if faster_tied:
        f = min(faster_tied, key=lambda c: c.objective_s)
        parts.append(f"{f.codec}/{f.transfer} is {best.objective_s - f.objective_s:.3f} s "
                     f"faster, within the {tie_s:g} s tie, and is lossier or larger "
                     f"(vNMSE {f.vnmse:.3g})" if f.vnmse is not None else
                     f"{f.codec}/{f.transfer} is within the {tie_s:g} s tie")
    runner = next((c for c in others if c.codec != best.codec), None)
    if runner is not None:
        gap = runner.objective_s - best.objective_s
        both = [h for h in (best.objective_ci95_s, runner.objective_ci95_s) if h]
        sig = ""
        if both:
            sig = " (beyond" if abs(gap) > sum(both) else " (within"
            sig += " their combined 95% intervals)"
        gap = round(gap, 3) + 0.0  # no "-0.000"
        parts.append(f"next other codec: {_fmt(runner)}, {gap:+.3f} s{sig}")
    faster_out = [c for c in cands if not c.admissible and c.objective_s < best.objective_s]
    over = [c for c in faster_out if c.vnmse is not None]
    unmeasured = [c for c in faster_out if c.vnmse is None]
    if over:
        f = min(over, key=lambda c: c.objective_s)
        parts.append(f"fastest over the floor: {_fmt(f)} ({f.excluded_because})")
    if unmeasured:
        f = min(unmeasured, key=lambda c: c.objective_s)
        parts.append(f"fastest unmeasured: {_fmt(f)}")
    if not faster_out:
        parts.append("no excluded candidate is faster: the floor costs nothing here")
    return "; ".join(parts) + "."
