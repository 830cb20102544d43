"""Which torch device a command computes on, named in its config (`device=cpu | cuda |
cuda:N | auto`), and the calls that make a wall-clock time of device work honest.

CUDA runs asynchronously: a kernel launch returns before the kernel ran, so a time taken
after it measures the launch. Code that times device work calls `synchronize(device)`
first (a no-op on the CPU)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from kvsim.core.lazy_module import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

DEVICE_CHOICES = "'cpu', 'cuda', 'cuda:N' or 'auto'"


def check_device_name(name: str) -> None:
    """Refuse what is not a device name (ValueError), without asking torch what exists."""
    if name in ("cpu", "cuda", "auto"):
        return
    index = name.removeprefix("cuda:")
    if index != name and index.isdigit():
        return
    raise ValueError(f"device must be {DEVICE_CHOICES}, got {name!r}")


def resolve_device(name: str) -> torch.device:
    """'cpu' | 'cuda' | 'cuda:N' | 'auto' (cuda where torch sees one) -> torch.device;
    ValueError for a CUDA device this host does not have."""
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={name} requested but torch sees no CUDA device "
                             f"(torch {torch.__version__}, built for CUDA "
                             f"{torch.version.cuda or 'none'})")
        device = torch.device(name)
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device={name}: this host has {count} CUDA device(s)")
        return device
    return torch.device(name)


def device_label(device: torch.device) -> str:
    """What a report calls the device: 'cpu', or 'cuda:0 (NVIDIA H200)'."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def synchronize(device: torch.device, all_streams: bool = False) -> None:
    """Wait for the work queued so far on `device`'s current stream (CUDA); nothing to wait
    for on the CPU. An event recorded now and waited for: what other threads queue while
    this one waits is not waited for. all_streams: every stream of the device, whatever
    was queued (a benchmark's timed call, alone on the device)."""
    if device.type == "cuda":
        if all_streams:
            torch.cuda.synchronize(device)
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


def current_device(device: torch.device) -> AbstractContextManager:
    """Make `device` the calling thread's current CUDA device for the block (a no-op
    elsewhere). Triton launches its kernels on the current device, which a new thread has
    at cuda:0 whatever the tensors say; torch's own ops follow their tensors."""
    if device.type != "cuda":
        return nullcontext()
    return torch.cuda.device(device)


__all__ = ["DEVICE_CHOICES", "check_device_name", "current_device", "device_label",
           "resolve_device", "synchronize"]
