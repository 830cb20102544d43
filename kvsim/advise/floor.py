"""The quality floor of `kvsim advise` and each codec's output quality.

Output quality is the attention-output vNMSE of the cache the *committed* tokens are decoded
from, measured by `kvsim quality` (data/vnmse/*.json): the row of a codec with all its streams
used. For a split-stream codec that is the anchor + residual(s) reconstruction, not the
anchor: drafts made on the anchor are committed only once verified on the full set of
streams, so the anchor's error changes how many drafts are accepted (speed), not what the
user gets.

Floors:
- a number: admissible when the measured vNMSE <= the number;
- `lossless`: the committed output must be the one the serving-precision (bf16) cache
  gives: admissible when the measured vNMSE is no larger than the bf16 row's (the bf16
  row is the serving cache against the model-precision reference; a codec that reproduces
  it bit for bit measures the same). Only committed times count then: a drafted token is
  shown before verification and may be rejected;
- `none`: every codec, measured or not.
A codec with no measurement is not admissible under a numeric or lossless floor: its
quality cannot be vouched for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSSLESS = "lossless"
NO_FLOOR = "none"
SERVING_CODEC = "bf16"  # the serving precision's row in a vNMSE table


@dataclass(frozen=True)
class QualityFloor:
    kind: str  # "vnmse" | "lossless" | "none"
    max_vnmse: float | None = None  # kind == "vnmse": the bound (dimensionless)

    def describe(self) -> str:
        if self.kind == "vnmse":
            return f"vNMSE <= {self.max_vnmse:g}"
        return "lossless (committed output equal to the bf16 cache's)" \
            if self.kind == LOSSLESS else "none"


def parse_floor(value: object) -> QualityFloor:
    """`lossless`, `none`, or a vNMSE bound (a number >= 0, or a string of one)."""
    if isinstance(value, str) and value.strip().lower() in (LOSSLESS, NO_FLOOR):
        kind = value.strip().lower()
        return QualityFloor("lossless" if kind == LOSSLESS else "none")
    if isinstance(value, bool):
        raise ValueError(f"floor must be lossless, none or a vNMSE bound, got {value!r}")
    try:
        bound = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"floor must be lossless, none or a vNMSE bound (a number >= 0), "
                         f"got {value!r}") from None
    if not math.isfinite(bound) or bound < 0:
        raise ValueError(f"floor: a vNMSE bound must be a finite number >= 0, got {value!r}")
    return QualityFloor("vnmse", bound)


@dataclass(frozen=True)
class CodecQuality:
    codec: str  # preset label
    vnmse: float | None  # all streams used; None: not measured
    bits_per_element: float | None
    source: str  # the table it came from, or "" when not measured


def codec_qualities(tables: list) -> dict[str, CodecQuality]:
    """{codec label: quality with every stream used} over vNMSE tables (kvsim.quality.vnmse
    VNMSETable); a codec in several tables keeps the first table's row."""
    out: dict[str, CodecQuality] = {}
    for table in tables:
        for codec in dict.fromkeys(r["codec"] for r in table.rows):
            if codec in out:
                continue
            row = table.lookup(codec)  # the row with the most streams used
            out[codec] = CodecQuality(codec, float(row["vnmse"]),
                                      row.get("bits_per_element"), table.name)
    return out


def admissible(floor: QualityFloor, quality: CodecQuality | None,
               serving: CodecQuality | None) -> tuple[bool, str]:
    """(admissible, why not) of one codec under the floor."""
    if floor.kind == NO_FLOOR:
        return True, ""
    if quality is None or quality.vnmse is None:
        return False, "vNMSE not measured"
    if floor.kind == LOSSLESS:
        if serving is None or serving.vnmse is None:
            raise ValueError("floor=lossless needs the bf16 row of a vNMSE table (the serving "
                             "cache) to compare with; none of vnmse_tables has one")
        if quality.vnmse <= serving.vnmse:
            return True, ""
        return False, f"vNMSE {quality.vnmse:.3g} > bf16's {serving.vnmse:.3g} (lossy)"
    assert floor.max_vnmse is not None
    if quality.vnmse <= floor.max_vnmse:
        return True, ""
    return False, f"vNMSE {quality.vnmse:.3g} > {floor.max_vnmse:g}"
