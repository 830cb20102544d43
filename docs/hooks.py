"""mkdocs hook: the fidelity and performance pages show the latest shipped run, read from its
data files at build time, so no number on them is copied by hand.

- `<!-- generated: NAME -->` in a page is replaced by the Markdown of `SECTIONS[NAME]`.
- The latest run is the directory of data/fidelity/ whose report.json was written last
  (`provenance.created_unix_s`); its calibration is the `profiles/` beside it.
- The committed figures (plots/*.png) are added to the site as plots/<name>.png.

Reads JSON only and imports nothing of kvsim; writes nothing outside the site directory.
"""

from __future__ import annotations

import functools
import json
import re
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
FIDELITY_DIR = REPO / "data" / "fidelity"
CODEC_TIMING_DIR = REPO / "data" / "codec_timing"
PLOTS_DIR = REPO / "plots"
_PLACEHOLDER = re.compile(r"<!--\s*generated:\s*([\w-]+)\s*-->")


# ---------------------------------------------------------------- reading the data files

def _load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


@functools.cache
def shipped_runs() -> list[tuple[str, dict]]:
    """(directory name, report) of every shipped validation, oldest first: read once per
    build (on_pre_build forgets them, so `mkdocs serve` rereads them on a rebuild)."""
    runs = [(d.name, _load(d / "report.json")) for d in sorted(FIDELITY_DIR.iterdir())
            if (d / "report.json").is_file()]
    return sorted(runs, key=lambda r: r[1]["provenance"]["created_unix_s"])


def _grid(report: dict) -> str:
    """The run's `grid=`; a run of no single-request scenario is named by its cases instead
    (`kvsim validate 'rates_gbps=[]' multi.enabled=false prefix.enabled=true`: `prefix`)."""
    cases = {r.get("case") for r in report.get("rows") or []}
    if "single" not in cases and cases:
        return "+".join(sorted(str(c) for c in cases))
    return (report.get("config") or {}).get("grid", "full")


def runs_of(grid: str) -> list[tuple[str, dict]]:
    """The shipped runs of one grid (`kvsim validate grid=`), oldest first."""
    return [r for r in shipped_runs() if _grid(r[1]) == grid]


def _host_load(report: dict) -> dict:
    """The run's summary `host_load` (what else ran on the host; {} before it was measured)."""
    load = (report.get("fidelity") or {}).get("host_load")
    return load if isinstance(load, dict) and load.get("measured") else {}


def headline_run(grid: str) -> tuple[str, dict] | None:
    """The latest shipped run of a grid measured on a quiet host: a run beside other work
    (its host_load `shared`) is listed with the others but heads a page only when no quiet
    run of its grid is shipped."""
    runs = runs_of(grid)
    quiet = [r for r in runs if not _host_load(r[1]).get("shared")]
    return (quiet or runs)[-1] if runs else None


def latest_run() -> tuple[str, dict]:
    """The headline full-grid run: the page's and the performance pages'."""
    return headline_run("full")


def _profile(kind: str) -> dict | list[dict]:
    name, _ = latest_run()
    folder = FIDELITY_DIR / name / "profiles" / kind
    files = sorted(folder.glob("*.json"))
    return [_load(f) for f in files] if kind == "link" else _load(files[0])


# ---------------------------------------------------------------- formatting

def _table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:  # a "|" in a cell ("mean |error|") would split it
        return "-" if v is None else str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _g(x: float | None, digits: int = 3) -> str | None:
    return None if x is None else f"{x:.{digits}g}"


def _f(x: float | None, digits: int = 3) -> str | None:
    return None if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{x:+.1f}"


