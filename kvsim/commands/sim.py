"""Simulate disaggregated inference: prefill -> (encode, link, deserialize) -> decode, for
several codecs and transfer policies, and compare TTFT / TTKT, the time breakdown and the
bytes per stream. With no overrides: the seeds' Table 1 setting (Qwen3-32B, 16K context)."""

from __future__ import annotations

import sys

from kvsim.core.report import format_table
from kvsim.scenario.config import SimConfig

COMMAND = ("sim",)
HELP = "discrete-event simulation of KV transfer + decoding: TTFT/TTKT per codec and policy"
CONFIG_NAME = "sim"
Config = SimConfig


# overrides that change what is reported or how often, not the scenario's setting
_SETTING_KEEPERS = {"scenario", "codecs", "samples", "seed", "trace_path", "requests_path",
                    "metrics.ks", "metrics.breakdown_k", "transfer", "title"}


def run_overrides() -> list[str]:
    """This run's command-line overrides (empty outside kvsim's command line)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        flat = {k: v for k, v in r.items() if not isinstance(v, dict)}
        for k, v in (r.get("ttkt_s") or {}).items():
            flat[f"tt{k}t"] = v
        bd = r.get("breakdown_s") or {}
        flat["comm"] = bd.get("exposed_communication")
        flat["deser"] = bd.get("deserialize")
        flat["rej"] = bd.get("rejected_speculative")
        flat["verif"] = bd.get("verification")
        for k, v in (r.get("ttkt_from_prefill_end_s") or {}).items():
            flat[f"tt{k}t_pe"] = v
        for k, v in (r.get("ttkt_committed_s") or {}).items():
            flat[f"tt{k}t_c"] = v
        flat["gb"] = r["total_bytes"] / 1e9
        pct = r.get("ttft_pct_s") or {}
        flat["ttft_p50"], flat["ttft_p99"] = pct.get("p50"), pct.get("p99")
        spread = r.get("spread") or {}
        for key, col in (("ttft_s", "ttft_ci"), ("ttkt_s.32", "tt32t_ci")):
            iv = spread.get(key) or {}
            flat[col] = None if iv.get("ci95_high") is None else iv["ci95_high"] - iv["mean"]
        acc, prop = r.get("accepted_tokens", 0), r.get("proposed_tokens", 0)
        flat["acc"] = f"{acc:.4g}/{prop:.4g}"
        out.append(flat)
    return out


def print_table(cfg: SimConfig, rows: list[dict]) -> None:
    ks = [k for k in cfg.metrics.ks if rows and all(k in (r.get("ttkt_s") or {}) for r in rows)]
    cols = [("codec", "codec", ""), ("transfer", "transfer", ""),
            ("context_tokens", "ctx", "d"), ("bandwidth_gbps", "Gbps", "g"),
            ("gb", "GB", ".3f"), ("ttft_s", "TTFT s", ".3f"),
            ("ttft_from_prefill_end_s", "TTFT-pe", ".3f"),
            ("ttft_committed_s", "TTFT-c", ".3f")]
    if rows and rows[0].get("samples", 1) > 1:
        cols += [("ttft_ci", "TTFT ±95%", ".3f")]
    cols += [(f"tt{k}t", f"TT{k}T", ".3f") for k in ks if k != 1 and k in (8, 32, 64, 128)]
    if rows and rows[0].get("samples", 1) > 1 and 32 in ks:
        cols += [("tt32t_ci", "TT32T ±95%", ".3f")]
    cols += [(f"tt{k}t_c", f"TT{k}T-c", ".3f") for k in ks if k == 32]
    cols += [(f"tt{k}t_pe", f"TT{k}T-pe", ".3f") for k in ks if k in (32, 64)]
    cols += [("comm", "comm", ".3f"), ("deser", "deser", ".3f"), ("rej", "rej", ".3f"),
             ("verif", "verif", ".3f"), ("acc", "acc/prop", "")]
    if rows and rows[0].get("requests", 1) > 1:
        cols += [("ttft_p50", "TTFT p50", ".3f"), ("ttft_p99", "TTFT p99", ".3f"),
                 ("link_utilisation", "link util", ".2f"),
                 ("link_busy_utilisation", "link busy", ".2f"), ("throughput_rps", "req/s", ".2f")]
    if cfg.title:
        changed = [o for o in run_overrides()
                   if o.split("=", 1)[0].lstrip("+~") not in _SETTING_KEEPERS]
        print(f"scenario: {cfg.title}" + (
            f"; changed by this run's overrides: {' '.join(changed)} (the title describes the "
            "scenario as written; the line below, this run)" if changed else ""))
    first = rows[0] if rows else {}
    print(f"model={cfg.model.name} hardware={cfg.hardware.devices}x{cfg.hardware.name} "
          f"link={cfg.link.name} ({cfg.link.bandwidth_gbps:g} Gbps"
          + (", trace" if cfg.link.trace else "") + f") acceptance={cfg.speculative.acceptance} "
          f"workload={cfg.workload.kind} ({first.get('requests', 0)} request(s), mean of "
          f"{cfg.samples} run(s)" + (", ±95%: half-width of the 95% interval of that mean"
                                     if cfg.samples > 1 else "") + "); times from "
          "request arrival" + (f" (prefill {first['prefill_s']:.3f} s)" if "prefill_s" in first
                                else "") +
          f", -pe: from prefill end; -c: committed (a drafted token counts once verified; "
          "without -c: when drafted, as the seeds count); breakdown of "
          f"TT{cfg.metrics.breakdown_k}T from prefill "
          "end; GB = wire bytes per request")
    print(format_table(table_rows(rows), cols))
    for note in sorted({(r["codec"], r["size_estimate"]) for r in rows
                        if r.get("size_estimate", "exact") != "exact"}):
        print(f"{note[0]}: bytes are an {note[1]}; size_calibration=synthetic or =CAPTURE "
              "measures them on other KV")


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
    from kvsim.sim.run import run_all

    rows, trace = run_all(cfg, progress=sys.stderr.isatty())
    print_table(cfg, rows)
    if trace is not None:
        print(f"event log ({len(trace.events)} spans) written to {cfg.trace_path}",
              file=sys.stderr)
    return rows
