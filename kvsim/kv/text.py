"""Reproducible text contexts from real text shipped on this machine (no data set downloads).

Sources (documents in a fixed order, then shuffled by `seed`):
- "stdlib-docs": the documentation strings of the Python standard library's modules (module,
  class and function docstrings, read with `ast` from the .py sources; nothing is imported);
- "stdlib-source": the standard library's .py source files themselves;
- "licenses": license texts (/usr/share/common-licenses/* and Python's LICENSE.txt).

`assemble(tokenizer, tokens, source, seed)` concatenates documents until the token count is
reached and cuts the token ids to exactly `tokens`. The same Python version, source and seed
give the same ids; `TextSample.sha256` fingerprints them for provenance.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCES = ("stdlib-docs", "stdlib-source", "licenses")
_MIN_DOC_CHARS = 200  # shorter documents add little text and many boundaries
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
              "lib2to3", "turtledemo", "ensurepip", "venv"}


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _license_files() -> list[Path]:
    files = []
    common = Path("/usr/share/common-licenses")
    if common.is_dir():
        files += sorted(p for p in common.iterdir() if p.is_file())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files += sorted(p for p in (stdlib / "LICENSE.txt", Path(sys.prefix) / "LICENSE.txt")
                    if p.is_file())
    return list(dict.fromkeys(files))


def _docstrings(path: Path) -> str:
    """Module, class and function docstrings of one source file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    parts = []
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, nodes):
            doc = ast.get_docstring(node)
            if doc:
                title = "" if isinstance(node, ast.Module) else f"{node.name}: "
                parts.append(title + doc.strip())
    return "\n\n".join(parts)


def documents(source: str) -> list[Path]:
    """The files a source draws from, in a fixed order (before the seed's shuffle)."""
    if source in ("stdlib-docs", "stdlib-source"):
        files = _stdlib_files()
    elif source == "licenses":
        files = _license_files()
    else:
        raise ValueError(f"unknown text source {source!r}; choose one of {SOURCES}")
    if not files:
        raise FileNotFoundError(f"text source {source!r}: no files found on this machine")
    return files


def _document_text(source: str, path: Path) -> str:
    if source == "stdlib-docs":
        return _docstrings(path)
    return path.read_text(encoding="utf-8", errors="replace")


def iter_documents(source: str, seed: int) -> Iterator[tuple[str, str]]:
    """(document id, text) in the seed's order; documents shorter than 200 chars skipped."""
    files = documents(source)
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i in order:
        path = files[i]
        text = _document_text(source, path).strip()
        if len(text) < _MIN_DOC_CHARS:
            continue
        try:
            doc_id = path.relative_to(stdlib).as_posix()
        except ValueError:
            doc_id = str(path)
        yield doc_id, text


@dataclass
class TextSample:
    ids: list[int]  # exactly the requested number of token ids
    source: str
    seed: int
    documents: list[str] = field(default_factory=list)  # document ids used, in order

    @property
    def sha256(self) -> str:
        return hashlib.sha256(",".join(map(str, self.ids)).encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"text_source": self.source, "text_seed": self.seed, "text_tokens": len(self.ids),
                "text_documents": self.documents[:8] + (["..."] if len(self.documents) > 8
                                                        else []),
                "text_sha256": self.sha256,
                "python": ".".join(map(str, sys.version_info[:3]))}


def assemble(tokenizer: Any, tokens: int, source: str = "stdlib-docs", seed: int = 0,
             separator: str = "\n\n") -> TextSample:
    """Token ids of real text, exactly `tokens` long. `tokenizer.encode(text,
    add_special_tokens=False)` must return a list of ints."""
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"text length must be a positive number of tokens, got {tokens!r}")
    ids: list[int] = []
    used: list[str] = []
    for doc_id, text in iter_documents(source, seed):
        piece = tokenizer.encode((separator if ids else "") + text, add_special_tokens=False)
        ids.extend(int(t) for t in piece)
        used.append(doc_id)
        if len(ids) >= tokens:
            return TextSample(ids[:tokens], source, seed, used)
    raise ValueError(f"text source {source!r} holds only {len(ids)} tokens, fewer than the "
                     f"{tokens} requested")
