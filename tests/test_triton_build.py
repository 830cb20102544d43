"""Every Triton kernel builds for an H100 (sm_90) with Triton's bundled toolchain, no GPU
needed. The CPU suite runs the kernels under TRITON_INTERPRET=1, which does not check what
the compiler checks (a rebound constexpr name passed every interpreted test and failed to
build on a GPU), so each kernel is also compiled, in a fresh process without the
interpreter."""

from __future__ import annotations

import json

import pytest
from triton_checks import needs_ptxas, run_compiled

# module -> its compile_for_cuda() (default tile parameters)
MODULES = ["kvsim.kernels.hadamard_triton", "kvsim.kernels.uniform.triton",
           "kvsim.kernels.kivi.triton", "kvsim.kernels.kivi.lowrank_triton",
           "kvsim.kernels.lynx.triton"]


@needs_ptxas
@pytest.mark.parametrize("module", MODULES)
def test_kernels_build_for_sm90(module):
    code = (f"import json, {module} as m; p = m.compile_for_cuda(); "
            "print(json.dumps({k: [len(v), v.count('.entry')] for k, v in p.items()}))")
    run = run_compiled(code)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert built, f"{module}.compile_for_cuda built nothing"
    for name, (chars, entries) in built.items():
        assert chars > 1000 and entries == 1, f"{module}: {name} gave {chars} chars of PTX"


def test_compile_ptx_names_unknown_arguments():  # refused before compiling: no ptxas needed
    code = ("from kvsim.kernels.triton_support import compile_ptx; "
            "from kvsim.kernels.hadamard_triton import _fwht_kernel as k; "
            "compile_ptx(k, {'x_ptr': '*fp32', 'nope': 'i32'}, {})")
    run = run_compiled(code, timeout_s=300)
    assert run.returncode != 0 and "no argument(s) ['nope']" in run.stderr, run.stderr[-1000:]


def test_compile_ptx_refuses_an_interpreted_kernel(monkeypatch):
    """This process defined its kernels under TRITON_INTERPRET=1 (on a GPU they are compiled
    and the check is moot): an interpreted kernel cannot be compiled, and says how to get one,
    with the interpreter still on and after it is turned off (the kernel stays interpreted)."""
    from kvsim.kernels import hadamard_triton
    from kvsim.kernels.triton_support import compile_ptx, interpreting

    if not interpreting():
        pytest.skip("kernels here are compiled, not interpreted")
    with pytest.raises(RuntimeError, match="fresh process"):
        compile_ptx(hadamard_triton._fwht_kernel, {}, {})
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="needs a compiled kernel, got .*_fwht_kernel"):
        compile_ptx(hadamard_triton._fwht_kernel, {}, {})
