"""Simulate disaggregated inference: prefill -> (encode, link, deserialize) -> decode, for
several codecs and transfer policies, and compare TTFT / TTKT, the time breakdown and the
bytes per stream. With no overrides: the neutral base (conf/sim.yaml); scenario= names one
of the seeds' settings (scenario=table1-qwen32b-16k: their Table 1)."""

from __future__ import annotations

import sys
import textwrap

from kvsim.advise.config import DEFAULT_FLOOR, DEFAULT_TIE_S
from kvsim.calibrate.host_probe import check_host
from kvsim.core.report import format_table
from kvsim.scenario.config import SimConfig
from kvsim.scenario.describe import TABLE_WIDTH, setting_header
from kvsim.scenario.samples import enough_samples

COMMAND = ("sim",)
HELP = "discrete-event simulation of KV transfer + decoding: TTFT/TTKT per codec and policy"
CONFIG_NAME = "sim"
Config = SimConfig


def table_rows(rows: list[dict], qualities: dict | None = None) -> list[dict]:
    out = []
    for r in rows:
        flat = {k: v for k, v in r.items() if not isinstance(v, dict)}
        for k, v in (r.get("ttkt_s") or {}).items():
            flat[f"tt{k}t_d"] = v
        bd = r.get("breakdown_s") or {}
        flat["comm"] = bd.get("exposed_communication")
        flat["deser"] = bd.get("deserialize")
        flat["rej"] = bd.get("rejected_speculative")
        flat["verif"] = bd.get("verification")
        for k, v in (r.get("ttkt_from_prefill_end_s") or {}).items():
            flat[f"tt{k}t_pe"] = v
        for k, v in (r.get("ttkt_committed_s") or {}).items():
            flat[f"tt{k}t"] = v
        flat["gb"] = r["total_bytes"] / 1e9
        if "prefix_hit_rate" in r:  # prefix reuse: shares of blocks reused, of bytes saved
            flat["hit_pct"] = 100 * r["prefix_hit_rate"]
            flat["saved_pct"] = 100 * r["prefix_bytes_saved_fraction"]
        pct = r.get("ttft_committed_pct_s") or {}  # committed, as the TTFT column
        flat["ttft_p50"], flat["ttft_p99"] = pct.get("p50"), pct.get("p99")
        spread = r.get("spread") or {}
        for key, col in (("ttft_committed_s", "ttft_ci"), ("ttkt_committed_s.32", "tt32t_ci")):
            iv = spread.get(key) or {}
            flat[col] = None if iv.get("ci95_high") is None else iv["ci95_high"] - iv["mean"]
        acc, prop = r.get("accepted_tokens", 0), r.get("proposed_tokens", 0)
        flat["acc"] = f"{acc:.4g}/{prop:.4g}"
        if qualities is not None:
            q = qualities.get(r["codec"])
            flat["vnmse"] = "unmeasured" if q is None else f"{q.vnmse:.3g}"
        out.append(flat)
    return out


def table_columns(cfg: SimConfig, rows: list[dict]) -> list[tuple[str, str, str]]:
    """The sim table's columns: committed times first (the time a user sees a verified
    token), drafted TT32T labelled as the seeds count it, quality; wide=true adds every
    other time (from prefill end, each k, the breakdown)."""
    ks = [k for k in cfg.metrics.ks if rows and all(k in (r.get("ttkt_s") or {}) for r in rows)]
    sampled = bool(rows) and rows[0].get("samples", 1) > 1
    many = bool(rows) and rows[0].get("requests", 1) > 1
    head = [k for k in ks if k in (32, 64, 128)][:1] or ks[-1:]
    cols = [("codec", "codec", ""), ("transfer", "transfer", ""), ("gb", "GB", ".3f"),
            ("ttft_committed_s", "TTFT\ns", ".3f")]
    if sampled and cfg.wide:
        cols.append(("ttft_ci", "TTFT\n±95%", ".3f"))
    wide_ks = [k for k in ks if k != 1 and k in (8, 32, 64, 128)] if cfg.wide else head
    cols += [(f"tt{k}t", f"TT{k}T\ns", ".3f") for k in wide_ks]
    if sampled and 32 in ks:
        cols.append(("tt32t_ci", "TT32T\n±95%", ".3f"))
    cols += [(f"tt{k}t_d", f"drafted\nTT{k}T s", ".3f") for k in (wide_ks if cfg.wide else head)]
    cols.append(("vnmse", "vNMSE", ""))
    if cfg.wide:
        cols += [("ttft_s", "drafted\nTTFT s", ".3f"),
                 ("ttft_from_prefill_end_s", "drafted\nTTFT-pe s", ".3f")]
        cols += [(f"tt{k}t_pe", f"drafted\nTT{k}T-pe s", ".3f") for k in ks if k in (32, 64)]
    if cfg.wide or not many:
        cols += [("comm", "comm\ns", ".3f"), ("deser", "deser\ns", ".3f")]
    if cfg.wide:
        cols += [("rej", "rej\ns", ".3f"), ("verif", "verif\ns", ".3f"),
                 ("acc", "accepted/\nproposed", "")]
    if many:
        cols += [("ttft_p50", "TTFT\np50", ".3f"), ("ttft_p99", "TTFT\np99", ".3f"),
                 ("throughput_rps", "req/s", ".2f")]
        if rows and "prefix_hit_rate" in rows[0]:
            cols += [("hit_pct", "reused\nblocks %", ".1f"),
                     ("saved_pct", "bytes\nsaved %", ".1f")]
        if cfg.wide:
            cols += [("link_utilisation", "link\nutil", ".2f"),
                     ("link_busy_utilisation", "link\nbusy", ".2f")]
    return cols


