"""A codec's numba kernels leave the calling thread's torch thread count as it was
(kvsim.kernels.torch_threads): numba's OpenMP layer sets the shared runtime's count on every
parallel launch, so a receiver configured for 1 torch thread decoded on all cores after
dequantizing on demand."""

from __future__ import annotations

import threading

import numba
import pytest
import torch

from kvsim.kernels import torch_threads
from kvsim.kernels.codec import make_codec

pytestmark = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                                reason="numba runs 1 thread here: its launches cannot "
                                       "change torch's count")


def _in_thread(body) -> dict:
    """Run body() in a fresh thread (its own OpenMP settings), with torch at 1 thread there;
    returns what it saw."""
    seen: dict = {}

    def go() -> None:
        try:
            torch.set_num_threads(1)
            seen["before"] = torch.get_num_threads()
            body()
            seen["after"] = torch.get_num_threads()
        except BaseException as exc:  # noqa: BLE001 (reported to the test below)
            seen["error"] = exc

    previous = torch.get_num_threads()
    t = threading.Thread(target=go)
    t.start()
    t.join(timeout=300)
    torch.set_num_threads(previous)  # torch's count is also a process-wide default
    assert not t.is_alive(), "the codec run did not finish"
    if "error" in seen:
        raise seen["error"]
    return seen


@pytest.mark.parametrize("name", ["uniform", "lynx", "kivi", "cachegen"])
def test_encode_and_decode_keep_the_callers_torch_threads(name):
    kv = (torch.randn(2, 2, 2, 256, 64, generator=torch.Generator().manual_seed(0))
          ).to(torch.bfloat16)
    codec = make_codec(name)
    out: dict = {}

    def body() -> None:
        enc = codec.encode(kv)
        out["encode"] = torch.get_num_threads()
        codec.decode(enc, dtype=torch.float32)
        out["decode"] = torch.get_num_threads()
        if codec.layer_independent:
            codec.decode_layer(enc.shape, 1, [enc.streams[0][len(enc.streams[0]) // 2:]],
                               dtype=torch.float32)
            out["decode_layer"] = torch.get_num_threads()

    seen = _in_thread(body)
    assert seen["before"] == 1
    assert out["encode"] == 1 and out["decode"] == 1
    assert out.get("decode_layer", 1) == 1
    assert seen["after"] == 1


def test_kept_restores_a_count_changed_inside():
    def body() -> None:
        with torch_threads.kept() as threads:
            assert threads == 1
            torch.set_num_threads(2)  # as numba's launch does to the OpenMP runtime
        assert torch.get_num_threads() == 1

    assert _in_thread(body)["after"] == 1
