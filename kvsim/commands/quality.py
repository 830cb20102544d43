"""Run a real model (default SmolLM2-135M, `kvsim model fetch` first) on real text: capture its
KV cache, measure each codec's attention-output vNMSE per layer, next-token top-1 agreement and
perplexity with the dequantized cache, and speculative acceptance (draft on a stream prefix,
verify on the full-precision cache). Writes acceptance/*.json, vnmse/*.json, the capture
(captures/) and the synthetic-KV calibration (synthetic/) into the run directory, or under
out_dir (out_dir=data updates the repository's data/; overwrite=true replaces existing files)."""

from __future__ import annotations

import sys

from kvsim.core.report import format_table
from kvsim.quality.run import QualityConfig as Config
from kvsim.quality.run import run_quality

COMMAND = ("quality",)
HELP = "real-model KV capture, codec vNMSE / top-1 / perplexity, speculative acceptance"
CONFIG_NAME = "quality"

__all__ = ["COMMAND", "HELP", "CONFIG_NAME", "Config", "run"]


def run(cfg: Config) -> list[dict]:
    rows, summary = run_quality(cfg)
    for row in rows:
        surv = row.get("survival")
        for k in (1, 10, 20, 32, 64):
            row[f"p_ge_{k}"] = surv.get(k) if surv else None
    columns = [("codec", "codec", ""), ("streams_used", "streams", "d"),
               ("bits_per_element", "bits/elem", ".2f"), ("vnmse", "vNMSE", ".3g"),
               ("top1_agreement", "top-1", ".3f"), ("ppl_ref", "ppl ref", ".3f"),
               ("ppl", "ppl", ".3f"), ("decoding", "decoding", ""),
               ("accepted_mean", "accepted", ".1f"), ("proposed_mean", "proposed", "d"),
               ("p_ge_10", "P(>=10)", ".2f"), ("p_ge_20", "P(>=20)", ".2f")]
    print(format_table(rows, columns))
    print(f"model {summary['model'].get('model')}: load {summary['load_s']:.1f} s, "
          f"prefill {summary['prefill_s_mean']:.2f} s/context, "
          + (f"draft+verify {summary['draft_s_per_token'] * 1e3:.0f} ms/draft token, "
             if summary["draft_s_per_token"] else "")
          + f"total {summary['wall_s']:.0f} s", file=sys.stderr)
    for what, path in summary["files"].items():
        print(f"wrote {what}: {path}", file=sys.stderr)
    for row in rows:
        row["wall_s_total"] = summary["wall_s"]
    return rows
