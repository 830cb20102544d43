"""Bits per element vs attention-output vNMSE per codec, from a `kvsim bench codecs` report
or a vNMSE table written by `kvsim quality` (data/vnmse/*.json). Progressive codecs also show
their stream prefixes (anchor only, anchor + residual, ...) as hollow points joined to the
full-cache point. Log vNMSE axis; an exact (zero-error) codec sits on the axis floor. Codecs
whose full-cache points coincide (lynx, lynx-int8 and lynx-2+2+4's last stream are the same
bytes) are drawn as rings around one point and named together in the legend."""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from kvsim.plots.inputs import load_json
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import codec_color, codec_marker, coincident_with, new_figure

Point = tuple[float, float]  # (bits per element, vNMSE)


def _from_bench(doc: dict) -> tuple[dict[str, list[Point]], str]:
    curves: dict[str, list[Point]] = {}
    for r in doc["rows"]:
        bits, errs = r.get("bits_per_element_prefix"), r.get("vnmse_prefix")
        if not bits or not errs or len(bits) != len(errs):
            bits, errs = [r["bits_per_element"]], [r["vnmse"]]
        curves[str(r["codec"])] = list(zip(bits, errs, strict=True))
    first = doc["rows"][0]
    shape = first.get("shape", {})
    cfg = doc.get("config", {})
    source = (f"{first.get('kv_source', '?')} KV {shape.get('layers')}x{shape.get('kv_heads')}"
              f"x{shape.get('tokens')}x{shape.get('head_dim')} {shape.get('dtype', '')}, "
              f"{first.get('q_heads')}x{first.get('q_tokens')} queries, seed {cfg.get('seed')}")
    return curves, source


def _from_vnmse_table(doc: dict) -> tuple[dict[str, list[Point]], str]:
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
    return curves, source


def load_curves(path: str) -> tuple[dict[str, list[Point]], str]:
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


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    curves, source = load_curves(opts.input)
    positive = [e for pts in curves.values() for _, e in pts if e is not None and e > 0]
    if not positive:
        raise ValueError(f"input {opts.input}: no codec has a positive vNMSE to plot")
    floor = 10 ** math.floor(math.log10(min(positive)) - 0.5)  # where exact codecs sit
    fig, (ax,) = new_figure(7.0, 4.6)
    points = []
    finals: dict[str, list[float]] = {}  # codec -> its full-cache point (bits, vNMSE)
    stacked: dict[str, int] = {}  # codec drawn first at a point -> codecs on it since
    for codec, pts in curves.items():
        color, marker = codec_color(codec), codec_marker(codec)
        xs = [b for b, _ in pts]
        ys = [e if e and e > 0 else floor for _, e in pts]
        exact = pts[-1][1] is not None and pts[-1][1] <= 0
        label = f"{codec} (vNMSE 0: on the floor)" if exact else codec
        under = coincident_with([xs[-1], ys[-1]], finals, rel_tol=0.01)
        size = 48
        if under:  # a larger ring around the point already drawn there
            stacked[under] = stacked.get(under, 0) + 1
            size = 48 * (1 + 1.2 * stacked[under]) ** 2
            label = f"{codec} (same point as {under})"
        finals[codec] = [xs[-1], ys[-1]]
        if len(pts) > 1:
            ax.plot(xs, ys, color=color, linewidth=1.0, alpha=0.7)
            ax.scatter(xs[:-1], ys[:-1], marker=marker, facecolors="none", edgecolors=color,
                       s=36, linewidths=1.2)
        if under:
            ax.scatter(xs[-1:], ys[-1:], marker="o", facecolors="none", edgecolors=color,
                       s=size, linewidths=1.5, label=label, zorder=2)
        else:
            ax.scatter(xs[-1:], ys[-1:], marker="v" if exact else marker, color=color, s=size,
                       label=label, zorder=3)
        points.append({"codec": codec, "bits_per_element": xs[-1], "vnmse": pts[-1][1],
                       "prefixes": pts[:-1], "same_point_as": under})
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 2)
    ax.set_xlabel("serialized size (bits per KV element)")
    ax.set_ylabel("attention-output vNMSE")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1)
    if any(p["prefixes"] for p in points):
        ax.text(0.99, 0.98, "hollow: stream prefixes (anchor, +residual...)",
                transform=ax.transAxes, ha="right", va="top", fontsize=7)
    ax.set_title(opts.title or f"Codec size vs attention error:\n{source}", fontsize=10)
    fig.tight_layout()
    return fig, {"points": points}
