"""`kvsim validate measured_from=<report>`: a saved validation's scenarios simulated again
against the measurements it saved, without emulating anything."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from kvsim.cli.main import main
from kvsim.core.paths import DATA_DIR
from kvsim.core.profiles import profile_path
from kvsim.fidelity.errors import SCENARIO_KEYS

SHIPPED = DATA_DIR / "fidelity" / "2026-11-25"
_KEY = (*SCENARIO_KEYS, "codec", "metric")


def _key(row: dict) -> tuple:
    return tuple(row.get(k) for k in _KEY)


@pytest.fixture
def no_emulation(monkeypatch):
    """Any emulated transfer fails the test: measured_from must only simulate."""
    import kvsim.transport.emulate as emulate_cmd

    def refuse(*_a, **_k):
        raise AssertionError("measured_from ran the emulator")

    monkeypatch.setattr(emulate_cmd, "emulate", refuse)


def test_the_shipped_run_simulated_again_meets_the_targets(tmp_path, no_emulation):
    run_dir = tmp_path / "run"
    rc = main(["validate", f"measured_from={SHIPPED / 'report.json'}", "fail_on_target=true",
               f"hydra.run.dir={run_dir}"])
    assert rc == 0
    saved = json.loads((SHIPPED / "report.json").read_text())
    doc = json.loads((run_dir / "fidelity.json").read_text())
    s = doc["summary"]
    # every saved comparison again, its measurement carried over as saved
    assert sorted(map(_key, doc["rows"])) == sorted(map(_key, saved["rows"]))
    old = {_key(r): r for r in saved["rows"]}
    for r in doc["rows"]:
        assert r["measured_s"] == old[_key(r)]["measured_s"]
        assert r["error_pct"] == pytest.approx(
            100 * (r["simulated_s"] - r["measured_s"]) / r["measured_s"], rel=1e-12)
    # the targets, met by this simulator against the real transfers of 2026-11-25
    assert s["compared"] == 304 and s["missing"] == 0
    assert s["mean_abs_pct_error"] <= 5.0 and s["max_abs_pct_error"] <= 10.0
    assert s["measured_from"] == str(SHIPPED / "report.json")
    assert s["measured_provenance"]["git_commit"] == saved["provenance"]["git_commit"]
    # the profiles beside the report were used (a calibrate=true run's copy)
    assert s["profiles"]["hardware"].startswith(str(SHIPPED / "profiles"))
    assert len(list((run_dir / "scenarios").glob("*.json"))) == 14  # 12 single + 2 multi


@pytest.mark.parametrize("run, pairs, mean_pct", [("2026-11-28-prefix", 9, 1.0),
                                                   ("2026-11-28-prefix-trace", 11, 2.0)])
def test_the_shipped_prefix_reuse_runs_simulated_again(tmp_path, no_emulation, run, pairs,
                                                       mean_pct):
    """data/fidelity/2026-11-28-prefix (hand-made conversations) and -prefix-trace (a
    Mooncake window's conversations, scaled): the prefix-reuse case measured with the
    shipped profiles; simulated again, the same 14 comparisons and the per-request pairs,
    within the targets, the engines reusing the same tokens (else refused)."""
    shipped = DATA_DIR / "fidelity" / run
    run_dir = tmp_path / "run"
    assert main(["validate", f"measured_from={shipped}", "fail_on_target=true",
                 f"hydra.run.dir={run_dir}"]) == 0
    saved = json.loads((shipped / "report.json").read_text())
    doc = json.loads((run_dir / "fidelity.json").read_text())
    assert sorted(map(_key, doc["rows"])) == sorted(map(_key, saved["rows"]))
    assert {r["case"] for r in doc["rows"]} == {"prefix"}
    s = doc["summary"]
    assert s["compared"] == 14 and s["mean_abs_pct_error"] <= mean_pct
    assert [d["pairs"] for d in doc["distributions"]] == [pairs] * 6
    assert {r["metric"] for r in doc["rows"]} >= {"ttft_pe", "ttft_c_p99", "tpot_p50"}


def _one_scenario_copy(tmp_path: Path, scale_first: float = 1.0) -> Path:
    """The shipped report cut to one single-request scenario (token bucket, 0.1 Gbps, 1024
    tokens), alone in a directory (no profiles beside it); the first row's measurement
    scaled by scale_first."""
    doc = json.loads((SHIPPED / "report.json").read_text())
    doc["rows"] = [r for r in doc["rows"] if r["case"] == "single" and
                   r["emulation"] == "token_bucket" and r["bandwidth_gbps"] == 0.1 and
                   r["context_tokens"] == 1024]
    doc["rows"][0]["measured_s"] *= scale_first
    path = tmp_path / "saved" / "report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc))
    return path


def test_errors_are_recomputed_against_the_saved_measurements(tmp_path, no_emulation):
    plain, edited = _one_scenario_copy(tmp_path / "a"), _one_scenario_copy(tmp_path / "b", 2.0)
    rows = {}
    for name, path in (("plain", plain), ("edited", edited)):
        run_dir = tmp_path / name
        assert main(["validate", f"measured_from={path.parent}",  # the directory works too
                     f"profile_dir={SHIPPED / 'profiles'}", f"hydra.run.dir={run_dir}"]) == 0
        rows[name] = json.loads((run_dir / "fidelity.json").read_text())["rows"]
    assert len(rows["plain"]) == len(rows["edited"]) == 4 * 6  # 4 codecs x 6 metrics
    first, *rest = zip(rows["plain"], rows["edited"], strict=True)
    a, b = first
    assert b["measured_s"] == 2 * a["measured_s"] and b["simulated_s"] == a["simulated_s"]
    assert b["error_pct"] == pytest.approx(
        100 * (a["simulated_s"] - 2 * a["measured_s"]) / (2 * a["measured_s"]))
    assert all(x == y for x, y in rest)  # the rest: the same simulation, the same errors
    # the simulator's own keys are this run's
    assert all(math.isfinite(r["tpot_simulated_s"]) for r in rows["plain"])
    # and so are its values: other profiles (the 2026-11-23 calibration) simulate other
    # times against the same measurements
    other = tmp_path / "other"
    assert main(["validate", f"measured_from={plain}", f"profile_dir={DATA_DIR / 'profiles'}",
                 f"hydra.run.dir={other}"]) == 0
    moved = json.loads((other / "fidelity.json").read_text())["rows"]
    for a, c in zip(rows["plain"], moved, strict=True):
        assert c["measured_s"] == a["measured_s"] and c["simulated_s"] != a["simulated_s"]
        assert c["error_pct"] == pytest.approx(
            100 * (c["simulated_s"] - c["measured_s"]) / c["measured_s"])


def test_a_run_that_calibrated_needs_its_profiles(tmp_path, capsys, no_emulation):
    path = _one_scenario_copy(tmp_path)
    assert main(["validate", f"measured_from={path}", f"hydra.run.dir={tmp_path / 'run'}"]) != 0
    assert "give profile_dir=" in capsys.readouterr().err


@pytest.mark.parametrize("content, overrides, message", [
    (None, [], "no such report"),
    ("{not json", [], "is not JSON"),
    (json.dumps({"command": "sim", "rows": [], "config": {}}), [],
     "is not a `kvsim validate` report"),
    (json.dumps({"command": "validate", "rows": [], "config": {}}), [], "no comparison rows"),
    ("saved", ["ks=[16]"], "no measurement of k=[16]"),
    ("saved", ["calibrate=true"], "calibrate=true and measured_from= together"),
])
def test_measured_from_refuses_what_it_cannot_use(tmp_path, capsys, no_emulation, content,
                                                  overrides, message):
    path = tmp_path / "report.json"
    if content == "saved":
        shutil.copy(SHIPPED / "report.json", path)
    elif content is not None:
        path.write_text(content)
    rc = main(["validate", f"measured_from={path}", *overrides,
               f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows.__setitem__(3, {"case": "single", "codec": "int8"}), "rows [3]"),
    (lambda rows: rows[5].pop("bandwidth_gbps"), "rows [5]"),
    (lambda rows: rows[-1].pop("rate_per_s"), "rows [303]"),
    (lambda rows: rows[7].update(metric=["ttft"]), "rows [7]"),
    (lambda rows: rows.append(dict(rows[0], measured_s=99.0)), "rows 0 and 304"),
    (lambda rows: [r.update(context_tokens=2048) for r in rows if r["case"] == "multi"],
     "its config's multi case is token_bucket at 0.2 Gbps with 1024"),
])
def test_rows_that_are_not_comparisons_are_refused(tmp_path, capsys, no_emulation, edit,
                                                   message):
    doc = json.loads((SHIPPED / "report.json").read_text())
    edit(doc["rows"])
    path = tmp_path / "report.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", f"measured_from={path}", f"profile_dir={SHIPPED / 'profiles'}",
                 f"hydra.run.dir={tmp_path / 'run'}"]) != 0
    assert message in capsys.readouterr().err


def test_the_simulator_gets_the_measured_runs_overrides(tmp_path, monkeypatch, no_emulation):
    """A quick validation whose "emulator" is the simulator itself (and whose decode-step
    probe is faked), then measured_from= on its run directory: every scenario is simulated
    with the same overrides (but the run directory), to the same values, the probe applied
    again; this holds whatever the simulator computes."""
    from kvsim.calibrate import host_probe
    from kvsim.fidelity import runner

    calls: dict[str, list[list[str]]] = {"measured": [], "again": []}

    def pair(common, sim, host=None):
        calls["measured"].append(sim)
        rows = runner.simulate(sim)
        return rows, rows

    # the shipped profile's own host probe (ms at each context of its step curve)
    host = json.loads(profile_path("hardware", "local-smollm2-135m").read_text())["host"]
    probed = dict(zip(host["decode_step_probe"]["context_tokens"],
                      host["decode_step_probe"]["s"], strict=True))

    class Probe:
        def __init__(self, model, steps, threads=1):
            pass

        def step_s(self, context_tokens):
            return 0.05  # s: a decode step unlike the calibrated one

        def steps_s(self, contexts):  # the host's: 3% faster than the profile's host
            return [0.97 * probed[c] for c in contexts]

    monkeypatch.setattr(runner, "run_pair", pair)
    # validate probes in a process of its own (SubprocessStepProbe), the host and each
    # scenario's step alike: never in the emulating process
    monkeypatch.setattr(host_probe, "StepProbe", None)
    monkeypatch.setattr(host_probe, "SubprocessStepProbe", Probe)
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["validate", "grid=quick", "step_probe_steps=24", "samples=2",
                 f"hydra.run.dir={first}"]) == 0
    simulate = runner.simulate

    def spy(sim):
        calls["again"].append(sim)
        return simulate(sim)

    monkeypatch.setattr(runner, "simulate", spy)
    assert main(["validate", f"measured_from={first}", "samples=2",
                 f"hydra.run.dir={again}"]) == 0

    def plain(sims: list[list[str]], run_dir: Path) -> list[list[str]]:
        return [[o.replace(str(run_dir), "<run>") for o in sim] for sim in sims]

    assert len(calls["measured"]) == 2  # the quick grid: one single scenario, one multi rate
    assert plain(calls["again"], again) == plain(calls["measured"], first)
    assert any(o.startswith(f"hardware.profile={again}/profiles-probed/")
               for o in calls["again"][0])  # the saved probe, applied again
    rows = [json.loads((d / "fidelity.json").read_text())["rows"] for d in (first, again)]
    # the host check's record on every row (the line through probes 3% below the profile's
    # own, within the 10% tolerance)
    assert {r["hardware_drift"] for r in rows[0]} == {"within"}
    assert {(round(r["hardware_drift_factor"], 6), round(r["hardware_drift_factor_long"], 6))
            for r in rows[0]} == {(0.97, 0.97)}
    assert [(_key(r), r["simulated_s"], r.get("step_scale")) for r in rows[0]] == \
        [(_key(r), r["simulated_s"], r.get("step_scale")) for r in rows[1]]


def test_a_re_simulation_is_not_taken_for_a_measured_run(tmp_path, capsys, no_emulation):
    doc = json.loads((SHIPPED / "report.json").read_text())
    doc["config"]["measured_from"] = "somewhere/report.json"
    path = tmp_path / "report.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", f"measured_from={path}", f"hydra.run.dir={tmp_path / 'run'}"]) != 0
    assert "is itself a re-simulation" in capsys.readouterr().err


def test_ks_are_bounded_by_the_saved_runs_output_tokens(tmp_path, no_emulation):
    """A saved run that decoded 128 tokens and compared TT128T: ks=[128] is its to give,
    whatever this command's own output_tokens (64 by default)."""
    doc = json.loads((SHIPPED / "report.json").read_text())
    doc["config"].update(output_tokens=128, ks=[32, 64, 128])
    doc["rows"] = [r for r in doc["rows"] if r["case"] == "multi"] + [
        dict(r, metric=r["metric"].replace("tt64t", "tt128t"))
        for r in doc["rows"] if r["case"] == "single" and r["emulation"] == "token_bucket"
        and r["bandwidth_gbps"] == 0.1 and r["context_tokens"] == 1024
        and r["metric"] in ("ttft", "ttft_c", "tt64t", "tt64t_c")]
    path = tmp_path / "saved" / "report.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc))
    run_dir = tmp_path / "run"
    assert main(["validate", f"measured_from={path}", "ks=[128]",
                 f"profile_dir={SHIPPED / 'profiles'}", f"hydra.run.dir={run_dir}"]) == 0
    rows = json.loads((run_dir / "fidelity.json").read_text())["rows"]
    single = [r for r in rows if r["case"] == "single"]
    assert {r["metric"] for r in single} == {"ttft", "tt128t", "ttft_c", "tt128t_c"}
    # the simulator decoded 128 tokens: TT128T lies past TT64T's measured time
    t64 = {r["codec"]: r["measured_s"] for r in single if r["metric"] == "tt128t"}
    assert all(r["simulated_s"] > 1.5 * t64[r["codec"]] for r in single
               if r["metric"] == "tt128t")



def test_per_request_comparisons_are_kept_and_recomputed(tmp_path, monkeypatch, no_emulation):
    """The multi-request case compares the engines request by request (MAPE, Pearson r, KS)
    and keeps the measured requests in the report, so measured_from= recomputes the same
    statistics against them. Here the "emulator" is the simulator itself, its requests read
    from the simulator's own request log: every request agrees."""
    import pandas as pd

    from kvsim.fidelity import runner

    def pair(common, sim, host=None):
        rows = runner.simulate(sim)
        logs = [o.split("=", 1)[1] for o in sim if o.startswith("requests_path=")]
        if not logs:  # single-request scenarios: no per-request comparison
            return rows, rows
        log = pd.read_csv(logs[0])
        measured = []
        for r in rows:  # request i measured 0.1 * (i + 1) s late, listed last first
            mine = log[log["codec"] == r["codec"]]
            measured.append({**r, "per_request": [
                {"seq": int(q["request"]), "ttft_s": float(q["ttft_s"]) + late(q),
                 "ttft_committed_s": float(q["ttft_committed_s"]) + late(q)}
                for _, q in mine.iterrows()][::-1]})
            expected[r["codec"]] = 100 * sum(
                late(q) / (float(q["ttft_s"]) + late(q)) for _, q in mine.iterrows()) / len(mine)
        return measured, rows

    def late(q) -> float:
        return 0.1 * (int(q["request"]) + 1)

    expected: dict[str, float] = {}

    monkeypatch.setattr(runner, "run_pair", pair)
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["validate", "grid=quick", "samples=2", "drift.action=off",
                 f"hydra.run.dir={first}"]) == 0
    saved = json.loads((first / "report.json").read_text())["distributions"]
    assert {(d["codec"], d["metric"]) for d in saved} == {
        (c, m) for c in ("int8", "lynx") for m in ("ttft", "ttft_c")}
    for d in saved:  # paired by arrival number, not by list position
        assert d["pairs"] == 6 and d["seq"] == list(range(6))
        if d["metric"] == "ttft":
            assert d["mape_pct"] == pytest.approx(expected[d["codec"]])
    assert main(["validate", f"measured_from={first}", "samples=2",
                 f"hydra.run.dir={again}"]) == 0
    redone = json.loads((again / "fidelity.json").read_text())["distributions"]
    assert [(d["codec"], d["metric"], d["measured_s"], d["mape_pct"]) for d in redone] == \
        [(d["codec"], d["metric"], d["measured_s"], d["mape_pct"]) for d in saved]


