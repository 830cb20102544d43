"""Bits per element vs attention-output vNMSE per codec, from a `kvsim bench codecs` report
or a vNMSE table written by `kvsim quality` (data/vnmse/*.json). Progressive codecs also show
their stream prefixes (anchor only, anchor + residual, ...) as hollow points joined to the
full-cache point. Codecs whose full-cache points coincide (lynx, lynx-int8 and lynx-2+2+4's
last stream are the same bytes) are drawn as larger rings around one point, each named in
the legend with the codec it surrounds.

vNMSE is relative to a reference cache, which the y label names, because the two inputs
differ: a bench report measures each codec against the KV it was given (a bf16 capture, or
synthetic bf16 KV), so bf16 reproduces its input exactly (vNMSE 0); a vNMSE table, which
`kvsim advise` and `kvsim sim` read, measures against the model's own float32 cache, where
bf16's rounding costs 1.3e-5 on SmolLM2-135M. A log axis has no 0: a zero-error codec is
drawn at a floor a decade below every measured value, whose tick reads "0" beneath a break
mark, and its legend entry says so and gives advise's vNMSE for it when advise's tables
measured the same model and context."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatterSciNotation, NullLocator
from matplotlib.transforms import blended_transform_factory

from kvsim.core.paths import DATA_DIR
from kvsim.plots.inputs import load_json, run_date
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import (
    codec_color,
    codec_marker,
    coincident_with,
    fitted_title,
    new_figure,
)

Point = tuple[float, float]  # (bits per element, vNMSE)
MARKER_AREA_PT2 = 48.0  # a full-cache point's marker (points^2)
PREFIX_AREA_PT2 = 36.0  # a stream prefix's hollow marker
# each further codec on an already-drawn point: a ring this much wider (in marker diameters)
RING_STEP = 1.0
LEGEND_LINE_CHARS = 60  # a long legend entry wraps here, keeping two columns in the width


@dataclass
class CodecCurves:
    """What the figure draws: each codec's (bits, vNMSE) per stream prefix, the last being
    the full cache; the KV they were measured on; the cache vNMSE is relative to."""

    curves: dict[str, list[Point]]
    source: str  # "capture KV 30x3x1024x64 bfloat16, 9x32 queries, seed 0"
    reference: str  # "the bfloat16 capture itself", "the float32 model cache"
    date: str = ""  # UTC date the input was measured, "" when it carries none
    # codec -> (vNMSE with every stream, its table, the table's reference) from the tables
    # advise reads, for the model and context of this input's KV; empty when none matches
    advise_vnmse: dict[str, tuple[float, str, str]] = field(default_factory=dict)


def _advise_tables() -> list[str]:
    """The vNMSE tables `kvsim advise` and `kvsim sim` read by default."""
    from kvsim.scenario.config import SimConfig

    return list(SimConfig().vnmse_tables)


def _table_reference(doc: dict) -> str:
    """The cache a vNMSE table's errors are relative to: `kvsim quality` measures against the
    model's cache at the model's precision."""
    if doc.get("model_dtype"):
        return f"the {doc['model_dtype']} model cache"
    return f"the {doc.get('reference', 'reference cache')}"


def advise_vnmse(model: str, context_tokens: int) -> dict[str, tuple[float, str, str]]:
    """{codec: (vNMSE with every stream used, table name, the table's reference)} from
    advise's default tables that measured `model` at `context_tokens` (the first table
    naming a codec wins, its row with the most streams used, as
    kvsim.advise.floor.codec_qualities picks)."""
    out: dict[str, tuple[float, str, str]] = {}
    for name in _advise_tables():
        path = Path(name) if Path(name).is_file() else DATA_DIR / "vnmse" / f"{name}.json"
        if not path.is_file():
            continue
        doc = load_json(path, "a vNMSE table (data/vnmse/)")
        if doc.get("model") != model or doc.get("context_tokens") != context_tokens:
            continue
        full: dict[str, dict] = {}
        for r in doc.get("rows", []):
            codec = str(r["codec"])
            if codec not in full or r.get("streams_used", 1) > full[codec].get("streams_used", 1):
                full[codec] = r
        for codec, r in full.items():
            out.setdefault(codec, (float(r["vnmse"]), str(doc.get("name", path.stem)),
                                   _table_reference(doc)))
    return out


def _capture_model_context(kv_source: str) -> tuple[str, int] | None:
    """(model, context tokens) a capture's name encodes (`kvsim quality` writes
    captures/<model>-ctx<tokens>.pt); None for synthetic KV or another name."""
    stem = Path(kv_source).name.removesuffix(".pt")
    model, sep, tokens = stem.rpartition("-ctx")
    if not sep or not model or not tokens.isdigit():
        return None
    return model, int(tokens)


def _from_bench(doc: dict) -> CodecCurves:
    curves: dict[str, list[Point]] = {}
    for r in doc["rows"]:
        bits, errs = r.get("bits_per_element_prefix"), r.get("vnmse_prefix")
        if not bits or not errs or len(bits) != len(errs):
            bits, errs = [r["bits_per_element"]], [r["vnmse"]]
        curves[str(r["codec"])] = list(zip(bits, errs, strict=True))
    first = doc["rows"][0]
    shape = first.get("shape", {})
    cfg = doc.get("config", {})
    kind = str(first.get("kv_source", "?"))
    dtype = shape.get("dtype") or "input"
    source = (f"{kind} KV {shape.get('layers')}x{shape.get('kv_heads')}"
              f"x{shape.get('tokens')}x{shape.get('head_dim')} {shape.get('dtype', '')}, "
              f"{first.get('q_heads')}x{first.get('q_tokens')} queries, seed {cfg.get('seed')}")
    # the bench compares each decoded cache with the KV it encoded
    reference = f"the {dtype} {'capture' if kind == 'capture' else f'{kind} KV'} itself"
    advise: dict[str, tuple[float, str, str]] = {}
    named = _capture_model_context(str(cfg.get("kv_source", ""))) if kind == "capture" else None
    if named and named[1] == shape.get("tokens"):
        advise = advise_vnmse(*named)
    return CodecCurves(curves, source, reference, run_date(doc), advise)


def _from_vnmse_table(doc: dict) -> CodecCurves:
    by_codec: dict[str, list[tuple[int, Point]]] = {}
    for r in doc["rows"]:
        if "bits_per_element" not in r or "vnmse" not in r:
            raise ValueError(f"vNMSE table {doc.get('name')!r}: row {r.get('codec')!r} lacks "
                             "bits_per_element / vnmse")
        by_codec.setdefault(str(r["codec"]), []).append(
            (int(r.get("streams_used", 1)), (r["bits_per_element"], r["vnmse"])))
    curves = {c: [p for _, p in sorted(pts)] for c, pts in by_codec.items()}
    source = (f"{doc.get('model', '?')} real KV, {doc.get('context_tokens')}-token contexts, "
              f"{doc.get('runs')} run(s), {doc.get('query_tokens')} query tokens")
    return CodecCurves(curves, source, _table_reference(doc), run_date(doc))


def load_curves(path: str) -> CodecCurves:
    what = "a `kvsim bench codecs report=PATH` report or a data/vnmse/*.json table"
    doc = load_json(path, what)
    if doc.get("command") == "bench codecs":
        if not doc.get("rows"):
            raise ValueError(f"input {path}: the 'bench codecs' report has no rows")
        return _from_bench(doc)
    if "command" not in doc and "version" in doc and doc.get("rows"):
        return _from_vnmse_table(doc)
    got = doc.get("command")
    raise ValueError(f"input {path} is {'a ' + repr(got) + ' report' if got else 'not a report'}"
                     f"; expected {what}")


class _ZeroAtFloor(LogFormatterSciNotation):
    """Log tick labels, with the floor's tick (where zero-error codecs are drawn) read "0"."""

    def __init__(self, floor: float):
        super().__init__()
        self.floor = floor

    def __call__(self, x, pos=None):
        if math.isclose(x, self.floor, rel_tol=1e-6):
            return "0"
        return super().__call__(x, pos)


