"""Where commands write what they produce, and the rule that nothing is replaced unasked.

Defaults go to the run directory (kvsim.core.paths.output_dir(): Hydra's outputs/<date>/<time>/
under the command line), never into the repository: updating the shipped data/ or plots/ is an
explicit out_dir=data / out=plots/<name>.png. A file that already exists is kept unless the
command is given overwrite=true; commands check every file they will write before the
expensive work (loading a model, measuring) so a refused run costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvsim.core.paths import output_dir


class OutputExistsError(ValueError):
    """A command would replace an existing file without overwrite=true."""


def out_root(explicit: str | Path | None) -> Path:
    """The directory a command writes into: the one it was given, else the run directory."""
    return Path(explicit) if explicit else output_dir()


def check_new(paths: Iterable[Path], overwrite: bool, flag: str = "overwrite=true") -> None:
    """Refuse (naming the first few files and the flag) if any of `paths` exists and
    overwrite is false."""
    if overwrite:
        return
    existing = [p for p in paths if p.exists()]
    if existing:
        shown = ", ".join(str(p) for p in existing[:3])
        more = f" and {len(existing) - 3} more" if len(existing) > 3 else ""
        raise OutputExistsError(f"{shown}{more} already exist{'s' if len(existing) == 1 else ''}"
                                f"; kept: pass {flag} to replace, or write elsewhere")