def test_the_step_level_taken_from_the_scenario(tmp_path, monkeypatch, no_emulation):
    """step_from_scenario=true: a quick validation whose "emulator" is the simulator with a
    50 ms decode step: the compared simulation is scaled to that step at the scenario's mid
    context, the rows keep the calibrated step (its own error) and say where the level came
    from; measured_from= gives every value again."""
    from kvsim.fidelity import runner

    def emulated(common, host=None):
        sim = ["scenario=none", *[o for o in common if not o.startswith("transport.")],
               "deserializer=on_arrival", "samples=2"]
        return [{**r, "tpot_s": 0.03} for r in runner.simulate(sim)]

    monkeypatch.setattr(runner, "emulate_rows", emulated)
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["validate", "grid=quick", "step_from_scenario=true", "samples=2",
                 "drift.action=off", f"hydra.run.dir={first}"]) == 0
    assert main(["validate", f"measured_from={first}", "samples=2",
                 f"hydra.run.dir={again}"]) == 0
    rows = [json.loads((d / "fidelity.json").read_text())["rows"] for d in (first, again)]
    single = [r for r in rows[0] if r["case"] == "single"]
    assert single and {r["step_level_from"] for r in single} == {"scenario"}
    assert {r["step_probe_s"] for r in single} == {0.03}
    assert {r["step_probe_context_tokens"] for r in single} == {1024 + 64 // 2}
    # the calibrated step (SmolLM2's shipped profile: 40-70 ms on this host), not 30 ms
    assert all(r["tpot_simulated_s"] > 0.035 for r in single)
    assert all(r["step_scale"] < 0.9 for r in single)
    # the codecs' work was scaled with the step: the simulator read the scenario's copy
    from kvsim.scenario.codec_timing import load_codec_timing
    r = single[0]
    scenario = f"single-{r['emulation']}-{r['bandwidth_gbps']:g}gbps-{r['context_tokens']}"
    copy = first / "profiles-probed" / f"{scenario}-codec-timing.json"
    calibrated = json.loads(copy.read_text())["step_level"]["from_profile"]
    ours, theirs = (load_codec_timing("x", str(p)).lookup("int8", "uniform")
                    for p in (copy, calibrated))
    assert ours.encode_s(1e6) == pytest.approx(theirs.encode_s(1e6) * r["step_scale"])
    sims = json.loads((first / "scenarios" / f"{scenario}.json").read_text())["simulated"]
    assert {s["link_profile"] for s in sims} == \
        {str(first / "profiles-probed" / f"{scenario}-link.json")}
    fields = ("simulated_s", "tpot_simulated_s", "step_scale")
    assert [(_key(r), *(r.get(f) for f in fields)) for r in rows[0]] == \
        [(_key(r), *(r.get(f) for f in fields)) for r in rows[1]]
    with pytest.raises(ValueError, match="choose one"):
        from kvsim.fidelity.validation import Config
        Config(model=None, step_probe_steps=24, step_from_scenario=True)


def _shipped_simulated_again(name: str, compared: int, run_dir: Path) -> dict:
    """The summary of `kvsim validate measured_from=data/fidelity/<name>` in run_dir, checked
    against the shipped report: the same comparisons, its mean and worst |error| again, on
    the profiles it shipped."""
    shipped = DATA_DIR / "fidelity" / name
    saved = json.loads((shipped / "report.json").read_text())
    assert main(["validate", f"measured_from={shipped}", f"hydra.run.dir={run_dir}"]) == 0
    s = json.loads((run_dir / "fidelity.json").read_text())["summary"]
    assert s["compared"] == saved["fidelity"]["compared"] == compared
    assert s["mean_abs_pct_error"] == pytest.approx(saved["mean_abs_pct_error"], abs=0.05)
    assert s["max_abs_pct_error"] == pytest.approx(saved["max_abs_pct_error"], abs=0.5)
    assert s["profiles"]["hardware"].startswith(str(shipped / "profiles"))
    return s


def _shipped_on_own_step(name: str, compared: int, run_dir: Path) -> dict:
    """The summary of `kvsim validate measured_from=data/fidelity/<name>
    step_from_scenario=true` in run_dir: every comparison, each scenario's own step level."""
    assert main(["validate", f"measured_from={DATA_DIR / 'fidelity' / name}",
                 "step_from_scenario=true", f"hydra.run.dir={run_dir}"]) == 0
    own = json.loads((run_dir / "fidelity.json").read_text())["summary"]
    assert own["compared"] == compared and own["step_level"]["from_scenario"]
    return own


@pytest.mark.parametrize("name", ["2026-11-28-full", "2026-11-29-full", "2026-11-30-full-tc-host"])
def test_the_shipped_calibrated_full_grid_runs_simulated_again(name, tmp_path, no_emulation):
    """data/fidelity/<name> (calibrate=true, the full grid): this simulator gives its figures
    again from the measurements and profiles it saved."""
    _shipped_simulated_again(name, 324, tmp_path)


def test_the_shipped_slow_day_run_simulated_again_with_its_handshake(tmp_path, no_emulation):
    """data/fidelity/2026-12-06-full-slow-host (calibrate=true on a slow day, the links'
    profiles with the transfer's handshake, 4.28 / 3.07 ms): its figures again, the
    handshake in its rows, and the step level it did not hold."""
    s = _shipped_simulated_again("2026-12-06-full-slow-host", 324, tmp_path)
    assert not s["step_level"]["trusted"] and s["step_level"]["step_mean_abs_pct"] > 5.0
    for link, handshake_s in (("token_bucket", 0.00428), ("tc", 0.00307)):
        doc = json.loads((tmp_path / "scenarios" / f"single-{link}-1gbps-2048.json").read_text())
        assert {round(r["handshake_s"], 5) for r in doc["simulated"]} == {handshake_s}


def test_the_shipped_paced_run_simulated_again_with_its_paces(tmp_path, no_emulation):
    """data/fidelity/2026-12-06-full-paced (calibrate=true; the links' profiles with the
    worker's and the encoder's pace): its figures again, its paces loaded, and the step level
    it did not hold; on each scenario's step level (the host's other work scaled with it)
    2.26% / 14.94%, as its README and the Fidelity page give them."""
    from kvsim.scenario.link_profile import load_link_profile

    s = _shipped_simulated_again("2026-12-06-full-paced", 324, tmp_path / "as-run")
    assert not s["step_level"]["trusted"] and s["step_level"]["step_mean_abs_pct"] > 5.0
    own = _shipped_on_own_step("2026-12-06-full-paced", 324, tmp_path / "own-step")
    assert own["mean_abs_pct_error"] == pytest.approx(2.26, abs=0.05)
    assert own["max_abs_pct_error"] == pytest.approx(14.94, abs=0.5)
    for name, alone, encoder in (("token-bucket", 0.670, [1.000, 1.058]),
                                 ("tc", 0.597, [0.899, 1.910])):
        prof = load_link_profile(str(DATA_DIR / "fidelity" / "2026-12-06-full-paced" /
                                     "profiles" / "link" / f"local-smollm2-135m-{name}.json"))
        assert round(prof.worker_pace["alone"], 3) == alone
        assert [round(x, 3) for x in prof.encoder_pace["ratio"]] == encoder


@pytest.mark.parametrize(("name", "compared", "mean_pct", "worst_pct", "extra_s", "tc_busy"), [
    ("2026-12-06-heldout", 108, 1.51, 5.98, 0.0084, 4.6),
    ("2026-12-06-full-2", 324, 2.24, 27.26, 0.0033, 4.9),
    ("2026-12-06-full-3", 324, 1.91, 15.57, 0.0023, 3.15),
    ("2026-12-06-heldout-2", 108, 1.92, 7.78, 0.0013, 2.7),
    ("2026-12-06-heldout-busy", 108, 4.08, 20.27, 0.0122, 3.05)])
def test_the_later_paced_runs_simulated_again_on_each_scenarios_step(
        name, compared, mean_pct, worst_pct, extra_s, tc_busy, tmp_path, no_emulation):
    """data/fidelity/<name> (calibrate=true at 5a26a23, full-3 at 1955ad2, heldout-2 at
    b5d7a5b; the host sped up during the held-out run and full-3's, slowed down during
    full-2's, and its steps moved 5.5% during heldout-2's; heldout-busy beside a neighbour
    keeping one CPU busy): its figures again
    with the step level it did not hold and with each scenario's own step (the host's other
    work scaled with it), as its README gives them, with its first step's extra (pooled over
    both calibration transfers) and its `tc` draft fit."""
    from kvsim.scenario.link_profile import load_link_profile

    s = _shipped_simulated_again(name, compared, tmp_path / "as-run")
    assert not s["step_level"]["trusted"] and s["step_level"]["step_mean_abs_pct"] > 5.0
    own = _shipped_on_own_step(name, compared, tmp_path / "own-step")
    assert own["mean_abs_pct_error"] == pytest.approx(mean_pct, abs=0.05)
    assert own["max_abs_pct_error"] == pytest.approx(worst_pct, abs=0.5)
    profiles = DATA_DIR / "fidelity" / name / "profiles"
    hw = json.loads((profiles / "hardware" / "local-smollm2-135m.json").read_text())
    assert {round(x, 4) for x in hw["first_step_extra"]["s"]} == {extra_s}
    tc = load_link_profile(str(profiles / "link" / "local-smollm2-135m-tc.json"))
    assert tc.draft_step["busy_ratio"] == pytest.approx(tc_busy)


@pytest.mark.parametrize(("name", "compared", "mean_pct", "worst_pct", "alone_jobs"), [
    ("2026-12-07-full", 324, 1.03, 6.57, {"token-bucket": 24, "tc": 16}),
    ("2026-12-07-heldout", 108, 1.05, 14.16, {"token-bucket": 17, "tc": 0}),
    ("2026-12-07-full-busy", 324, 1.39, 23.73, {"token-bucket": 39, "tc": 33})])
def test_the_shipped_runs_with_the_verification_pass_timed_beside_a_step(
        name, compared, mean_pct, worst_pct, alone_jobs, tmp_path, no_emulation):
    """data/fidelity/<name> (calibrate=true at 13eee8a, full-busy at 5cb5b71 beside a
    neighbour spinning on one CPU; the step level held in each): its
    figures again, as run and with each scenario's own step, as its README gives them; its
    verification pass as measured (before the receiver's step ratio scaled it) is its ratio
    to a first step beside it times the in-process fitted step + first-step extra, and each
    link's worker pace says how many jobs after both spans its `alone` is the median of (0:
    fitted with the rest)."""
    from kvsim.scenario.link_profile import load_link_profile

    s = _shipped_simulated_again(name, compared, tmp_path / "as-run")
    assert s["step_level"]["trusted"] and s["step_level"]["step_mean_abs_pct"] < 5.0
    own = _shipped_on_own_step(name, compared, tmp_path / "own-step")
    assert own["mean_abs_pct_error"] == pytest.approx(mean_pct, abs=0.05)
    assert own["max_abs_pct_error"] == pytest.approx(worst_pct, abs=0.5)
    profiles = DATA_DIR / "fidelity" / name / "profiles"
    hw = json.loads((profiles / "hardware" / "local-smollm2-135m.json").read_text())
    verify, tpot = hw["verify"], hw["tpot_inprocess"]
    extra = hw["first_step_extra_inprocess"]["s"]
    for i, ratios in enumerate(verify["ratio_to_first_step"]):
        assert len(ratios) == len(verify["drafted_tokens"]) and min(ratios) > 1.0
        assert verify["measured"][i] == pytest.approx([(tpot["s"][i] + extra[i]) * r
                                                       for r in ratios], rel=1e-9)
    for stem, jobs in alone_jobs.items():
        pace = load_link_profile(str(profiles / "link" / f"local-smollm2-135m-{stem}.json")
                                 ).worker_pace
        assert pace["alone_jobs"] == jobs


@pytest.mark.parametrize(("name", "compared", "run_sets", "mean_pct", "worst_pct", "fits"), [
    ("2026-12-06-heldout-3", 108, 40, 2.09, 9.89,
     {"token-bucket": (2.95, 9), "tc": (2.65, 11)}),
    ("2026-12-06-full-4", 324, 156, 1.28, 10.69,
     {"token-bucket": (2.25, 14), "tc": (2.30, 15)}),
    ("2026-12-06-heldout-4", 108, 40, 1.61, 7.39,
     {"token-bucket": (2.75, 15), "tc": (2.80, 15)})])
def test_the_shipped_runs_with_the_draft_fit_on_every_step(name, compared, run_sets, mean_pct,
                                                           worst_pct, fits, tmp_path,
                                                           no_emulation):
    """data/fidelity/<name> (calibrate=true, heldout-3 at 00f9ca0, full-4 at f966652,
    heldout-4 at b082159 with the CPUs held awake; the step level held in each): its figures
    again, as run and with each scenario's own step, as its README gives them; each link's
    draft fit matched every calibration request's draft steps (more step ends than
    requests), and fitted again on the windows it kept, gives the profile's values."""
    from kvsim.calibrate.draft_ingest import DraftWindow
    from kvsim.calibrate.draft_ingest import fit as draft_fit
    from kvsim.scenario.link_profile import load_link_profile

    s = _shipped_simulated_again(name, compared, tmp_path / "as-run")
    assert s["step_level"]["trusted"] and s["step_level"]["step_mean_abs_pct"] < 5.0
    # the noise floor: over the single-request comparisons (the 36 multi-request ones have
    # no repeated runs), their distinct sets of runs (a plain codec's drafted and committed
    # times are one)
    assert s["noise_floor"]["compared"] == compared - 36
    assert s["noise_floor"]["run_sets"] == run_sets
    own = _shipped_on_own_step(name, compared, tmp_path / "own-step")
    assert own["mean_abs_pct_error"] == pytest.approx(mean_pct, abs=0.05)
    assert own["max_abs_pct_error"] == pytest.approx(worst_pct, abs=0.5)
    profiles = DATA_DIR / "fidelity" / name / "profiles"
    hw = json.loads((profiles / "hardware" / "local-smollm2-135m.json").read_text())
    extra_s = float(hw["first_step_extra"]["s"][0])
    for stem, (ratio, steps) in fits.items():
        draft = load_link_profile(str(profiles / "link" / f"local-smollm2-135m-{stem}.json")
                                  ).draft_step
        assert draft["busy_ratio"] == pytest.approx(ratio)
        assert draft["fit"]["requests"] == 6 and draft["fit"]["steps_matched"] == steps
        windows = [DraftWindow.from_doc(w) for w in draft["fit"]["windows"]]
        again = draft_fit(windows, extra_s)
        assert (again.busy_ratio, again.ingest_s_per_byte, again.steps_matched) == \
            (draft["busy_ratio"], draft["ingest_s_per_byte"], steps)


def test_the_shipped_run_keeps_its_calibration_transfers(monkeypatch):
    """data/fidelity/2026-12-06-full-3 ships its calibration transfers' rows: the worker pace
    of its `tc` profile is fitted on them again (as the calibration fitted it then,
    worker_pace.pace_entry with one joint least squares: its profile predates `alone` from
    the jobs after both spans) to the entry it holds; today's fit takes `alone` from its 23
    jobs after both spans (0.714 against the joint 0.809); and its `tc` lynx jobs at 0.3 Gbps
    took 1.18x the codec timing's (its README)."""
    from kvsim.calibrate import worker_pace
    from kvsim.model.presets import load_model_preset
    from kvsim.scenario.codec_timing import load_codec_timing

    profiles = DATA_DIR / "fidelity" / "2026-12-06-full-3" / "profiles"
    rows = [json.loads(line) for line in
            (profiles / "transfers" / "local-smollm2-135m.jsonl").read_text().splitlines()]
    assert len(rows) == 33 and {r["status"] for r in rows} == {"done"}
    assert {r["link_emulation"] for r in rows} == {"token_bucket", "tc"}
    table = load_codec_timing("x", str(profiles / "codec_timing" / "local-smollm2-135m.json"))
    model = load_model_preset("smollm2-135m")

    def timing_of(row: dict):
        return table.lookup(str(row["codec"]), str(row["codec_name"]))

    def layer_bytes(tokens: int) -> float:
        return model.kv_bytes_bf16(tokens) / model.layers

    tc_rows = [r for r in rows if r["link_emulation"] == "tc"]
    tc = json.loads((profiles / "link" / "local-smollm2-135m-tc.json").read_text())
    today = worker_pace.pace_entry(tc_rows, timing_of, layer_bytes, model.name)
    assert today["alone_jobs"] == 23 and today["alone"] == pytest.approx(0.714, abs=5e-4)
    monkeypatch.setattr(worker_pace, "MIN_ALONE_JOBS", 10**6)  # the joint fit, as then
    again = worker_pace.pace_entry(tc_rows, timing_of, layer_bytes, model.name)
    assert again is not None and again["alone_jobs"] == 0
    assert {k: again[k] for k in ("jobs", "requests", "rates_gbps")} == \
        {k: tc["worker_pace"][k] for k in ("jobs", "requests", "rates_gbps")}
    for k in ("alone", "encoder", "ingest", "rms_s"):
        assert again[k] == pytest.approx(tc["worker_pace"][k]), k
    at = worker_pace.job_samples([r for r in tc_rows if r["bandwidth_gbps"] == 0.3],
                                 timing_of, layer_bytes)
    assert at.job_s.sum() / at.base_s.sum() == pytest.approx(1.18, abs=0.005)


def test_the_shipped_default_run_simulated_again_with_its_probe(tmp_path, no_emulation):
    """data/fidelity/2026-11-30-default-tc-host (`kvsim validate`: the shipped profiles,
    copied beside it, used as they were after the probe before the comparisons): its figures
    again, and the step level it held."""
    s = _shipped_simulated_again("2026-11-30-default-tc-host", 324, tmp_path)
    assert s["step_level"]["trusted"] and not s["step_level"]["from_scenario"]


def test_the_shipped_default_run_with_the_profiles_of_2026_12_07(tmp_path, no_emulation):
    """data/fidelity/2026-12-07-default (`kvsim validate` four hours after the shipped
    profiles' calibration, which it copies beside it: those of 2026-12-07-full): its figures
    again, as run and with each scenario's own step, as its README gives them, on profiles
    that carry the worker's pace, the same files as data/profiles; and the same
    measurements on the profiles shipped before them (2026-11-29-night's), as the README
    gives them."""
    from kvsim.core.profiles import PROFILE_DIR

    shipped = DATA_DIR / "fidelity" / "2026-12-07-default" / "profiles"
    files = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(PROFILE_DIR) for p in PROFILE_DIR.rglob("*")
                           if p.is_file())
    for path in files:
        assert (shipped / path).read_bytes() == (PROFILE_DIR / path).read_bytes()
    tc = json.loads((shipped / "link" / "local-smollm2-135m-tc.json").read_text())
    assert tc["worker_pace"]["alone_jobs"] == 16
    s = _shipped_simulated_again("2026-12-07-default", 324, tmp_path / "as-run")
    assert s["step_level"]["trusted"] and not s["step_level"]["from_scenario"]
    own = _shipped_on_own_step("2026-12-07-default", 324, tmp_path / "own-step")
    assert own["mean_abs_pct_error"] == pytest.approx(1.39, abs=0.05)
    assert own["max_abs_pct_error"] == pytest.approx(8.62, abs=0.5)
    assert own["noise_floor"]["p"] == pytest.approx(0.159, abs=0.005)
    old = tmp_path / "old-profiles"
    assert main(["validate", f"measured_from={DATA_DIR / 'fidelity' / '2026-12-07-default'}",
                 f"profile_dir={DATA_DIR / 'fidelity' / '2026-11-29-night' / 'profiles'}",
                 "step_from_scenario=true", f"hydra.run.dir={old}"]) == 0
    before = json.loads((old / "fidelity.json").read_text())["summary"]
    assert "worker_pace" not in json.loads(
        (DATA_DIR / "fidelity" / "2026-11-29-night" / "profiles" / "link" /
         "local-smollm2-135m-tc.json").read_text())
    assert before["mean_abs_pct_error"] == pytest.approx(4.00, abs=0.05)
    assert before["max_abs_pct_error"] == pytest.approx(51.01, abs=0.5)


