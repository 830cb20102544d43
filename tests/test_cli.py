"""The `kvsim` entry point: command discovery, help, and clear errors for bad overrides."""

from __future__ import annotations

import json
import sys

from kvsim.cli import _commands, main


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
