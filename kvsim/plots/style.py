"""Shared figure plumbing: the Agg backend, per-codec colours stable across figures, saving."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display (before pyplot is imported)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

# One colour per codec preset, the same in every figure, from colour-blind-safe palettes
# (Okabe & Ito's eight, then Paul Tol's muted set): the seeds' comparison (bf16, int8, int4,
# lynx, lynx-oscar) takes Okabe-Ito colours, and the Lynx splits, drawn together in the
# survival and codecs figures, take colours far apart from each other and from lynx's.
_COLORS = {"bf16": "#000000", "int8": "#0072B2", "int4": "#009E73", "lynx": "#D55E00",
           "lynx-oscar": "#CC79A7", "lynx-int4": "#999933", "lynx-int8": "#882255",
           "lynx-2+6": "#332288", "lynx-2+2+4": "#44AA99", "kivi-2": "#56B4E9",
           "kivi-4": "#88CCEE", "kcvt-4": "#E69F00", "gear": "#AA4499", "gear-l": "#DDCC77",
           "oscar": "#661100", "cachegen": "#888888"}
# a label not above (a custom codec entry) takes one of these by a stable hash
_SPARE_COLORS = ("#117733", "#6699CC", "#AA7744", "#555555", "#EE99AA", "#994455")
_ORDER = list(_COLORS)
_MARKERS = "osD^vP*Xhp<>"


def codec_color(label: str) -> str:
    base = label.split(" [", 1)[0]  # "lynx [acceptance=...]" is drawn in lynx's colour
    if base in _COLORS:
        return _COLORS[base]
    return _SPARE_COLORS[zlib.crc32(base.encode()) % len(_SPARE_COLORS)]


# one marker per transfer policy (kvsim.scenario.policy.POLICIES), where a figure sets
# policies apart
_POLICY_MARKERS = {"monolithic": "s", "layerwise": "o", "split_stream": "^",
                   "split_stream_layerwise": "D"}


def policy_marker(policy: str) -> str:
    return _POLICY_MARKERS.get(policy, "x")


def codec_marker(label: str) -> str:
    index = _ORDER.index(label) if label in _ORDER else zlib.crc32(label.encode())
    return _MARKERS[index % len(_MARKERS)]


def new_figure(width_in: float, height_in: float, ncols: int = 1, sharey: bool = False):
    fig, axes = plt.subplots(1, ncols, figsize=(width_in, height_in), sharey=sharey,
                             squeeze=False)
    return fig, list(axes[0])


FORMATS = ("png", "pdf", "svg")
PROVENANCE_KEY = "kvsim provenance"  # PNG text chunk holding the provenance JSON


def figure_paths(out: str | Path, formats: list[str]) -> list[Path]:
    """The files `save` writes: `out` with each format's suffix (out=plots/x.png ->
    plots/x.png, plots/x.pdf)."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix.lower() in (".png", ".pdf", ".svg") else out
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown figure format {fmt!r}; use png, pdf or svg")
    return [stem.with_suffix(f".{fmt}") for fmt in formats]


def _metadata(fmt: str, provenance_json: str) -> dict[str, str]:
    """Each format's own metadata fields: PNG takes any text chunk; PDF and SVG only their
    standard keys (PDF's Subject, SVG's Dublin Core Description) hold the JSON."""
    if fmt == "png":
        return {"Creator": "kvsim plot", PROVENANCE_KEY: provenance_json}
    if fmt == "pdf":
        return {"Creator": "kvsim plot", "Subject": provenance_json}
    return {"Creator": "kvsim plot", "Description": provenance_json}


def save(fig: Figure, out: str | Path, formats: list[str], dpi: int) -> list[Path]:
    """Write the figure in each format (see figure_paths), each file carrying the provenance
    (git state, the data files the figure was made from with their sha256) in its metadata."""
    from kvsim.core.report import json_safe, provenance

    paths = figure_paths(out, formats)
    provenance_json = json.dumps(json_safe(provenance()), sort_keys=True)
    for path, fmt in zip(paths, formats, strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata=_metadata(fmt, provenance_json))
    plt.close(fig)
    return paths


def fitted_title(text: str, fig: Figure, chars_per_inch: float = 12.0) -> str:
    """text wrapped to the figure's width (a title wider than its panels widens the saved
    canvas and shrinks the panels in it)."""
    import textwrap

    width = max(40, int(fig.get_figwidth() * chars_per_inch))
    return "\n".join(textwrap.wrap(text, width=width, break_on_hyphens=False))


def tokens_label(tokens: float) -> str:
    return f"{tokens / 1024:g}K" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:g}"


def coincident_with(ys: list[float], drawn: dict[str, list[float]], rel_tol: float = 0.005,
                    abs_tol: float = 0.0) -> str | None:
    """The first already-drawn series this one lies on (every point within rel_tol of the
    larger value, or within abs_tol: pass 1% of the axis range for "one line to the eye"),
    so the figure can say so instead of hiding one line under another."""
    for name, other in drawn.items():
        if len(other) != len(ys):
            continue
        if all(abs(a - b) <= max(rel_tol * max(abs(a), abs(b), 1e-12), abs_tol)
               for a, b in zip(ys, other, strict=True)):
            return name
    return None


def max_gap(ys: list[float], other: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(ys, other, strict=True))


def one_line_tolerance(series: list[list[float]], fraction: float = 0.01) -> float:
    """What reads as one line: `fraction` of the y range the series span together."""
    values = [v for ys in series for v in ys]
    return fraction * (max(values) - min(values)) if values else 0.0


def interval_band(spread: dict, keys: list[str]) -> tuple[list[float], list[float]] | None:
    """(lows, highs) of the 95% intervals of `keys` in a row's `spread`, or None when any is
    missing (one sample: no interval)."""
    lows, highs = [], []
    for key in keys:
        iv = spread.get(key) or {}
        if iv.get("ci95_low") is None or iv.get("ci95_high") is None:
            return None
        lows.append(float(iv["ci95_low"]))
        highs.append(float(iv["ci95_high"]))
    return lows, highs
