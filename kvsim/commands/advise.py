"""Which codec, split and transfer policy for this setting? Simulate every codec preset
(each Lynx split is its own preset) under every transfer policy with the `kvsim sim` setting
the overrides give (model=, hardware=, link=, workload.context_tokens=, ...), keep the codecs
whose measured output quality meets the floor (a vNMSE bound, `lossless` or `none`), rank
them by the objective time (default: TT32T committed, from request arrival), and print the
ranking, the Pareto front of time against vNMSE and one recommendation with its reason."""

from __future__ import annotations

import dataclasses
import sys

from kvsim.advise.config import AdviseConfig, objective_key
from kvsim.advise.rank import (
    Advice,
    Candidate,
    advise,
    enough_samples,
    load_qualities,
    simulate,
)
from kvsim.core.report import format_table

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
    return row


def print_advice(cfg: AdviseConfig, advice: Advice) -> None:
    _, k = objective_key(cfg.objective)
    k = k or 32
    cols = [("status", "rank", ""), ("codec", "codec", ""), ("transfer", "transfer", ""),
            ("gb", "GB", ".3f"), ("ttft_s", "TTFT", ".3f"), ("ttft_committed_s", "TTFT-c", ".3f"),
            ("ttkt_s", f"TT{k}T", ".3f"), ("ttkt_committed_s", f"TT{k}T-c", ".3f"),
            ("objective_ci95_s", "±95%", ".3f"), ("vnmse", "vNMSE", ".3g"),
            ("front", "front", "")]
    if cfg.acceptance_files:  # which acceptance curve each candidate drafted with
        cols.append(("acceptance", "acceptance", ""))
    link = cfg.link
    print(f"setting: model={cfg.model.name} hardware={cfg.hardware.devices}x"
          f"{cfg.hardware.name} link={link.name} ({link.bandwidth_gbps:g} Gbps"
          + (", trace" if link.trace else "") + f") context={cfg.workload.context_tokens} "
          f"output={cfg.workload.output_tokens} acceptance={cfg.speculative.acceptance} "
          f"samples={cfg.samples}")
    print(f"floor: {advice.floor.describe()}; ranked by {advice.objective} (s from request "
          "arrival; -c: committed, a drafted token counts once verified); ±95%: half-width "
          "of its 95% interval over the samples")
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
                        ("objective_s", advice.objective, ".3f"), ("vnmse", "vNMSE", ".3g"),
                        ("status", "under the floor", "")]))
    print(f"\nrecommendation: {advice.recommended.codec} / {advice.recommended.transfer}"
          if advice.recommended else "\nrecommendation: none")
    head, *details = advice.reason_lines
    print(f"reason: {head}")
    for line in details:
        print(f"  - {line}")
    for note in advice.notes:
        print(f"note: {note}")


def run(cfg: AdviseConfig) -> list[dict]:
    cfg.validate()
    qualities = load_qualities(list(cfg.vnmse_tables))
    raised = enough_samples(cfg)
    if raised:
        print(f"kvsim advise: {raised}", file=sys.stderr)
    rows = simulate(cfg, progress=sys.stderr.isatty())
    advice = advise(cfg, rows, qualities)
    if raised:
        advice.notes.append(raised)
    print_advice(cfg, advice)
    out = [flat(c) for c in advice.candidates]
    for r in out:
        r["recommended"] = advice.recommended is not None and r["rank"] == 1
        r["floor"] = advice.floor.describe()
        r["objective"] = advice.objective
    return out
