"""What `kvsim sim` and `kvsim advise` print: a neutral base unless a scenario is named, what
a named scenario carried over (and only what is in force), and output that fits a
120-column terminal (header, table rows, reason, notes)."""

from __future__ import annotations

from kvsim.cli.main import main
from kvsim.scenario.describe import TABLE_WIDTH

SETTING = ["link.bandwidth_gbps=25", "workload.context_tokens=65536"]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_the_base_is_neutral_and_a_named_scenario_says_what_it_set(capsys):
    assert main(["sim", *SETTING, "codecs=[int8]"]) == 0
    out = capsys.readouterr().out
    assert "scenario" not in out  # nothing carried over from any scenario
    assert "model=llama-3.1-8b hardware=1xh100 link=10g at 25 Gbps" in out
    # a scenario named: its settings the command line did not give are listed; a group chosen
    # on the command line (hardware=h100) leaves the scenario's hardware.devices in force
    assert main(["sim", "scenario=table1-qwen32b-16k", "hardware=h100", "codecs=[int8]",
                 "samples=2"]) == 0
    out = capsys.readouterr().out
    block = out.split("setting:")[0]
    assert block.startswith("scenario table1-qwen32b-16k (its title as written: Lynx Table 1")
    for carried in ("model=qwen3-32b", "hardware.devices=4", "workload.context_tokens=16384",
                    "speculative.draft_overhead_s=0.0", "transfer=seeds"):
        assert carried in block, carried
    for given in ("hardware=ascend-910b4", "codecs=", "samples="):
        assert given not in block, given
    assert "hardware=4xh100" in out


def test_advise_lists_only_the_scenario_settings_in_force(capsys):
    """advise's own candidates (codecs, transfer) replace the scenario's: not listed."""
    assert main(["advise", "scenario=table1-qwen32b-16k", "codecs=[int8,int4]",
                 "transfer=[layerwise]"]) == 0
    block = capsys.readouterr().out.split("setting:")[0]
    assert "model=qwen3-32b" in block and "samples=32" in block
    assert "transfer=seeds" not in block and "codecs=" not in block


def test_default_output_fits_a_terminal(capsys):
    """The question's own output: header, rows, pick, ranking, reason and notes all fit 120
    columns (they were 363, 165-209 and 541)."""
    codecs = "codecs=[bf16,int8,int4,lynx,lynx-oscar]"
    assert main(["sim", *SETTING, codecs]) == 0
    sim = _lines(capsys.readouterr().out)
    assert main(["advise", *SETTING]) == 0
    advise = _lines(capsys.readouterr().out)
    assert any(line.startswith("reason: ") for line in advise)
    for line in sim + advise:
        assert len(line) <= TABLE_WIDTH, line
    # wide=true prints every time column: wider, and says what it adds
    assert main(["sim", *SETTING, codecs, "wide=true"]) == 0
    wide = _lines(capsys.readouterr().out)
    assert max(len(line) for line in wide) > TABLE_WIDTH
    assert any("TT32T-pe" in line for line in wide) and any("accepted/" in line for line in wide)
