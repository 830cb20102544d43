"""Speculative acceptance survival curves P(accepted >= k) (the Lynx paper's Figure 10a):
measured files from `kvsim quality` (data/acceptance/) with reference curves (the seeds'
Figure 10a by default) for comparison."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from kvsim.plots.inputs import load_survivals
from kvsim.plots.options import PlotOptions
from kvsim.plots.style import codec_color, new_figure
from kvsim.scenario.acceptance import AcceptanceModel, load_acceptance

_STYLES = ["-", "--", "-.", ":"]


def _label(m: AcceptanceModel) -> str:
    codec = m.meta.get("codec")
    if not codec:
        return m.name
    stream = m.meta.get("stream")
    return f"{codec} ({stream})" if stream and stream != "full" else str(codec)


def make(opts: PlotOptions) -> tuple[Figure, dict]:
    if opts.max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {opts.max_k}")
    measured = load_survivals(opts.input, opts.match)
    refs = [load_acceptance(name) for name in opts.reference]
    fig, (ax,) = new_figure(6.4, 4.2)
    ks = np.arange(opts.max_k + 1)
    curves = []
    for i, m in enumerate(measured):
        s = [m.survival_at(int(k)) for k in ks]
        codec = str(m.meta.get("codec", m.name))
        ax.step(ks, s, where="post", color=codec_color(codec), linestyle=_STYLES[i % 4],
                linewidth=1.6, label=_label(m))
        curves.append({"name": m.name, "p_ge_10": s[min(10, opts.max_k)],
                       f"p_ge_{opts.max_k}": s[-1]})
    for m in refs:
        s = [m.survival_at(int(k)) for k in ks]
        ax.plot(ks, s, color="black", linewidth=2.2, linestyle="--",
                label=f"{m.name} ({m.meta.get('model', m.source)}, {m.source})")
        curves.append({"name": m.name, "p_ge_10": s[min(10, opts.max_k)],
                       f"p_ge_{opts.max_k}": s[-1]})
    ax.set_xlim(0, opts.max_k)
    ax.set_ylim(0, 1.03)
    ax.set_xlabel("k (drafted tokens accepted)")
    ax.set_ylabel("P(accepted >= k)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    models = sorted({str(m.meta.get("model", "?")) for m in measured})
    ctx = sorted({m.meta.get("context_tokens") for m in measured if m.meta.get("context_tokens")})
    decoding = sorted({str(m.meta.get("decoding")) for m in measured if m.meta.get("decoding")})
    runs = sorted({m.meta.get("runs") for m in measured if m.meta.get("runs")})
    detail = ", ".join(filter(None, [
        "/".join(models), f"{'/'.join(str(c) for c in ctx)}-token contexts" if ctx else "",
        "/".join(decoding), f"{'/'.join(str(r) for r in runs)} run(s)" if runs else ""]))
    ax.set_title(opts.title or f"Acceptance survival, draft on codec, verify on full "
                 f"precision:\n{detail}", fontsize=10)
    fig.tight_layout()
    return fig, {"curves": curves}
