"""A codec's numba kernels leave the calling thread's torch thread count as it was
(kvsim.kernels.torch_threads). numba's OpenMP layer sets the shared runtime's count once
per process, in the thread of its first parallel kernel, so each case runs in a fresh
interpreter whose first parallel kernel is the codec call under test."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numba
import pytest
import torch

from kvsim.kernels import torch_threads
from kvsim.kernels.codec import make_codec

ROOT = Path(__file__).resolve().parents[1]
needs_two = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                               reason="numba runs 1 thread here: its layer cannot change "
                                      "torch's count")

PRELUDE = """
import json, pickle, sys, torch, numba
from kvsim.kernels.codec import make_codec
torch.set_num_threads(1)
seen = {"before": torch.get_num_threads()}
"""
REPORT = """
seen["after"] = torch.get_num_threads()
seen["layer"] = numba.threading_layer()
print(json.dumps(seen))
"""


def _fresh(body: str, stdin: bytes = b"") -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("NUMBA_NUM_THREADS", None)
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body) + REPORT],
                          input=stdin, capture_output=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    seen = json.loads(done.stdout.decode().strip().splitlines()[-1])
    if seen["layer"] != "omp":
        pytest.skip(f"numba's threading layer here is {seen['layer']!r}, not OpenMP")
    return seen


def _kv() -> torch.Tensor:
    return torch.randn(2, 2, 2, 256, 64, generator=torch.Generator().manual_seed(0)
                       ).to(torch.bfloat16)


@needs_two
@pytest.mark.parametrize("name", ["uniform", "lynx", "kivi", "cachegen"])
def test_a_first_encode_keeps_the_callers_torch_threads(name):
    seen = _fresh(f"""
        kv = torch.randn(2, 2, 2, 256, 64, generator=torch.Generator().manual_seed(0))
        make_codec({name!r}).encode(kv.to(torch.bfloat16))
        """)
    assert seen["before"] == 1 and seen["after"] == 1


@needs_two
def test_a_first_decode_keeps_the_callers_torch_threads():
    enc = make_codec("lynx").encode(_kv())  # encoded here; the fresh process only decodes
    seen = _fresh("""
        enc = pickle.loads(sys.stdin.buffer.read())
        make_codec("lynx").decode(enc, dtype=torch.float32)
        """, stdin=pickle.dumps(enc))
    assert seen["before"] == 1 and seen["after"] == 1


def test_kept_restores_a_count_changed_inside():
    seen: dict = {}
    previous = torch.get_num_threads()

    def body() -> None:
        torch.set_num_threads(1)
        with torch_threads.kept() as threads:
            seen["inside"] = threads
            torch.set_num_threads(2)  # as numba's layer does to the OpenMP runtime
        seen["after"] = torch.get_num_threads()

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=60)
    torch.set_num_threads(previous)  # torch's count is also a process-wide default
    assert seen == {"inside": 1, "after": 1}
