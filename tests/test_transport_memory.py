"""kvsim.transport.memory: a node process keeps the memory it frees, so a request reuses the
pages of the one before it instead of page-faulting fresh ones (glibc; measured in a child
process, since the setting is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# a 2048-token SmolLM2 cache in fp32: 60 tensors of 1.5 MiB (K and V of 30 layers), 94 MB,
# allocated and freed by a "request" in one thread, then again by the next in a new thread
_CHILD = r"""
import json, resource, sys, threading
import torch
from kvsim.transport.memory import retain_freed_memory
applied = retain_freed_memory("test") if sys.argv[1] == "retain" else False
torch.set_num_threads(1)
def request(out):
    r0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    cache = [torch.zeros(3, 2048, 64) for _ in range(60)]
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0)
    del cache
faults = []
for _ in range(3):
    t = threading.Thread(target=request, args=(faults,)); t.start(); t.join()
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_later_requests_reuse_the_first_ones_pages():
    pages = 60 * 3 * 2048 * 64 * 4 // 4096  # 23,040 pages of 4 KiB
    kept = _faults("retain")
    if not kept["applied"]:
        pytest.skip("not glibc: the allocator is left as it is")
    plain = _faults("plain")
    # the first request faults its pages in either way; later ones reuse them when retained
    assert kept["faults"][0] > pages // 2 and plain["faults"][0] > pages // 2
    assert max(kept["faults"][1:]) < pages // 8  # (measured: 1 to 1,536 of 23,040)
    # without it glibc mmaps each 1.5 MiB tensor and returns it: every request faults again
    # (a check that this test can fail)
    assert min(plain["faults"][1:]) > pages // 2


_WARM_UP_CHILD = r"""
import json, resource
from kvsim.core.compose import compose
from kvsim.transport.config import EmulateConfig
from kvsim.transport import session
cfg, _ = compose("transport", ["transport.kv_source=synthetic", "transport.decode=timing",
                               "workload.context_tokens=2048"], EmulateConfig)
session.warm_up(cfg, None)  # compile the codecs first: their faults are not counted
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
session.warm_up(cfg, None, decode_side=True)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "bytes": cfg.model.kv_bytes_bf16(2048) * 2}))
"""


def test_the_decode_sides_warm_up_touches_its_largest_cache_or_says_why_not(monkeypatch, capsys):
    """warm_up(decode_side=True) allocates the largest request's fp32 cache (and frees it);
    past PEAK_WARM_UP_MAX_BYTES it leaves it and says so. (Faults are counted in a child
    with glibc's defaults: this process may keep freed memory, after an in-process
    `kvsim calibrate`.)"""
    out = subprocess.run([sys.executable, "-c", _WARM_UP_CHILD], capture_output=True,
                         text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["faults"] > got["bytes"] // 4096 // 2  # the fp32 cache's pages, touched
    assert "untouched" not in out.stderr

    from kvsim.core.compose import compose
    from kvsim.transport import session
    from kvsim.transport.config import EmulateConfig

    cfg, _ = compose("transport", ["transport.kv_source=synthetic", "transport.decode=timing",
                                   "workload.context_tokens=2048"], EmulateConfig)
    monkeypatch.setattr(session, "PEAK_WARM_UP_MAX_BYTES", 1 << 20)
    session.warm_up(cfg, None, decode_side=True)
    assert "warm-up leaves the memory of 2048-token caches untouched" in capsys.readouterr().err


def test_without_glibc_the_allocator_is_left_as_it_is_and_the_node_says_so(monkeypatch, capsys):
    import ctypes.util

    from kvsim.transport.memory import retain_freed_memory

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert retain_freed_memory("serve") is False
    assert capsys.readouterr().err.startswith(
        "kvsim serve: freed memory goes back to the system (no C library found)")


def test_the_warm_up_builds_a_batched_requests_row_too(monkeypatch, capsys):
    """With a real model the warm-up builds the anchor's and the full cache of the largest
    request, and batched its row of the batch's cache besides: 1 + 2 x 2 fp32 copies of its
    cache unbatched, 1 + 2 x 3 batched (each cache stepped twice: two copies). Read from the
    size it names when that is past PEAK_WARM_UP_MAX_BYTES (nothing is built then)."""
    from kvsim.core.compose import compose
    from kvsim.transport import session
    from kvsim.transport.config import EmulateConfig

    monkeypatch.setattr(session, "PEAK_WARM_UP_MAX_BYTES", 1 << 20)
    for batch, copies in ((1, 5), (8, 7)):
        cfg, _ = compose("transport", ["transport.decode=real", "workload.context_tokens=2048",
                                       f"workload.decode_max_batch={batch}"], EmulateConfig)
        session._reach_peak_memory(cfg, lm=object())
        gib = copies * 2 * cfg.model.kv_bytes_bf16(2048) / 2**30  # fp32: twice bf16's bytes
        assert f"({gib:.1f} GiB > " in capsys.readouterr().err
