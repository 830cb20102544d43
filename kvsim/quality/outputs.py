"""The files one `kvsim quality` run writes, named before any work so that existing ones are
refused up front (kvsim.core.outputs): the first context's capture, its synthetic-KV calibration,
the vNMSE table and one acceptance model per measured (codec, stream prefix, decoding).

Layout under the output root (the run directory by default; out_dir=data updates the
repository's data/, where the simulator and the benchmarks look files up by name):
captures/, synthetic/, vnmse/, acceptance/ — the same as data/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvsim.core.outputs import check_new, out_root
from kvsim.core.paths import DATA_DIR


def acceptance_name(model: str, codec_label: str, streams_used: int, decoding: str,
                    tag: str) -> str:
    return f"{model}-{codec_label}-s{streams_used}-{decoding}{tag}"


@dataclass
class QualityOutputs:
    root: Path
    capture: Path
    synthetic: Path  # calibration params; synthetic_meta beside it holds its provenance
    synthetic_meta: Path
    vnmse: Path
    acceptance: dict[str, Path] = field(default_factory=dict)  # acceptance model name -> file

    def paths(self) -> list[Path]:
        return [self.capture, self.synthetic, self.synthetic_meta, self.vnmse,
                *self.acceptance.values()]


def plan_outputs(out_dir: str | None, model: str, context_tokens: int, tag: str,
                 acceptance_names: list[str], random_weights: bool,
                 overwrite: bool) -> QualityOutputs:
    """Name every file, refuse existing ones unless `overwrite`, and refuse a random-weight
    model's numbers in the repository's data/ (they say nothing about real models, and the
    simulator would find them by name)."""
    root = out_root(out_dir)
    if random_weights and root.resolve() == DATA_DIR.resolve():
        raise ValueError(f"quality: model {model} has random weights; its measurements do not "
                         f"belong in {DATA_DIR} (drop out_dir to write to the run directory)")
    stem = f"{model}-ctx{context_tokens}{tag}"
    outputs = QualityOutputs(
        root, root / "captures" / f"{stem}.pt", root / "synthetic" / f"{model}{tag}.json",
        root / "synthetic" / f"{model}{tag}.meta.json", root / "vnmse" / f"{stem}.json",
        {name: root / "acceptance" / f"{name}.json" for name in acceptance_names})
    check_new(outputs.paths(), overwrite)
    return outputs
