"""The `kvsim` entry point: command discovery, help, and clear errors for bad overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsim.cli.main import _commands, main


def test_help_lists_every_command_without_importing_them(capsys):
    heavy_before = "kvsim.commands.quality" in sys.modules
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for words in [("sim",), ("bench", "codecs"), ("bench", "sim"), ("quality",),
                  ("model", "fetch"), ("sweep",), ("plot",)]:
        assert words in _commands()
        assert " ".join(words) in out
    assert ("kvsim.commands.quality" in sys.modules) == heavy_before


def test_unknown_command_and_bad_arguments(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["sim", "not-an-override"]) == 2
    assert "key=value" in capsys.readouterr().err
    assert main(["sim", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert main(["sim", "link.bandwidth_gbps=abc"]) == 2
    assert "could not be converted" in capsys.readouterr().err
    # the command's own check, before Hydra runs: a usage error like the others
    assert main(["sim", "link.bandwidth_gbps=-3"]) == 2
    assert "link.bandwidth_gbps must be > 0" in capsys.readouterr().err


def test_command_help_shows_config(capsys):
    assert main(["bench", "codecs", "--help"]) == 0
    out = capsys.readouterr().out
    assert "codecs:" in out and "report=PATH" in out


def test_report_carries_config_and_provenance(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = main(["sim", "scenario=none", "model=smollm2-135m", "hardware=h100",
               "workload.context_tokens=2048", "codecs=[bf16]", "samples=1", f"report={path}"])
    assert rc == 0
    doc = json.loads(path.read_text())
    assert doc["command"] == "sim" and doc["rows"]
    assert doc["config"]["workload"]["context_tokens"] == 2048
    assert doc["provenance"]["kvsim_version"]
    assert doc["rows"][0]["context_tokens"] == 2048


def test_typos_fail_with_the_closest_key(capsys):
    assert main(["sim", "link.bandwith_gbps=25"]) == 2
    err = capsys.readouterr().err
    assert "did you mean link.bandwidth_gbps?" in err and "+link" not in err
    assert main(["sim", "+link.bandwith_gbps=25"]) == 2  # appending is no way around it
    assert "did you mean link.bandwidth_gbps?" in capsys.readouterr().err
    assert main(["sim", "model=llama3"]) == 2
    assert "did you mean model=llama-3.1-8b?" in capsys.readouterr().err
    assert main(["sim", "-m", "link.bandwidth_gbps=10,25", "worklod.context_tokens=1,2"]) == 2
    assert "did you mean workload.context_tokens?" in capsys.readouterr().err
    assert main(["smi"]) == 2
    assert "did you mean 'sim'?" in capsys.readouterr().err


def test_usage_errors_exit_2_with_one_line_and_leave_no_directory(tmp_path, capsys):
    run = tmp_path / "run"
    for args, says in (
            (["codec=int8"], "`codec` is not a setting of this command; did you mean "
                             "codecs=[int8]?"),
            (["codecs=[int8,lynxx]"], "unknown codec preset 'lynxx'; did you mean lynx?"),
            (["codecs=lynxx"], "did you mean lynx?"),
            (["link.bandwidth_gbps=0"], "link.bandwidth_gbps must be > 0"),
            (["no_such=1"], "unknown key 'no_such'")):
        assert main(["sim", "scenario=none", *args, f"hydra.run.dir={run}"]) == 2, args
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
        assert not run.exists(), args  # nothing ran: no directory


def test_a_scalar_is_a_one_item_list_and_an_int_a_float(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["sim", "scenario=none", "codecs=int8", "link.trace=[[0,5],[1,2]]",
                 f"hydra.run.dir={tmp_path / 'run'}", f"report={report}"]) == 0
    cfg = json.loads(report.read_text())["config"]
    assert cfg["codecs"] == ["int8"] and cfg["link"]["trace"] == [[0, 5], [1, 2]]
    [row] = json.loads(report.read_text())["rows"]
    assert row["codec"] == "int8"


def test_a_run_that_fails_before_writing_leaves_no_directory(tmp_path, capsys):
    run = tmp_path / "run"
    missing = tmp_path / "nope.csv"
    assert main(["sim", "scenario=none", "workload.kind=trace",
                 f"workload.trace_path={missing}", f"hydra.run.dir={run}"]) in (1, 2)
    assert "nope.csv" in capsys.readouterr().err
    assert not run.exists()


def test_valid_overrides_are_checked_with_one_composition(monkeypatch):
    import kvsim.cli.keys as ck
    from kvsim.commands.sim import Config

    calls = []
    compose = ck._compose
    monkeypatch.setattr(ck, "_compose", lambda name, ov: calls.append(ov) or compose(name, ov))
    ck.check_overrides("sim", Config, ["scenario=table1-qwen32b-16k", "model=llama-3.1-8b",
                                       "link.bandwidth_gbps=10,25", "hydra/launcher=basic"])
    assert calls == [["scenario=table1-qwen32b-16k", "model=llama-3.1-8b",
                      "link.bandwidth_gbps=10"]]
    # a wrong value: composed again with the group choices alone, to name the culprit
    calls.clear()
    with pytest.raises(ck.OverrideError, match="bad configuration"):
        ck.check_overrides("sim", Config, ["model=llama-3.1-8b", "link.bandwidth_gbps=abc"])
    assert calls[1] == ["model=llama-3.1-8b"] and len(calls) == 2  # not composed a third time
    # `+key=` composes whether or not the key exists: checked against the groups' config
    with pytest.raises(ck.OverrideError, match="already exists"):
        ck.check_overrides("sim", Config, ["+link.bandwidth_gbps=25"])
    with pytest.raises(ck.OverrideError, match="did you mean link.bandwidth_gbps"):
        ck.check_overrides("sim", Config, ["++link.bandwith_gbps=25"])


def test_version_list_and_help_with_comments(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("kvsim 0.")
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "scenario" in out and "table1-qwen32b-16k" in out
    assert main(["list", "scenario"]) == 0
    out = capsys.readouterr().out
    assert "grid (-m): workload.context_tokens=32768,65536,131072" in out
    assert main(["list", "scenaro"]) == 2
    assert "did you mean 'scenario'" in capsys.readouterr().err
    assert main(["sim", "--help"]) == 0
    out = capsys.readouterr().out
    # groups with their presets, the scenarios, and each field's comment (units)
    assert "hardware   [h100]" in out and "fig11-context" in out  # the neutral base
    assert "bandwidth_gbps: 10.0  # 1e9 bit/s" in out


def test_hydra_command_line_flags(capsys):
    assert main(["sim", "--cfg", "job", "link.bandwidth_gbps=3"]) == 0
    assert "bandwidth_gbps: 3.0" in capsys.readouterr().out
    assert main(["sim", "link.bandwidth_gbps=3", "--info", "defaults"]) == 0
    assert "scenario/none" in capsys.readouterr().out  # no scenario unless one is named
    assert main(["sim", "-m", "link.bandwidth_gbps=3", "report=x.json"]) == 2
    assert "report= names one file" in capsys.readouterr().err


def test_run_directory_holds_report_and_hydra_config(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["sim", "scenario=none", "model=smollm2-135m", "codecs=[int8]", "samples=1",
                 "workload.context_tokens=1024", f"hydra.run.dir={run_dir}"]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    assert report["config"]["model"]["name"] == "smollm2-135m"
    assert "codecs=[int8]" in report["overrides"]
    assert (run_dir / ".hydra" / "overrides.yaml").is_file()


def test_default_run_writes_nothing_into_the_repository(tmp_path):
    repo = Path(__file__).resolve().parent.parent

    def status() -> str:
        return subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=repo,
                              capture_output=True, text=True, timeout=30).stdout

    before = status()
    env = {k: v for k, v in os.environ.items() if k != "KVSIM_OUTPUT_ROOT"}
    for args in (["sim", "scenario=none", "codecs=[int8]", "samples=1"],
                 ["plot", "kind=survival"]):
        proc = subprocess.run([sys.executable, "-m", "kvsim", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert status() == before
    reports = list((tmp_path / "outputs").glob("*/*-sim/report.json"))
    assert len(reports) == 1  # the run directory under the current directory


def test_shell_completion_completes_commands_and_keys(monkeypatch, capsys):
    assert main(["--shell-completion", "install=bash"]) == 0
    assert "complete -o nospace -o default -F hydra_bash_completion kvsim" in \
        capsys.readouterr().out
    for line, expected in (("kvsim si", "sim"), ("kvsim sim link.band", "link.bandwidth_gbps="),
                           ("kvsim bench c", "codecs"), ("kvsim sim model=qwen3-3",
                                                         "model=qwen3-32b")):
        monkeypatch.setenv("COMP_LINE", line)
        monkeypatch.setenv("COMP_POINT", str(len(line)))
        assert main(["-sc", "query=bash"]) == 0
        assert expected in capsys.readouterr().out.split(), line


def test_a_resolved_child_writes_its_report(tmp_path):
    """`kvsim emulate` starts `kvsim serve` / `send` with --resolved=CONFIG report=PATH and
    reads their rows from PATH (over tc both ends are children)."""
    import dataclasses
    import json

    from kvsim.core.compose import compose
    from kvsim.scenario.config import SimConfig

    cfg, _ = compose("sim", ["scenario=none", "model=tiny-random", "hardware=local-cpu",
                             "codecs=[int8]", "workload=emulated",
                             "workload.context_tokens=64", "workload.output_tokens=4"],
                     SimConfig)
    resolved = tmp_path / "cfg.json"
    resolved.write_text(json.dumps(dataclasses.asdict(cfg)))
    report = tmp_path / "child.json"
    assert main(["sim", f"--resolved={resolved}", f"report={report}"]) == 0
    doc = json.loads(report.read_text())
    assert doc["command"] == "sim" and [r["codec"] for r in doc["rows"]] == ["int8"]
