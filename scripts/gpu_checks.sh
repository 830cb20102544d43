#!/usr/bin/env bash
# The device checks of the GPU codecs, as one short run on a machine with one CUDA GPU
# (minutes): the `gpu` tests of the device path, then of the emulator on the GPU (`kvsim
# emulate device=cuda`, tests/test_transport_device.py), then `kvsim bench codecs
# device=cuda` on a Llama-3.1-8B-shaped cache (32 layers x 8 KV heads x 8,192 tokens x
# 128, bf16: 1.07 GB), writing a measured timing file. Results go to $OUT (default /tmp/kvsim-gpu-checks):
# gpu-tests.log, gpu-emulate.log, bench.log, bench-report.json, codec_timing/<hardware>.json.
#   OUT=/tmp/x bash scripts/gpu_checks.sh [hardware name, default h100]
# Packages the GPU machine lacks may sit as wheels in .whl/ (installed into /tmp/site).
# TESTS=, EMULATE=0, CODECS= (a bench list, e.g. '[int8,kivi-2]') and HOST_CODECS= ('[]':
# none) narrow a rerun: the steps' timeouts add up to more than one device call's 600 s.
set -uo pipefail
cd "$(dirname "$0")/.."
HARDWARE=${1:-h100}
OUT=${OUT:-/tmp/kvsim-gpu-checks}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVSIM_OUTPUT_ROOT=/tmp/kvsim-gpu-runs
rm -rf "$KVSIM_OUTPUT_ROOT"  # the report copied below is this run's
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

TESTS=${TESTS:-tests/test_device_wire.py tests/test_uniform.py tests/test_lynx_triton.py \
tests/test_hadamard.py tests/test_lowrank_triton.py tests/test_bench_codecs.py}
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -15
tests_rc=${PIPESTATUS[0]}
# the emulator on the GPU (three `kvsim emulate device=cuda` runs of two processes each):
# its own step, so its start-ups cannot cost the kernels' tests their time; EMULATE=0 skips
if [ "${EMULATE:-1}" != 0 ]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_transport_device.py \
        2>&1 | tee "$OUT/gpu-emulate.log" | tail -15
    emulate_rc=${PIPESTATUS[0]}
else
    emulate_rc=0
fi

CODECS=${CODECS:-'[bf16,int8,int4,kivi-2,kivi-4,kcvt-4,gear,gear-l,oscar,lynx,lynx-int4,lynx-int8,lynx-2+6,lynx-2+2+4,lynx-oscar]'}
timeout 420 python3 -m kvsim bench codecs device=cuda kv_source=synthetic "codecs=$CODECS" \
    shape.layers=32 shape.kv_heads=8 shape.tokens=8192 shape.head_dim=128 \
    repeats=10 warmup=2 progress=false write_timing="$HARDWARE" out_dir="$OUT" \
    overwrite=true 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
report=$(find "$KVSIM_OUTPUT_ROOT" -name '*.json' -path '*bench*' | head -1)
[ -n "$report" ] && cp "$report" "$OUT/bench-report.json"
# CacheGen (its rANS coder on the host's CPUs) on its own, added to the same timing file: a
# slow coder cannot cost the device paths' file above
HOST_CODECS=${HOST_CODECS:-'[cachegen]'}
if [ "$HOST_CODECS" != "[]" ]; then
    timeout 240 python3 -m kvsim bench codecs device=cuda kv_source=synthetic \
        "codecs=$HOST_CODECS" shape.layers=32 shape.kv_heads=8 shape.tokens=8192 \
        shape.head_dim=128 repeats=3 warmup=1 progress=false write_timing="$HARDWARE" \
        out_dir="$OUT" overwrite=true 2>&1 | tee "$OUT/bench-host-coder.log"
    host_rc=${PIPESTATUS[0]}
else
    host_rc=0
fi
ls -R "$OUT"
echo "gpu tests exit $tests_rc, emulator exit $emulate_rc, bench exit $bench_rc," \
    "host-coder bench exit $host_rc"
[ "$tests_rc" = 0 ] && [ "$emulate_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$host_rc" = 0 ]
