"""The on-arrival worker's level in a validation (kvsim.fidelity.worker_level): a scenario's
measured layer jobs over what the calibrated worker pace gives them, by hand; the link
profile copy that runs a scenario at its own level; the summary's check and words; and
`worker_from_scenario=true` in a live validation and in its re-simulation."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from kvsim.cli.main import main
from kvsim.core.paths import DATA_DIR
from kvsim.fidelity.worker_level import (
    WorkerLevel,
    level_keys,
    paced_link_profile,
    scenario_worker_level,
    worker_level,
)
from kvsim.model.spec import ModelSpec
from tests.worker_pace_rows import flat_lynx_timing, paced_rows

MODEL = ModelSpec(name="tiny", layers=4, attention_heads=4, kv_heads=2, head_dim=64,
                  hidden_size=256, params_total=1e8, params_active=1e8)
PACE = (0.7, 0.5, 0.4)  # alone, encoder, ingest


def _timing(tmp_path):
    """A codec timing whose every lynx layer job at 1,024 tokens is 4 ms (anchor or not)."""
    return flat_lynx_timing(tmp_path / "timing.json", MODEL)


def _link(tmp_path, name="link", pace=PACE, model="tiny"):
    path = tmp_path / f"{name}.json"
    doc = {"version": 1, "emulation": "token_bucket"}
    if pace is not None:
        doc["worker_pace"] = {"alone": pace[0], "encoder": pace[1], "ingest": pace[2],
                              "model": model}
    path.write_text(json.dumps(doc))
    return path


def test_a_scenarios_level_is_its_jobs_over_the_paces(tmp_path):
    timing, link = _timing(tmp_path), _link(tmp_path)
    at_pace = [{"codec": "lynx", "per_request": paced_rows(PACE, 0.004)}]
    assert scenario_worker_level(at_pace, timing, link, MODEL) == pytest.approx(1.0, abs=1e-9)
    # every job 1.3 x as long (alone 0.91 where the pace says 0.7): level 1.3
    slow = paced_rows((0.91, 0.5, 0.4), 0.004)
    assert scenario_worker_level([{"codec": "lynx", "per_request": slow}], timing, link,
                                 MODEL) == pytest.approx(1.3, abs=1e-9)
    # a row without per_request is its own request; two codecs' rows pool their jobs:
    # 12 jobs of each request at 1.0 and 1.3 x 4 requests each -> their job-weighted ratio
    pooled = [*paced_rows(PACE, 0.004), *slow]
    want = sum(float(s[3]) - float(s[2]) for r in pooled for s in r["trace_spans"]
               if s[0].startswith("dequantize")) / \
        (2 * sum(float(s[3]) - float(s[2]) for r in paced_rows(PACE, 0.004)
                 for s in r["trace_spans"] if s[0].startswith("dequantize")))
    assert scenario_worker_level(pooled, timing, link, MODEL) == pytest.approx(want, rel=1e-12)
    # a pace for half the `alone` makes the same jobs twice its pace
    half = _link(tmp_path, "half", (0.35, 0.5, 0.4))
    assert scenario_worker_level(at_pace, timing, half, MODEL) == pytest.approx(2.0, abs=1e-9)
    # nothing to measure against, or nothing measured: None
    assert scenario_worker_level(at_pace, timing, _link(tmp_path, "none", None), MODEL) is None
    assert scenario_worker_level(at_pace, timing, _link(tmp_path, "other", model="x"),
                                 MODEL) is None
    monolithic = [{**r, "dequantize": "after_transfer"} for r in paced_rows(PACE, 0.004)]
    assert scenario_worker_level(monolithic, timing, link, MODEL) is None
    assert scenario_worker_level([], timing, link, MODEL) is None


def test_the_paced_link_profile(tmp_path):
    link = _link(tmp_path)
    out = paced_link_profile(link, 1.25, tmp_path / "w" / "paced.json",
                             {"worker_level_from": "scenario"})
    doc = json.loads(out.read_text())
    assert doc["worker_pace"]["alone"] == pytest.approx(0.7 * 1.25)
    assert (doc["worker_pace"]["encoder"], doc["worker_pace"]["ingest"]) == (0.5, 0.4)
    assert doc["worker_level"] == {"worker_level_from": "scenario", "level": 1.25,
                                   "from_profile": str(link)}
    # the profile's bound holds
    big = json.loads(paced_link_profile(link, 100.0, tmp_path / "big.json", {}).read_text())
    assert big["worker_pace"]["alone"] == 10.0
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="positive number"):
            paced_link_profile(link, bad, tmp_path / "bad.json", {})
    with pytest.raises(ValueError, match="no worker_pace"):
        paced_link_profile(_link(tmp_path, "none", None), 1.1, tmp_path / "bad.json", {})


def _row(emulation, gbps, level, source="calibration", case="single"):
    return {"case": case, "emulation": emulation, "bandwidth_gbps": gbps,
            "context_tokens": 1536, **({"worker_level": level} if level is not None else {}),
            "worker_level_from": source}


def test_the_check_and_its_words():
    rows = [_row("tc", 0.6, 1.12), _row("tc", 0.6, 1.12), _row("tc", 0.2, 0.96),
            _row("token_bucket", 0.2, None), _row("token_bucket", 0.6, math.nan),
            {"case": "multi", "worker_level": 3.0}]
    held = worker_level(rows, 15.0, run="/runs/a")
    assert held.levels == {"tc 0.6 Gbps 1536": 1.12, "tc 0.2 Gbps 1536": 0.96}
    assert held.mean_abs_pct == pytest.approx(8.0) and held.max_abs_pct == pytest.approx(12.0)
    assert held.held and held.words().startswith("worker level held: ")
    assert "0.96-1.12 x" in held.words() and "worst 12.0% at tc 0.6 Gbps 1536" in held.words()
    off = worker_level(rows, 10.0, run="/runs/a")
    assert not off.held and "worker level not the calibration's" in off.words()
    assert "measured_from=/runs/a worker_from_scenario=true" in off.words()
    kept_alone = worker_level(rows, 10.0, run="/runs/a", resimulable=False)
    assert "worker_from_scenario=true`" not in kept_alone.words()
    assert "scenario files, not kept with it" in kept_alone.words()
    mine = worker_level([{**r, "worker_level_from": "scenario"} for r in rows[:3]], 10.0)
    assert mine.from_scenario and "taken from each scenario's own jobs" in mine.words()
    none = worker_level([_row("tc", 0.6, None)], 10.0)
    assert none.held and none.words() is None and math.isnan(none.mean_abs_pct)
    d = off.as_dict()
    assert d["held"] is False and d["words"] == off.words() \
        and d["max_abs_pct"] == pytest.approx(12.0)
    assert level_keys(1.2, True) == {"worker_level": 1.2, "worker_level_from": "scenario"}
    assert level_keys(None, False) == {"worker_level": None,
                                       "worker_level_from": "calibration"}
    assert level_keys(None, True) == {"worker_level": None,
                                      "worker_level_from": "calibration"}  # nothing to run on
    assert WorkerLevel().words() is None


def test_worker_from_scenario_live_and_again(tmp_path, monkeypatch):
    """A quick validation whose "emulator" is the simulator, its lynx requests carrying
    layer jobs 1.3 x what the token bucket's shipped worker pace gives them: each row says
    its scenario's level; worker_from_scenario=true runs the simulator on a copy of the link
    profile at that level (a slower worker: lynx's TTFT no earlier), and a re-simulation
    gives the same; without the scenario files it refuses."""
    from kvsim.core.profiles import profile_path
    from kvsim.fidelity import runner
    from kvsim.scenario.codec_timing import load_codec_timing

    link = profile_path("link", "local-smollm2-135m-token-bucket")
    pace = json.loads(link.read_text())["worker_pace"]
    timing = load_codec_timing("", profile_path("codec_timing", "local-smollm2-135m"))
    from kvsim.model.presets import load_model_preset

    model = load_model_preset("smollm2-135m")
    base_s = timing.lookup("lynx", "lynx").layer_job_s(model.kv_bytes_bf16(1024) / model.layers)
    jobs = [{**r, "context_tokens": 1024} for r in paced_rows(
        (pace["alone"] * 1.3, pace["encoder"], pace["ingest"]), float(base_s))]

    def emulated(common, host=None):
        sim = ["scenario=none", *[o for o in common if not o.startswith("transport.")],
               "deserializer=on_arrival", "samples=2"]
        return [{**r, **({"per_request": jobs} if r["codec"] == "lynx" else {})}
                for r in runner.simulate(sim)]

    monkeypatch.setattr(runner, "emulate_rows", emulated)
    runs = {}
    for name, own in (("plain", "false"), ("own", "true")):
        runs[name] = tmp_path / name
        assert main(["validate", "grid=quick", f"worker_from_scenario={own}", "samples=2",
                     "multi.enabled=false", "drift.action=off",
                     f"hydra.run.dir={runs[name]}"]) == 0
    docs = {k: json.loads((d / "fidelity.json").read_text()) for k, d in runs.items()}
    single = {k: [r for r in d["rows"] if r["case"] == "single"] for k, d in docs.items()}
    levels = {r["worker_level"] for r in single["plain"]}
    # above 1.3: the rows' jobs are 1.3 x the residual's job, and an anchor's job is shorter
    assert len(levels) == 1 and 1.3 < levels.pop() < 2.0
    level = single["plain"][0]["worker_level"]
    assert {r["worker_level_from"] for r in single["plain"]} == {"calibration"}
    assert {r["worker_level_from"] for r in single["own"]} == {"scenario"}
    scenario = "single-token_bucket-0.1gbps-1024"
    paced = json.loads((runs["own"] / "profiles-worker" / f"{scenario}-link.json").read_text())
    assert paced["worker_pace"]["alone"] == pytest.approx(pace["alone"] * level)
    assert not (runs["plain"] / "profiles-worker").exists()
    # the simulator ran on the paced copy: a slower worker (every codec's: the level is
    # the scenario's) made no time earlier and lynx's later
    kept = json.loads((runs["own"] / "scenarios" / f"{scenario}.json").read_text())
    assert {r["link_profile"] for r in kept["simulated"]} == \
        {str(runs["own"] / "profiles-worker" / f"{scenario}-link.json")}
    times = {k: [(r["codec"], r["metric"], r["simulated_s"]) for r in rows]
             for k, rows in single.items()}
    assert all(own[:2] == plain[:2] and own[2] >= plain[2] - 1e-9
               for own, plain in zip(times["own"], times["plain"], strict=True))
    assert any(own[0] == "lynx" and own[2] > plain[2]
               for own, plain in zip(times["own"], times["plain"], strict=True))
    assert docs["own"]["summary"]["worker_level"]["from_scenario"] is True
    assert docs["plain"]["summary"]["worker_level"]["levels"] == {
        "token_bucket 0.1 Gbps 1024": level}
    # the re-simulation computes the level again from the kept scenario files
    again = tmp_path / "again"
    assert main(["validate", f"measured_from={runs['plain']}", "worker_from_scenario=true",
                 "samples=2", f"hydra.run.dir={again}"]) == 0
    rows = json.loads((again / "fidelity.json").read_text())["rows"]
    assert [(r["codec"], r["metric"], r["simulated_s"], r["worker_level"]) for r in rows] == \
        [(r["codec"], r["metric"], r["simulated_s"], r["worker_level"]) for r in single["own"]]
    # a report alone (no scenarios/ beside it): its saved level is carried on the profiles
    # beside it only (data/profiles may have been calibrated again since), and
    # worker_from_scenario has none to run on
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "report.json").write_text((runs["plain"] / "report.json").read_text())

    def carried(name: str) -> set:
        assert main(["validate", f"measured_from={alone}", "samples=2",
                     f"hydra.run.dir={tmp_path / name}"]) == 0
        rows = json.loads((tmp_path / name / "fidelity.json").read_text())["rows"]
        return {r["worker_level"] for r in rows if r["case"] == "single"}

    assert carried("not-carried") == {None}
    shutil.copytree(DATA_DIR / "profiles", alone / "profiles")
    assert carried("carried") == {level}
    assert main(["validate", f"measured_from={alone}", "worker_from_scenario=true",
                 "samples=2", f"hydra.run.dir={tmp_path / 'refused'}"]) != 0


def test_worker_from_scenario_with_the_scenarios_step_and_without_jobs(tmp_path, monkeypatch):
    """With step_from_scenario=true too, the level is taken against the step-scaled copies
    and the paced link is made from the step-scaled one; a scenario whose requests measured
    no on-arrival jobs is simulated on the calibrated worker and says so, and the run goes
    on."""
    from kvsim.fidelity import runner

    def emulated(common, host=None):
        sim = ["scenario=none", *[o for o in common if not o.startswith("transport.")],
               "deserializer=on_arrival", "samples=2"]
        rows = runner.simulate(sim)
        if not jobs:
            return [{**r, "tpot_s": 0.05} for r in rows]
        return [{**r, "tpot_s": 0.05, **({"per_request": jobs} if r["codec"] == "lynx"
                                         else {})} for r in rows]

    jobs = [{**r, "context_tokens": 1024} for r in paced_rows((1.0, 0.5, 0.4), 0.004)]
    monkeypatch.setattr(runner, "emulate_rows", emulated)
    both = tmp_path / "both"
    assert main(["validate", "grid=quick", "worker_from_scenario=true",
                 "step_from_scenario=true", "samples=2", "multi.enabled=false",
                 "drift.action=off", f"hydra.run.dir={both}"]) == 0
    scenario = "single-token_bucket-0.1gbps-1024"
    paced = json.loads((both / "profiles-worker" / f"{scenario}-link.json").read_text())
    assert paced["worker_level"]["from_profile"] == \
        str(both / "profiles-probed" / f"{scenario}-link.json")
    rows = [r for r in json.loads((both / "fidelity.json").read_text())["rows"]
            if r["case"] == "single"]
    assert {r["worker_level_from"] for r in rows} == {"scenario"}
    assert {r["step_level_from"] for r in rows} == {"scenario"}
    jobs = []
    none = tmp_path / "none"
    assert main(["validate", "grid=quick", "worker_from_scenario=true", "samples=2",
                 "multi.enabled=false", "drift.action=off", f"hydra.run.dir={none}"]) == 0
    doc = json.loads((none / "fidelity.json").read_text())
    rows = [r for r in doc["rows"] if r["case"] == "single"]
    assert {r["worker_level"] for r in rows} == {None}
    assert {r["worker_level_from"] for r in rows} == {"calibration"}
    assert not (none / "profiles-worker").exists()
    assert doc["summary"]["worker_level"]["levels"] == {}


def test_the_drafting_line_gives_a_differing_scenarios_worker_level():
    from kvsim.fidelity.drafting import drafting_line, drafting_summary

    def drafted(**keys):
        return {"case": "single", "emulation": "tc", "bandwidth_gbps": 0.6,
                "context_tokens": 1536, "codec": "lynx", "metric": "ttft", "measured_s": 1.0,
                "simulated_s": 1.12, "error_pct": 12.0, "accepted_measured": "1/1",
                "accepted_simulated": "1.88/2", "first_draft_measured_s": 0.122,
                "first_draft_simulated_s": 0.153, **keys}

    line = drafting_line(drafting_summary([drafted(worker_level=0.684,
                                                   worker_level_from="calibration")]))
    assert line.endswith("; its on-arrival worker at 0.68 x the simulated pace); "
                         "no other comparison")
    ran = drafting_line(drafting_summary([drafted(worker_level=1.33,
                                                  worker_level_from="scenario")]))
    assert "worker at 1.33 x the simulated pace (simulated on it))" in ran
    assert "on-arrival worker" not in drafting_line(drafting_summary([drafted()]))


def test_a_saved_level_is_carried_only_onto_the_pace_it_was_measured_against():
    """Without the run's scenario files: the saved level where the profiles are the run's
    own and the step scale the same (none, or equal), else None."""
    from kvsim.fidelity.validation import _saved_worker_level

    saved = [{"worker_level": 1.2, "step_scale": 0.9}]
    assert _saved_worker_level(saved, {"step_scale": 0.9}, other_profiles=False) == 1.2
    assert _saved_worker_level(saved, {"step_scale": 1.1}, other_profiles=False) is None
    assert _saved_worker_level(saved, {}, other_profiles=False) is None
    assert _saved_worker_level(saved, {"step_scale": 0.9}, other_profiles=True) is None
    unscaled = [{"worker_level": 0.8}]
    assert _saved_worker_level(unscaled, {}, other_profiles=False) == 0.8
    assert _saved_worker_level(unscaled, {"step_scale": 1.0}, other_profiles=False) is None
    assert _saved_worker_level([{"worker_level": None}], {}, other_profiles=False) is None
