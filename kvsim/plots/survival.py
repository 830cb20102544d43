"""Speculative acceptance survival curves P(accepted >= k) (the Lynx paper's Figure 10a):
measured files from `kvsim quality` (data/acceptance/) with reference curves (the seeds'
Figure 10a by default) for comparison.

Colour: the codec (kvsim.plots.style.codec_color); line style: the number of streams
drafted on (and the decoding, when files of several are drawn); reference curves are black,
dashed, with hollow circles. The y axis reaches a little below 0 and above 1, so a curve at
0 (the tail after the last accepted draft) or at 1 (every draft accepted) shows beside the
axis instead of on it. A curve that lies on one drawn before (the same drafts: lynx-2+2+4's
anchor + residual1 is lynx's 4-bit anchor) is dashed on top of it, the earlier one widened
and paled beneath, and its legend entry names the curve it is on."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from kvsim.plots.inputs import load_survivals, run_date
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import (
    codec_color,
    coincident_with,
    fitted_title,
    max_gap,
    new_figure,
)
from kvsim.scenario.acceptance import AcceptanceModel, load_acceptance

# line style per variant (streams used, decoding), in that order
_STYLES = ["-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1))]
# a curve drawn on top of an earlier one it lies on: dashes with gaps wide enough to show
# the widened curve beneath
_ON_TOP_STYLE = (0, (4, 3))
_LINE_WIDTH_PT = 1.6
_UNDERLAY_WIDTH_PT = 5.0  # an earlier curve another lies on: wider and paler, around it
_UNDERLAY_ALPHA = 0.4
# survival is a probability: 1% of the [0, 1] range reads as one line to the eye
_ONE_LINE_PROBABILITY = 0.01
# y limits (probability): 0 and 1 lie inside the panel, off its frame
Y_LIMITS = (-0.04, 1.04)


def _variant(m: AcceptanceModel) -> tuple[int, str]:
    """(streams used, decoding) of a measured curve: what its line style says (a one-stream
    codec's full cache and a Lynx anchor are both the first stream)."""
    return int(m.meta.get("streams_used", 1)), str(m.meta.get("decoding", ""))


def _label(m: AcceptanceModel, with_decoding: bool, with_model: bool) -> str:
    """'lynx (anchor)', 'lynx (anchor, sampling)', 'int8'; the file's name when it names no
    codec."""
    codec = m.meta.get("codec")
    if not codec:
        return m.name
    stream, decoding = str(m.meta.get("stream", "full")), str(m.meta.get("decoding", ""))
    details = [stream] if stream and stream != "full" else []
    if with_decoding and decoding:
        details.append(decoding)
    if with_model and m.meta.get("model"):
        details.append(str(m.meta["model"]))
    return f"{codec} ({', '.join(details)})" if details else str(codec)


def _constant_note(s: list[float]) -> str:
    """What the legend says of a curve flat for every k >= 1 (it lies along an edge)."""
    tail = s[1:]
    if tail and all(v == 0.0 for v in tail):
        return " (0 for every k >= 1: on the x axis)"
    if all(v == 1.0 for v in s):
        return " (1 for every k: along the top)"
    return ""


def _measured_dates(measured: list[AcceptanceModel]) -> str:
    """'measured 2026-11-21' (or 'measured A to B') from the files' provenance times; ""
    when no file carries one."""
    dates = sorted({d for d in (run_date(m.meta) for m in measured) if d})
    if not dates:
        return ""
    return f"measured {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else "")


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    if opts.max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {opts.max_k}")
    # anchors first: a later prefix that lies on an anchor's curve is the one dashed on top
    measured = sorted(load_survivals(opts.input, opts.match), key=lambda m: _variant(m)[0])
    refs = [load_acceptance(name) for name in opts.reference]
    variants = sorted({_variant(m) for m in measured})
    with_decoding = len({v[1] for v in variants}) > 1
    with_model = len({str(m.meta.get("model")) for m in measured}) > 1
    fig, (ax,) = new_figure(7.0, 5.2)
    ks = np.arange(opts.max_k + 1)
    drawn: dict[str, list[float]] = {}  # label -> P(accepted >= k) for k in ks
    lines: dict[str, Line2D] = {}
    curves = []

    def draw(name: str, label: str, s: list[float], color: str, style, width_pt: float,
             step: bool, **markers) -> None:
        under = coincident_with(s, drawn, rel_tol=0.0, abs_tol=_ONE_LINE_PROBABILITY)
        shown = label + _constant_note(s)
        if under:
            gap = max_gap(s, drawn[under])
            shown += (f": on {under}, the same curve" if gap == 0 else
                      f": on {under}, within {gap:.2g}")
            beneath = lines[under]
            beneath.set_linewidth(_UNDERLAY_WIDTH_PT)
            beneath.set_alpha(_UNDERLAY_ALPHA)
            if beneath.get_linestyle() not in ("-", "solid"):
                beneath.set_linestyle("-")  # a band, so the dashes on it show where it is
            style = _ON_TOP_STYLE
        plot = ax.step if step else ax.plot
        kw = {"where": "post"} if step else {}
        (line,) = plot(ks, s, color=color, linestyle=style, linewidth=width_pt, label=shown,
                       zorder=3 if under else 2, **kw, **markers)
        drawn[label], lines[label] = s, line
        curves.append({"name": name, "label": shown, "on_curve_of": under,
                       "p_ge_10": s[min(10, opts.max_k)], f"p_ge_{opts.max_k}": s[-1]})

    for m in measured:
        s = [m.survival_at(int(k)) for k in ks]
        codec = str(m.meta.get("codec", m.name))
        draw(m.name, _label(m, with_decoding, with_model), s, codec_color(codec),
             _STYLES[variants.index(_variant(m)) % len(_STYLES)], _LINE_WIDTH_PT, step=True)
    for m in refs:
        s = [m.survival_at(int(k)) for k in ks]
        # hollow circles every 8 k: a reference is told from a measured step curve (bf16's
        # is black too) at a glance
        draw(m.name, f"{m.name} ({m.meta.get('model', m.source)}, {m.source})", s, "black",
             "--", 2.2, step=False, marker="o", markersize=4, markevery=8,
             markerfacecolor="white")
    ax.set_xlim(0, opts.max_k)
    ax.set_ylim(*Y_LIMITS)
    ax.set_xlabel("k (drafted tokens accepted)")
    ax.set_ylabel("P(accepted >= k) (probability)")
    ax.grid(True, alpha=0.3)
    # under the figure (saved with bbox_inches="tight"), which keeps the panel's width
    # whatever the number of curves
    fig.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2)
    models = sorted({str(m.meta.get("model", "?")) for m in measured})
    ctx = sorted({m.meta.get("context_tokens") for m in measured if m.meta.get("context_tokens")})
    decoding = sorted({str(m.meta.get("decoding")) for m in measured if m.meta.get("decoding")})
    runs = sorted({m.meta.get("runs") for m in measured if m.meta.get("runs")})
    detail = ", ".join(filter(None, [
        "/".join(models), f"{'/'.join(str(c) for c in ctx)}-token contexts" if ctx else "",
        "/".join(decoding), f"{'/'.join(str(r) for r in runs)} run(s)" if runs else "",
        _measured_dates(measured)]))
    ax.set_title(opts.title or fitted_title(
        f"Acceptance survival, draft on codec, verify on full precision: {detail}", fig),
        fontsize=10)
    fig.tight_layout()
    return fig, {"curves": curves}
