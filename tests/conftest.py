"""Test setup. Triton kernels run under the interpreter on a machine without CUDA:
TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set
here, before test modules import kvsim's kernel modules. Tests never touch torch.cuda at
import time; `gpu` tests skip cleanly without a device."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Hypothesis' per-example deadline (200 ms) measures the machine, not the code: on a shared
# 2-core machine a JIT compile or a neighbour's load exceeds it. Properties stay checked.
settings.register_profile("kvsim", deadline=None)
settings.load_profile("kvsim")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def _kvsim_run_directories(tmp_path_factory):
    """Hydra run directories (outputs/, multirun/) of the commands tests run go to a temporary
    directory, not into the checkout the tests run from."""
    os.environ["KVSIM_OUTPUT_ROOT"] = str(tmp_path_factory.mktemp("kvsim-runs"))


@pytest.fixture
def kernel_device() -> str:
    """Where Triton kernels run in this session: 'cuda', or 'cpu' under TRITON_INTERPRET=1."""
    return "cuda" if _cuda_available() else "cpu"
