"""The data files a run loaded (acceptance curves, codec timings, captures, vNMSE tables, size
models, synthetic calibrations, request traces, hardware profiles, figure inputs, GGUF model
weights), each with its sha256, for the provenance of every report and figure.

Loaders call `record_loaded(path)` right after reading a file. Loaders that do not (or cannot,
e.g. a library reading a path it was given) are still covered for files under the repository's
data/: an audit hook (PEP 578) sees every file the process opens for reading and records those
under data/. Configs (conf/) are not recorded: the report carries the resolved config itself.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from kvsim.core.paths import DATA_DIR, ROOT

_HASH_BLOCK_BYTES = 1 << 20  # read files in 1 MiB blocks (captures are tens of MB)


@dataclass(frozen=True)
class LoadedFile:
    path: str  # relative to the repository root when inside it, else absolute
    sha256: str
    size_bytes: int


# resolved path -> (mtime_ns, size_bytes, LoadedFile): a file read again unchanged is not
# hashed again; one rewritten in between (e.g. by `kvsim quality`) is hashed anew
_loaded: dict[Path, tuple[int, int, LoadedFile]] = {}
_lock = threading.Lock()
_in_hook = threading.local()  # hashing opens the file: the hook must not record that open


def repo_relative(path: Path) -> str:
    """How provenance names a resolved path: relative to the repository root inside it."""
    try:
        return str(path.relative_to(ROOT.resolve()))
    except ValueError:
        return str(path)


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def record_loaded(path: str | Path) -> str | None:
    """Note that this run read `path`; its sha256 (hashed once per unchanged file), or None
    for a directory or a missing path (ignored)."""
    p = Path(path).resolve()
    try:
        stat = p.stat()
    except OSError:
        return None
    if not p.is_file():
        return None
    with _lock:
        known = _loaded.get(p)
        if known is not None and known[:2] == (stat.st_mtime_ns, stat.st_size):
            return known[2].sha256
    nested = getattr(_in_hook, "active", False)
    _in_hook.active = True
    try:
        entry = LoadedFile(repo_relative(p), sha256_file(p), stat.st_size)
    finally:
        _in_hook.active = nested
    with _lock:
        _loaded[p] = (stat.st_mtime_ns, stat.st_size, entry)
    return entry.sha256


def loaded_files() -> list[dict]:
    """Every file recorded so far in this process, sorted by path."""
    with _lock:
        entries = [e for _, _, e in _loaded.values()]
    return [asdict(e) for e in sorted(entries, key=lambda e: e.path)]


def forget_loaded() -> None:
    """Start a new record (tests). Not between the jobs of one process: loaders that cache
    what they read (request traces, size calibrations) would not record it again, so the
    record is per process, a superset of any one job's files."""
    with _lock:
        _loaded.clear()


def _is_read(mode: object, flags: object) -> bool:
    if isinstance(mode, str):
        return not any(c in mode for c in "wax+")
    # os.open: the access mode is in the flags
    return isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR) == 0


def _data_dir_prefixes() -> tuple[str, ...]:
    # both spellings of data/: as configured and with symlinks resolved
    return tuple({os.path.join(os.path.abspath(DATA_DIR), ""),
                  os.path.join(os.path.realpath(DATA_DIR), "")})


def _audit(event: str, args: tuple) -> None:
    # Runs for every audited event of the process: return at once unless a file is opened.
    if event != "open" or getattr(_in_hook, "active", False):
        return
    path, mode, flags = (tuple(args) + (None, None, None))[:3]
    if not isinstance(path, (str, os.PathLike)) or not _is_read(mode, flags):
        return
    full = os.path.abspath(os.fspath(path))  # no system call: imports open many files
    if full.startswith(_DATA_PREFIXES):
        try:
            record_loaded(full)
        except OSError:  # unreadable here: the caller's own open reports it, not this hook
            pass


_DATA_PREFIXES = _data_dir_prefixes()
# Installed once per process, when this module is first imported (kvsim/__init__ imports it,
# so before any loader runs). Audit hooks cannot be removed; this one only reads.
sys.addaudithook(_audit)
