"""Shared helpers of the Triton build tests: a fresh Python process in which kernels compile
(TRITON_INTERPRET unset; this suite sets it on a machine without CUDA), and a skip marker for
a Triton install without ptxas."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvsim.kernels.triton_support import ptxas_path

needs_ptxas = pytest.mark.skipif(ptxas_path() is None,
                                 reason="this Triton install has no ptxas (no CUDA toolchain)")


def run_compiled(code: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run `python -c code` without TRITON_INTERPRET; stdout and stderr captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