def _exact_label(codec: str, data: CodecCurves) -> str:
    """Legend entry of a codec with vNMSE 0 against this input's reference (wrapped to
    LEGEND_LINE_CHARS)."""
    label = f"{codec}: vNMSE 0 vs {data.reference} (drawn at the '0' tick)"
    if codec in data.advise_vnmse:
        value, table, reference = data.advise_vnmse[codec]
        label += f"; advise's {value:.3g} is vs {reference} ({table})"
    return "\n".join(textwrap.wrap(label, LEGEND_LINE_CHARS, break_on_hyphens=False))


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    data = load_curves(opts.input)
    # an unmeasured prefix (vNMSE null) is left out: drawn, it would read as a value
    curves = {c: [(b, e) for b, e in pts if e is not None] for c, pts in data.curves.items()}
    curves = {c: pts for c, pts in curves.items() if pts}
    positive = [e for pts in curves.values() for _, e in pts if e > 0]
    if not positive:
        raise ValueError(f"input {opts.input}: no codec has a positive vNMSE to plot")
    # where zero-error codecs are drawn: the decade below the one holding the smallest
    # measured vNMSE, so a whole decade (and a break mark) separates "0" from the data
    floor = 10.0 ** (math.floor(math.log10(min(positive))) - 1)
    fig, (ax,) = new_figure(7.4, 4.8)
    points = []
    finals: dict[str, list[float]] = {}  # codec -> its full-cache point (bits, drawn vNMSE)
    stacked: dict[str, int] = {}  # codec drawn first at a point -> codecs on it since
    any_exact = False
    for codec, pts in curves.items():
        color, marker = codec_color(codec), codec_marker(codec)
        xs = [b for b, _ in pts]
        ys = [e if e > 0 else floor for _, e in pts]
        exact = pts[-1][1] <= 0
        any_exact = any_exact or any(e <= 0 for _, e in pts)
        label = _exact_label(codec, data) if exact else codec
        under = coincident_with([xs[-1], ys[-1]], finals, rel_tol=0.01)
        size = MARKER_AREA_PT2
        if under:  # a larger ring around the point already drawn there
            stacked[under] = stacked.get(under, 0) + 1
            size = MARKER_AREA_PT2 * (1 + RING_STEP * stacked[under]) ** 2
            label = f"{label} (ring: same point as {under})"
        finals[codec] = [xs[-1], ys[-1]]
        if len(pts) > 1:
            ax.plot(xs, ys, color=color, linewidth=1.0, alpha=0.7)
            ax.scatter(xs[:-1], ys[:-1], marker=marker, facecolors="none", edgecolors=color,
                       s=PREFIX_AREA_PT2, linewidths=1.2)
        if under:
            ax.scatter(xs[-1:], ys[-1:], marker="o", facecolors="none", edgecolors=color,
                       s=size, linewidths=1.5, label=label, zorder=2)
        else:
            ax.scatter(xs[-1:], ys[-1:], marker=marker, color=color, s=size, label=label,
                       zorder=3)
        points.append({"codec": codec, "bits_per_element": xs[-1], "vnmse": pts[-1][1],
                       "drawn_vnmse": ys[-1], "prefixes": pts[:-1], "same_point_as": under,
                       "advise_vnmse": data.advise_vnmse.get(codec, (None,))[0]})
    ax.set_yscale("log")
    ax.set_ylim(bottom=(floor if any_exact else min(positive)) / 2.5)
    if any_exact:
        ax.yaxis.set_major_formatter(_ZeroAtFloor(floor))
        ax.yaxis.set_minor_locator(NullLocator())  # no log scale runs between "0" and data
        on_spine = blended_transform_factory(ax.transAxes, ax.transData)
        ax.text(0.0, math.sqrt(floor * 10 * floor), "//", transform=on_spine, ha="center",
                va="center", fontsize=9, rotation=90,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    ax.set_xlabel("serialized size (bits per KV element)")
    ax.set_ylabel(f"attention-output vNMSE\n(vs {data.reference}, dimensionless)")
    ax.grid(True, which="major", alpha=0.3)
    # under the figure (saved with bbox_inches="tight"), which keeps the panel's width
    legend = fig.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2)
    for handle in legend.legend_handles:  # rings at the size of a point in the legend
        if isinstance(handle, PathCollection):
            handle.set_sizes([MARKER_AREA_PT2])
    if any(p["prefixes"] for p in points):
        ax.text(0.99, 0.98, "hollow: stream prefixes (anchor, +residual...)",
                transform=ax.transAxes, ha="right", va="top", fontsize=7)
    title = (f"Codec size vs attention error: {data.source}"
             + (f" ({data.date})" if data.date else ""))
    ax.set_title(opts.title or fitted_title(title, fig), fontsize=10)
    fig.tight_layout()
    return fig, {"points": points, "reference": data.reference}