def test_the_shipped_heldout_run_beside_a_neighbour_simulated_again(tmp_path, no_emulation,
                                                                   capsys):
    """data/fidelity/2026-11-29-heldout-busy (a memory-copy loop on one of the 2 CPUs
    throughout): its figures again, and the neighbour it measured carried with them."""
    s = _shipped_simulated_again("2026-11-29-heldout-busy", 108, tmp_path)
    load = s["measured_host_load"]
    assert load["shared"] and 0.9 < load["comparisons"]["background_cores"] <= 1.05
    assert 0.9 < load["calibration"]["background_cores"] <= 1.05
    assert "a shared host" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["2026-11-28-heldout", "2026-11-29-heldout"])
def test_the_shipped_calibrated_heldout_runs_simulated_again(name, tmp_path, no_emulation):
    """data/fidelity/<name> (grid=heldout calibrate=true; the calibrated step long on one day,
    short on the next): this simulator gives its figures again, and with each scenario's step
    level the single rows' errors shrink by more than half."""
    s = _shipped_simulated_again(name, 108, tmp_path / "a")
    assert main(["validate", f"measured_from={DATA_DIR / 'fidelity' / name}",
                 "step_from_scenario=true", f"hydra.run.dir={tmp_path / 'b'}"]) == 0
    level = json.loads((tmp_path / "b" / "fidelity.json").read_text())["summary"]
    assert level["by_case"]["single"]["mean_abs_pct_error"] < \
        s["by_case"]["single"]["mean_abs_pct_error"] / 2