def print_table(cfg: SimConfig, rows: list[dict], qualities: dict | None = None) -> None:
    print("\n".join(setting_header(cfg, rows[0] if rows else None)))
    print(format_table(table_rows(rows, qualities), table_columns(cfg, rows)))
    picked = [r for r in rows if r.get("pick")]
    if picked:
        r = picked[0]
        print(f"pick: {r['codec']} / {r['transfer']}, committed TT{r['pick_k']}T "
              f"{r['ttkt_committed_s'][r['pick_k']]:.3f} s\n  (as `kvsim advise` picks: the "
              f"fastest with vNMSE <= {DEFAULT_FLOOR:g}; a tie within {DEFAULT_TIE_S:g} s goes "
              "to the lower vNMSE)")
    elif rows:
        print(f"pick: none of these rows has a measured vNMSE <= {DEFAULT_FLOOR:g}")
    for note in sorted({(r["codec"], r["size_estimate"]) for r in rows
                        if r.get("size_estimate", "exact") != "exact"}):
        print("\n".join(textwrap.wrap(
            f"{note[0]}: bytes are an {note[1]}; size_calibration=synthetic or =CAPTURE "
            "measures them on other KV", width=TABLE_WIDTH, subsequent_indent="  ")))


def mark_pick(rows: list[dict], cfg: SimConfig, qualities: dict) -> None:
    """Mark the row advise would recommend among these (its default floor, objective and tie
    rule; kvsim.advise.rank.pick): row["pick"] True on it, False on the others, and
    row["pick_k"] the token index ranked (32, or the last k every row reports)."""
    from kvsim.advise.rank import pick

    ks = [k for k in cfg.metrics.ks if rows and all(
        k in (r.get("ttkt_committed_s") or {}) for r in rows)]
    if not ks:
        return
    k = 32 if 32 in ks else ks[-1]
    best = pick(rows, qualities, objective=f"ttkt_committed_s.{k}")
    for r in rows:
        r["pick"] = best is not None and (r["codec"], r["transfer"]) == (best.codec,
                                                                          best.transfer)
        r["pick_k"] = k


def prepare() -> None:
    """What a process's first run() loads besides the config: the simulator, every codec
    module (for sizes only: torch, numba and Triton stay unimported, kvsim/lazy_module.py) and
    the spread's t quantile (scipy.special); about 0.5 s, once per process. A sweep's worker
    processes call it while the sweep's parent prepares (hydra_plugins/kvsim_sweeper)."""
    import scipy.special  # noqa: F401

    import kvsim.sim.run  # noqa: F401
    from kvsim.kernels.codec import codec_names

    codec_names()


def run(cfg: SimConfig) -> list[dict]:
    # imported here: the simulator pulls in the codecs and simpy; a sweep's parent process,
    # which only composes configs and launches jobs, never needs them
    from kvsim.advise.rank import load_qualities
    from kvsim.scenario.variants import plan_variants
    from kvsim.sim.run import run_all

    qualities = load_qualities(list(cfg.vnmse_tables))  # a bad table name fails before a run
    drift = check_host(cfg, "kvsim sim")
    planned, skipped = plan_variants(cfg.codecs, cfg.transfer)
    raised = enough_samples(cfg, [v.policy for v in planned])
    if raised:
        print(f"kvsim sim: {raised}", file=sys.stderr)
    rows, trace = run_all(cfg, progress=sys.stderr.isatty())
    if drift is not None:
        for r in rows:
            r.update(drift.row_keys())
    mark_pick(rows, cfg, qualities)
    print_table(cfg, rows, qualities)
    if drift is not None:
        print("\n".join(textwrap.wrap(f"host: {drift.words()}", width=TABLE_WIDTH,
                                       subsequent_indent="  ")))
    if skipped:
        print(f"no row for {', '.join(skipped)}: a split-stream policy needs a codec of "
              "several streams")
    if trace is not None:
        print(f"event log ({len(trace.events)} spans) written to {cfg.trace_path}",
              file=sys.stderr)
    return rows