def _utc(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _seen(rows: list[dict], key: str) -> list:
    """The distinct values of `key` over rows, in the order first seen."""
    return list(dict.fromkeys(r[key] for r in rows if key in r))


def _mean_abs(values: list[float]) -> str:
    return f"{sum(abs(v) for v in values) / len(values):.2f}%" if values else "-"


# ---------------------------------------------------------------- fidelity sections

def fidelity_summary(grid: str = "full") -> str:
    run = headline_run(grid)
    if run is None:
        return f"No `grid={grid}` run is shipped yet."
    name, report = run
    fid, prov, cfg = report["fidelity"], report["provenance"], report["config"]
    single = [r for r in report["rows"] if r.get("case") == "single"]
    overrides = " ".join(report.get("overrides") or [])
    met = lambda ok: "met" if ok else "missed"  # noqa: E731
    lines = [
        f"- **Run**: `data/fidelity/{name}/` (report written {_utc(prov['created_unix_s'])}, "
        f"commit `{prov['git_describe']}`{', uncommitted changes' if prov['git_dirty'] else ''}"
        f", host `{prov['host']}`, torch {prov['torch']}).",
        f"- **Command**: `kvsim {report['command']} {overrides}`, "
        f"{report['wall_s'] / 60:.1f} minutes in all.",
        f"- **Grid** (read from its rows): "
        f"{', '.join(_seen(single, 'emulation'))} x {_seen(single, 'bandwidth_gbps')} Gbps x "
        f"{_seen(single, 'context_tokens')}-token prompts x "
        f"{', '.join(_seen(single, 'codec'))}; {cfg['output_tokens']} tokens decoded; each "
        f"codec emulated {max((r.get('repeats', 1) for r in single), default=1)} times per "
        f"scenario; {cfg['samples']} simulator samples per row.",
        f"- **Mean |error|**: {fid['mean_abs_pct_error']:.2f}% (target "
        f"{fid['target_mean_abs_pct']:g}%: {met(fid['met_mean'])}); **worst**: "
        f"{fid['max_abs_pct_error']:.2f}% (target {fid['target_max_abs_pct']:g}%: "
        f"{met(fid['met_max'])}); {fid['compared']} comparisons, {fid['missing']} missing.",
        f"- **Noise of the measurement**: repeated runs of one scenario landed "
        f"{fid['mean_measured_spread_pct']:.1f}% apart on average; the scenarios' decode step "
        f"was {fid['step_mean_abs_pct_error']:.1f}% from the calibrated one on average, "
        f"{fid['step_max_abs_pct_error']:.1f}% at worst.",
    ]
    cases = {case: [abs(r["error_pct"]) for r in report["rows"] if r.get("case") == case
                    and isinstance(r.get("error_pct"), (int, float))]
             for case in ("single", "multi")}
    lines.append("- **By case**: " + "; ".join(
        f"{case}-request {sum(es) / len(es):.2f}% mean, {max(es):.2f}% worst over {len(es)}"
        for case, es in cases.items() if es) + ".")
    beyond = [abs(r["beyond_spread_pct"]) for r in report["rows"]
              if isinstance(r.get("beyond_spread_pct"), (int, float))]
    if beyond:  # runs since the spread was recorded per row
        lines.append(
            f"- **Against the emulator's own spread**: {sum(x == 0 for x in beyond)} of the "
            f"{len(beyond)} simulated values with repeated runs lie inside their range; "
            f"beyond it, mean {sum(beyond) / len(beyond):.2f}%, worst {max(beyond):.2f}%.")
    tost = fid.get("tost") or {}
    if tost:
        shown = [m for m, t in tost.items() if t.get("equivalent")]
        lines.append(f"- **Bias (TOST at ±5%)**: the mean signed error is shown equivalent to 0 "
                     f"for {', '.join(f'`{m}`' for m in shown) or 'no metric'} (of "
                     f"{len(tost)}; errors of opposite signs cancel in it).")
    drift = fid.get("drift")
    if isinstance(drift, dict):
        lines.append(f"- **Host check**: {drift['words']}.")
    level = fid.get("step_level")  # runs since the level was checked after the comparisons
    if isinstance(level, dict) and level.get("words"):
        lines.append(f"- **Step level**: {level['words']}.")
    load = _host_load(report)
    if load:
        lines.append(f"- **Other work on the host**: {_host_words(load)}.")
    worst = fid.get("worst")
    if worst:
        lines.append(
            f"- **Worst comparison**: {worst['codec']} over {worst['emulation']} at "
            f"{worst['bandwidth_gbps']:g} Gbps, {worst['context_tokens']} tokens, "
            f"`{worst['metric']}` {worst['error_pct']:+.2f}% (its repeated runs "
            f"{worst.get('measured_spread_pct', 0):.1f}% apart).")
    figure = PLOTS_DIR / f"fidelity-{name}.png"
    if figure.is_file():
        lines += ["", f"![Simulated against measured, {name}](../plots/{figure.name})"]
    return "\n".join(lines)


def fidelity_breakdown() -> str:
    _, report = latest_run()
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in report["rows"]:
        e = row["error_pct"]
        by["metric"][row["metric"]].append(e)
        link = f"{row['emulation']} {row['bandwidth_gbps']:g} Gbps"
        if row["case"] == "multi":
            link += " (multi-request)"
        by["link"][link].append(e)
        by["codec"][row["codec"]].append(e)
    parts = []
    for what in ("metric", "link", "codec"):
        groups = by[what]
        rows = [[k, len(v), _mean_abs(v), f"{max(abs(x) for x in v):.2f}%"]
                for k, v in groups.items()]
        parts.append(f"By {what}:\n\n" + _table([what, "comparisons", "mean |error|",
                                                  "worst |error|"], rows))
    return "\n\n".join(parts)


def fidelity_table() -> str:
    _, report = latest_run()
    single: dict[tuple, dict] = {}
    multi: dict[tuple, dict] = {}
    for row in report["rows"]:
        if row["case"] == "single":
            key = (row["emulation"], row["bandwidth_gbps"], row["context_tokens"], row["codec"])
            single.setdefault(key, {"row": row})[row["metric"]] = row
        else:
            key = (row["emulation"], row["bandwidth_gbps"], row["context_tokens"],
                   row["rate_per_s"], row["codec"])
            multi.setdefault(key, {"row": row})[row["metric"]] = row
    metrics = [m for m in ("ttft", "tt32t", "tt64t", "ttft_c", "tt32t_c", "tt64t_c")
               if any(m in v for v in single.values())]
    last = metrics[-1] if metrics else None
    rows = []
    for (emu, bw, ctx, codec), v in single.items():
        r = v["row"]
        ms = v.get(last, {})
        rows.append([emu, f"{bw:g}", ctx, codec,
                     f"{_f(ms.get('measured_s'))} / {_f(ms.get('simulated_s'))}",
                     f"{r['tpot_measured_s'] * 1e3:.1f} / {r['tpot_simulated_s'] * 1e3:.1f}",
                     r.get("accepted_measured"), r.get("accepted_simulated"),
                     *[_pct(v.get(m, {}).get("error_pct")) for m in metrics]])
    out = ("Single requests: times from prefill end; error = 100 x (simulated - measured) / "
           f"measured; `_c`: committed. Seconds shown for `{last}`.\n\n")
    out += _table(["link", "Gbps", "ctx", "codec", f"{last} measured / simulated s",
                   "step ms measured / simulated", "accepted measured", "accepted simulated",
                   *[f"{m} %" for m in metrics]], rows)
    if multi:
        mmetrics = sorted({m for v in multi.values() for m in v if m != "row"})
        mrows = []
        for (emu, bw, ctx, rate, codec), v in multi.items():
            first = v[mmetrics[0]]
            mrows.append([emu, f"{bw:g}", ctx, f"{rate:g}", codec,
                          f"{_f(first['measured_s'])} / {_f(first['simulated_s'])}",
                          *[_pct(v.get(m, {}).get("error_pct")) for m in mmetrics]])
        out += ("\n\nPoisson arrivals on one shared link, timing-model decode; times from "
                f"arrival. Seconds shown for `{mmetrics[0]}`.\n\n")
        out += _table(["link", "Gbps", "ctx", "req/s", "codec",
                       f"{mmetrics[0]} measured / simulated s", *[f"{m} %" for m in mmetrics]],
                      mrows)
    return out


def _host_words(load: dict) -> str:
    """What else ran beside a run, in words (its summary's host_load)."""
    parts = [f"{v['background_cores']:.2f} of {v['cpus']} CPUs {when}"
             for key, when in (("before", "before it"), ("calibration", "during the calibration"),
                               ("profile", "while its profile was calibrated"),
                               ("comparisons", "during the comparisons"))
             if isinstance(v := load.get(key), dict)]
    most = load.get("max_scenario_background_cores")
    if isinstance(most, (int, float)):
        parts.append(f"at most {most:.2f} in one scenario")
    return ("a shared host: " if load.get("shared") else "a quiet host: ") + ", ".join(parts)


def fidelity_runs() -> str:
    rows = []
    for name, report in shipped_runs():
        fid, prov = report["fidelity"], report["provenance"]
        figure = PLOTS_DIR / f"fidelity-{name}.png"
        load = _host_load(report)
        busiest = max([v["background_cores"] for v in load.values() if isinstance(v, dict)]
                      + [load.get("max_scenario_background_cores") or 0.0], default=0.0)
        host = "not measured" if not load else (
            f"shared (up to {busiest:.2f} CPUs of other work)" if load.get("shared")
            else "quiet")
        rows.append([f"`{name}`", f"`{_grid(report)}`", _utc(prov["created_unix_s"]),
                     f"`{prov['git_describe']}`", host, fid["compared"],
                     f"{fid['mean_abs_pct_error']:.2f}%", f"{fid['max_abs_pct_error']:.2f}%",
                     f"[figure](../plots/{figure.name})" if figure.is_file() else "-"])
    return _table(["run (data/fidelity/)", "grid", "report written", "commit", "host",
                   "comparisons", "mean |error|", "worst |error|", "figure"], rows)


# ---------------------------------------------------------------- performance sections

def perf_source() -> str:
    name, report = latest_run()
    hw = _profile("hardware")
    return (f"From the calibration of the latest shipped validation, "
            f"`data/fidelity/{name}/profiles/` (measured {hw.get('measured_utc', '?')} on "
            f"host `{hw.get('host', '?')}` with {hw.get('cpus', '?')} CPUs, "
            f"model `{hw['model']}`, {hw['threads']} torch thread(s), {hw['dtype']}, commit "
            f"`{report['provenance']['git_describe']}`).")


def perf_model() -> str:
    hw = _profile("hardware")
    pre = hw["prefill"]
    tpot = hw["tpot"]
    rows = [[t, _f(p), _f(s * 1e3, 1)] for t, p, s in zip(pre["tokens"], pre["s"], tpot["s"],
                                                           strict=True)]
    out = _table(["context tokens", "prefill s", "decode step ms"], rows)
    batch = hw.get("tpot_batch")
    if batch and isinstance(batch["context_tokens"], list):  # measured at every context
        header = ["context tokens", *[f"batch {b}" for b in batch["batch"]]]
        rows = [[c, *[_f(s * 1e3, 1) for s in row]]
                for c, row in zip(batch["context_tokens"], batch["s"], strict=True)]
        out += "\n\nDecode step (ms) by batch size:\n\n" + _table(header, rows)
    elif batch:
        out += (f"\n\nDecode step at {batch['context_tokens']} tokens by batch size:\n\n"
                + _table(["batch", "step ms"], [[b, _f(s * 1e3, 1)]
                                                for b, s in zip(batch["batch"], batch["s"],
                                                                strict=True)]))
    verify = hw.get("verify")
    if verify:
        header = ["context tokens", *[f"{d} drafted" for d in verify["drafted_tokens"]]]
        rows = [[c, *[_f(s * 1e3, 0) for s in row]]
                for c, row in zip(verify["context_tokens"], verify["s"], strict=True)]
        out += "\n\nVerification pass (ms) by drafted tokens:\n\n" + _table(header, rows)
    return out


def perf_codecs() -> str:
    timing = _profile("codec_timing")
    rows = []
    for codec, t in timing["codecs"].items():
        rows.append([codec, _g(t.get("encode_gb_per_s")), _g(t.get("decode_gb_per_s")),
                     _g(t.get("anchor_decode_gb_per_s")), _g(t.get("inprocess_encode_gb_per_s")),
                     _g(t.get("inprocess_decode_gb_per_s")),
                     _f(t["layer_job_fixed_s"] * 1e3, 2) if "layer_job_fixed_s" in t else None,
                     _g(t.get("layer_job_gb_per_s"))])
    return ("GB/s of bf16-equivalent cache. Encode: in the sender of a calibration transfer "
            "(layer by layer, with the payload CRC32C); decode: in its receiver (dequantize + "
            "build the model's cache); in-process: the same call repeated alone; layer job: "
            "fixed ms + bytes at the rate, fitted on two contexts.\n\n"
            + _table(["codec", "encode", "decode", "anchor decode", "encode in-process",
                      "decode in-process", "layer job fixed ms", "layer job GB/s"], rows))


def perf_links() -> str:
    rows = []
    for p in _profile("link"):
        d = p.get("draft_step") or {}
        rows.append([p["emulation"], _f(p["efficiency"]), _g(p["latency_s"]),
                     _f(p["message_overhead_bytes"], 1), _f(p.get("fit_max_abs_pct_error"), 2),
                     _f(d.get("ratio"), 2), _g(d.get("busy_ratio")),
                     _g(d["ingest_s_per_byte"] * 1e9) if "ingest_s_per_byte" in d else None,
                     _f(p["handshake_s"] * 1e3, 2) if "handshake_s" in p else None])
    return ("Fitted to transfers of 1 MiB and 16 KiB messages at several rates: goodput "
            "fraction of the configured rate, first-byte latency, bytes per message beyond "
            "the payload; the receiver's draft step on that link as a ratio to a decode step "
            "(plain, and while the receiver is fully busy), its cost per later-stream "
            "byte, and a transfer's handshake (prefill end to the first chunk on the link, "
            "less its encoding; median over the calibration transfers).\n\n"
            + _table(["emulation", "goodput fraction", "latency s", "overhead B/message",
                      "fit max error %", "draft step ratio", "busy ratio", "ingest ns/B",
                      "handshake ms"], rows))


def perf_codec_timing() -> str:
    parts = []
    for path in sorted(CODEC_TIMING_DIR.glob("*.json")):
        t = _load(path)
        rows = [[c, _g(v.get("encode_gb_per_s")), _g(v.get("decode_gb_per_s")), v.get("source")]
                for c, v in t["codecs"].items()]
        if "default" in t:
            v = t["default"]
            rows.append(["(any other)", _g(v.get("encode_gb_per_s")),
                         _g(v.get("decode_gb_per_s")), v.get("source")])
        parts.append(f"**`{path.name}`** ({t['hardware']})\n\n"
                     + _table(["codec", "encode GB/s", "decode GB/s", "source"], rows))
    return "\n\n".join(parts)


SECTIONS = {
    "fidelity-summary": fidelity_summary,
    "fidelity-heldout-summary": lambda: fidelity_summary("heldout"),
    "fidelity-breakdown": fidelity_breakdown,
    "fidelity-table": fidelity_table,
    "fidelity-runs": fidelity_runs,
    "performance-source": perf_source,
    "performance-model": perf_model,
    "performance-codecs": perf_codecs,
    "performance-links": perf_links,
    "performance-codec-timing": perf_codec_timing,
}


# ---------------------------------------------------------------- mkdocs events

def on_pre_build(config):
    shipped_runs.cache_clear()


def on_files(files, config):
    """The committed figures, served as plots/<name>.png (read from the repository's plots/)."""
    for png in sorted(PLOTS_DIR.glob("*.png")):
        files.append(File(f"plots/{png.name}", str(REPO), config["site_dir"],
                          config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    def replace(m: re.Match) -> str:
        name = m.group(1)
        if name not in SECTIONS:
            raise KeyError(f"{page.file.src_uri}: no generated section {name!r}")
        return SECTIONS[name]()

    return _PLACEHOLDER.sub(replace, markdown)
