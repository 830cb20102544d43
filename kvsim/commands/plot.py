"""Paper-style figures from the files other kvsim commands write, as PNG and PDF (matplotlib,
Agg). kind=ttkt (TTKT vs k per codec, Figure 9) and kind=breakdown (Figure-2 stacked bars) read
a `kvsim sim` report; kind=fig11 (TT<k>T vs context and vs bandwidth) a `kvsim sweep` table;
kind=survival (P(accepted >= k), Figure 10a) data/acceptance/ files; kind=codecs
(bits/element vs vNMSE) a `kvsim bench codecs` report or a data/vnmse table; kind=pareto
(time vs vNMSE per codec and transfer policy) a `kvsim advise` report; kind=fidelity
(simulated vs measured times) a `kvsim validate` report; kind=reuse (TTFT and hit rate
vs prefix cache capacity) a `kvsim sweep` table. Figures go to the
run directory unless out= names a path (out=plots/<name>.png updates a committed figure, with
overwrite=true when it exists)."""

from __future__ import annotations

from pathlib import Path

from kvsim.plots.options import PlotOptions

COMMAND = ("plot",)
HELP = ("figures (PNG+PDF): kind=ttkt|fig11|survival|codecs|breakdown|pareto|fidelity|reuse from "
        "kvsim output files")
CONFIG_NAME = "plot"
Config = PlotOptions


def run(cfg: PlotOptions) -> list[dict]:
    from kvsim.core.outputs import check_new, out_root
    from kvsim.plots import KINDS
    from kvsim.plots.style import figure_paths, save

    if cfg.kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {cfg.kind!r}")
    if cfg.dpi < 10:
        raise ValueError(f"dpi must be >= 10, got {cfg.dpi}")
    if not cfg.formats:
        raise ValueError("formats is empty: name at least one of png, pdf, svg")
    # default: the run directory; the committed plots/ only when out= names it
    out = Path(cfg.out) if cfg.out else out_root(None) / f"{cfg.kind}.png"
    check_new(figure_paths(out, list(cfg.formats)), cfg.overwrite)
    fig, summary = KINDS[cfg.kind].make(cfg)
    paths = save(fig, out, list(cfg.formats), cfg.dpi)
    for p in paths:
        print(f"wrote {p} ({p.stat().st_size} bytes)")
    return [{"kind": cfg.kind, "input": cfg.input, "files": [str(p) for p in paths],
             **summary}]
