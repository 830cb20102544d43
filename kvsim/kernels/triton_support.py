"""Where kvsim's Triton kernels may run, and a build check that needs no GPU.

A Triton kernel runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the CPU
test suite). Launched on a CPU tensor without the interpreter, Triton fails deep inside its
launcher ("Pointer argument cannot be accessed from Triton"); `require_kernel_device` says
what to do instead, before anything is allocated.

The interpreter does not check everything the compiler does (a constexpr name rebound in an
unrolled loop passed every CPU test and failed to build on an H100), so `compile_ptx`
builds a kernel for a CUDA target with Triton's bundled toolchain, no GPU needed. It must run
with TRITON_INTERPRET unset, i.e. in a fresh process: interpreted kernels do not compile.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvsim.kernels.codec import CodecError

# sm_90 (H100 / H200), the GPUs kvsim's kernels are checked on
DEFAULT_CUDA_ARCH = 90


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter: TRITON_INTERPRET read as Triton
    reads it (1, true, on, yes), at call time."""
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except (ImportError, AttributeError):  # a Triton without knobs (< 3.4)
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def ptxas_path() -> str | None:
    """The ptxas that Triton compiles CUDA kernels with, or None where this Triton install
    has none (compile_ptx cannot run there)."""
    try:
        import triton

        path = triton.knobs.nvidia.ptxas.path
    except Exception:  # no NVIDIA backend, or a Triton without knobs
        return None
    return path if path and os.access(path, os.X_OK) else None


def require_kernel_device(device: torch.device, who: str, instead: str) -> None:
    """Raise CodecError unless a Triton kernel can run on `device`. who: e.g. "lynx triton
    backend"; instead: what the user can do, e.g. "use backend 'cpu' or 'auto'"."""
    if device.type != "cuda" and not interpreting():
        raise CodecError(f"{who} needs a CUDA tensor (or TRITON_INTERPRET=1); got a "
                         f"{device.type} tensor: {instead}")


def compile_ptx(fn: Any, arg_types: dict[str, str], constexprs: dict[str, Any],
                arch: int = DEFAULT_CUDA_ARCH, fp_fusion: bool = True,
                num_warps: int = 4) -> str:
    """Build one @triton.jit kernel for CUDA sm_<arch> without a GPU; returns its PTX.

    arg_types: Triton type of each runtime argument ("*fp32", "*u8", "fp32"); arguments named
    in neither mapping are "i32". constexprs: value of each constexpr argument. Raises what
    the Triton compiler raises (CompilationError naming the kernel line) when it does not
    build."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    # a kernel is interpreted or compiled as its module was imported: both must be "compiled"
    if interpreting() or not isinstance(fn, JITFunction):
        raise RuntimeError(f"compile_ptx needs a compiled kernel, got {type(fn).__name__} "
                           f"{getattr(fn, '__name__', fn)!r}: import the kernel module with "
                           "TRITON_INTERPRET unset, in a fresh process")
    names = list(fn.arg_names)
    unknown = (set(arg_types) | set(constexprs)) - set(names)
    if unknown:
        raise ValueError(f"{fn.__name__}: no argument(s) {sorted(unknown)}; it takes {names}")
    signature = {n: arg_types.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"enable_fp_fusion": fp_fusion, "num_warps": num_warps})
    return compiled.asm["ptx"]
