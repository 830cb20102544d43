"""Which codec, split and transfer policy for this setting? Simulate every codec preset
(each Lynx split is its own preset) under every transfer policy with the `kvsim sim` setting
the overrides give (model=, hardware=, link=, workload.context_tokens=, ...), keep the codecs
whose measured output quality meets the floor (a vNMSE bound, `lossless` or `none`), rank
them by the objective time (default: TT32T committed, from request arrival), and print the
ranking, the Pareto front of time against vNMSE and one recommendation with its reason."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

from kvsim.advise.config import AdviseConfig
from kvsim.advise.rank import (
    Advice,
    Candidate,
    advise,
    candidate_policies,
    load_qualities,
    simulate,
)
from kvsim.calibrate.host_probe import check_host
from kvsim.core.report import format_table
from kvsim.scenario.describe import TABLE_WIDTH, setting_header
from kvsim.scenario.objective import objective_key, objective_words
from kvsim.scenario.samples import enough_samples

COMMAND = ("advise",)
HELP = "rank codecs x transfer policies for one setting under a quality floor; recommend one"
CONFIG_NAME = "advise"
Config = AdviseConfig


def flat(c: Candidate) -> dict:
    row = dataclasses.asdict(c)
    row["gb"] = c.total_bytes / 1e9
    row["status"] = (f"#{c.rank}" + (" tie" if c.tied else "") if c.admissible
                     else f"out: {c.excluded_because}")
    row["front"] = "*" if c.on_front else ""
    row["quality"] = "unmeasured" if c.vnmse is None else f"{c.vnmse:.3g}"
    return row


def ranked_and_other(objective: str) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """(the ranked time's column, the other count of the same token's): committed (the time
    a user sees a verified token) or drafted (as the seeds count)."""
    name, k = objective_key(objective)
    token = f"TT{k}T" if k else "TTFT"
    field = "ttkt" if k else "ttft"
    committed = (f"{field}_committed_s", f"{token}\ns", ".3f")
    drafted = (f"{field}_s", f"drafted\n{token} s", ".3f")
    return (committed, drafted) if "committed" in name else (drafted, committed)


def ranking_columns(objective: str) -> list[tuple[str, str, str]]:
    """The ranking's columns: the ranked time right after the committed TTFT, its 95%
    half-width beside it, the other count of the same token (drafted or committed) after."""
    _, k = objective_key(objective)
    ranked, other = ranked_and_other(objective)
    cols = [("status", "rank", ""), ("codec", "codec", ""), ("transfer", "transfer", ""),
            ("gb", "GB", ".3f")]
    if k:
        cols.append(("ttft_committed_s", "TTFT\ns", ".3f"))
    return cols + [ranked, ("objective_ci95_s", "±95%", ".3f"), other,
                   ("quality", "vNMSE", ""), ("front", "front", "")]


def print_advice(cfg: AdviseConfig, advice: Advice) -> None:
    cols = ranking_columns(cfg.objective)
    if cfg.acceptance_files:  # which acceptance curve each candidate drafted with
        cols.append(("acceptance", "acceptance", ""))
    print("\n".join(setting_header(cfg)))
    print(f"floor: {advice.floor.describe()}; ranked by {objective_words(advice.objective)} "
          f"({advice.objective})")
    rows = [flat(c) for c in advice.candidates]
    shown = [r for r in rows if r["rank"] is not None][:cfg.top]
    print(format_table(shown, cols))
    hidden = sum(r["rank"] is not None for r in rows) - len(shown)
    excluded = sum(r["rank"] is None for r in rows)
    print(f"({hidden} more admissible and {excluded} excluded candidates in report.json)")
    if any(r["tied"] for r in shown):
        print(f"tie: within tie_s ({cfg.tie_s:g} s) of the fastest, a tie ordered by vNMSE, "
              "then bytes (not by time)")
    print("\nPareto front (time vs vNMSE, every measured candidate; lower is better in both):")
    print(format_table([flat(c) for c in advice.front],
                       [("codec", "codec", ""), ("transfer", "transfer", ""),
                        ("objective_s", ranked_and_other(cfg.objective)[0][1], ".3f"),
                        ("vnmse", "vNMSE", ".3g"),
                        ("status", "under the floor", "")]))
    print(f"\nrecommendation: {advice.recommended.codec} / {advice.recommended.transfer}"
          if advice.recommended else "\nrecommendation: none")
    head, *details = advice.reason_lines
    print(f"reason: {head}")
    for line in details:
        print(f"  - {line}")
    for note in advice.notes:
        print("\n".join(textwrap.wrap(f"note: {note}", width=TABLE_WIDTH,
                                       subsequent_indent="  ", break_on_hyphens=False)))


def run(cfg: AdviseConfig) -> list[dict]:
    cfg.validate()
    qualities = load_qualities(list(cfg.vnmse_tables))
    drift = check_host(cfg, "kvsim advise")  # a measured profile on another host
    pairs = candidate_policies(cfg)  # every preset built once
    raised = enough_samples(cfg, [p for _, ps in pairs for p in ps])
    if raised:
        print(f"kvsim advise: {raised}", file=sys.stderr)
    rows = simulate(cfg, progress=sys.stderr.isatty(), candidates=pairs)
    advice = advise(cfg, rows, qualities)
    if raised:
        advice.notes.append(raised)
    print_advice(cfg, advice)
    out = [flat(c) for c in advice.candidates]
    for r in out:
        r["recommended"] = advice.recommended is not None and r["rank"] == 1
        r["floor"] = advice.floor.describe()
        r["objective"] = advice.objective
        if drift is not None:
            r.update(drift.row_keys())
    return out
