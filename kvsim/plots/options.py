"""Typed options of `kvsim plot` (the command's Config)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PlotOptions:
    kind: str = ""  # ttkt | fig11 | survival | codecs | breakdown | pareto | fidelity | reuse
    input: str = ""  # the file (or, for survival, directory / files) the figure is made from
    # output path, one file per format (x.png -> x.png, x.pdf); "": <run directory>/<kind>.png
    out: str = ""
    overwrite: bool = False  # replace existing figure files (else refused, nothing drawn)
    dpi: int = 100
    title: str = ""  # replaces the automatic title (which names the source config)
    # ttkt / fig11: times measured from request arrival, or from prefill end (the seeds'
    # Figure 2 convention); "": each figure's default (ttkt: arrival; fig11: prefill_end,
    # where the codecs' differences are not hidden under the prefill)
    origin: str = ""  # "" | arrival | prefill_end
    # ttkt / fig11: committed (a drafted token counts once verified: the time a user sees a
    # verified token) | drafted (when drafted, as the seeds count)
    count: str = "committed"
    k: int = 64  # fig11: the TT<k>T plotted
    fixed_bandwidth_gbps: float | None = None  # fig11 context panel (null: the table's median)
    fixed_context_tokens: int | None = None  # fig11 bandwidth panel (null: the table's median)
    # survival: file-name glob inside an input directory, and reference curves to overlay
    match: str = "*.json"
    reference: list[str] = field(default_factory=lambda: ["seeds-fig10"])
    max_k: int = 64  # survival: x range
    formats: list[str] = field(default_factory=lambda: ["png", "pdf"])


ORIGINS = ("arrival", "prefill_end")
COUNTS = ("committed", "drafted")
