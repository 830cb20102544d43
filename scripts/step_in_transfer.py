"""The decode step in-process against inside an emulated transfer, on one host in the same
minutes (issue 44, item 1): two rounds of a 32-step in-process probe (StepProbe) and an
emulated transfer of int8 and lynx twice each (SmolLM2 real decode, the shipped profiles,
token bucket), then a last probe; prints each step (ms) and the whole as JSON.

    python scripts/step_in_transfer.py [context_tokens=1536] [rate_gbps=0.5] [overrides...]

Set KVSIM_OUTPUT_ROOT to keep the emulator's run directories out of the repository.
"""
import json
import sys

from kvsim.calibrate.host_probe import StepProbe
from kvsim.core.compose import compose
from kvsim.core.paths import DATA_DIR
from kvsim.fidelity.runner import find_profiles, scenario_overrides
from kvsim.model.presets import load_model_preset
from kvsim.transport.config import EmulateConfig
from kvsim.transport.emulate import emulate

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 1536
rate = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
extra = sys.argv[3:]
model = load_model_preset("smollm2-135m")
probe = StepProbe(model, steps=32)
profiles = find_profiles(DATA_DIR / "profiles", "local-smollm2-135m", ["token_bucket"])
out = {"ctx": ctx, "rate": rate, "extra": extra, "probe_ms": [], "emulated": []}
for _ in range(2):
    out["probe_ms"].append(1e3 * probe.step_s(ctx))
    print("probe", out["probe_ms"][-1], flush=True)
    common = scenario_overrides("smollm2-135m", "token_bucket", rate, ["int8", "lynx"] * 2,
                                ["workload=emulated", f"workload.context_tokens={ctx}",
                                 "workload.output_tokens=64"], [32, 64], profiles) + extra
    ecfg, _ = compose("transport", common, EmulateConfig)
    rows = emulate(ecfg)
    for r in rows:
        out["emulated"].append({"codec": r["codec"], "tpot_ms": 1e3 * r["tpot_s"]})
        print(r["codec"], out["emulated"][-1], flush=True)
out["probe_ms"].append(1e3 * probe.step_s(ctx))
print(json.dumps(out))
