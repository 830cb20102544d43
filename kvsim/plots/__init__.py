"""Paper-style figures from the files kvsim commands write; one module per figure kind.

Each kind module defines `make(opts: PlotOptions) -> (Figure, dict)`: the figure and a
summary of what it drew (input, series) for the command's report row."""

from __future__ import annotations

from kvsim.plots import breakdown, codecs, fidelity, fig11, pareto, reuse, survival, ttkt

KINDS = {
    "ttkt": ttkt,  # TTKT vs k per codec (Lynx Figure 9) from a `kvsim sim` report
    "fig11": fig11,  # TT<k>T vs context and vs bandwidth per codec from a `kvsim sweep` table
    "survival": survival,  # acceptance survival curves (Figure 10a) from data/acceptance
    "codecs": codecs,  # bits/element vs vNMSE from `kvsim bench codecs` or a vNMSE table
    "breakdown": breakdown,  # stacked Figure-2 breakdown bars from a `kvsim sim` report
    "pareto": pareto,  # time vs vNMSE per codec x policy from a `kvsim advise` report
    "fidelity": fidelity,  # simulated vs measured times from a `kvsim validate` report
    "reuse": reuse,  # TTFT and hit rate vs prefix cache capacity from a `kvsim sweep` table
}

__all__ = ["KINDS"]