def test_a_shipped_run_on_a_step_level_off_by_8pct_is_not_met(tmp_path, no_emulation, capsys):
    """data/fidelity/2026-11-30-heldout-tc-host: its calibration measured the receiver's step
    1.14x the in-process one and the scenarios decoded 8.1% faster than simulated. Within
    the 5% mean target its errors were (3.52% / 9.72%), but its step level is beyond the
    5% step-level tolerance: not met, naming the re-simulation with each scenario's step;
    with the 10% the run itself used (then the drift tolerance), held as it said."""
    s = _shipped_simulated_again("2026-11-30-heldout-tc-host", 108, tmp_path / "a")
    level = s["step_level"]
    assert level["tolerance_pct"] == 5.0
    assert level["step_mean_abs_pct"] == pytest.approx(8.1, abs=0.1)
    assert s["met_mean"] and s["met_max"] and not level["trusted"] and not s["met"]
    out = capsys.readouterr().out
    assert "step level not the scenarios' host" in out and "step_from_scenario=true" in out
    shipped = DATA_DIR / "fidelity" / "2026-11-30-heldout-tc-host"
    assert main(["validate", f"measured_from={shipped}", "step_level_tolerance_pct=10",
                 f"hydra.run.dir={tmp_path / 'b'}"]) == 0
    again = json.loads((tmp_path / "b" / "fidelity.json").read_text())["summary"]
    assert again["step_level"]["trusted"] and again["met"]
    with pytest.raises(ValueError, match="step_level_tolerance_pct"):
        from kvsim.fidelity.validation import Config
        Config(model=None, step_level_tolerance_pct=0)
