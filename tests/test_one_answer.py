"""One question, one answer: the same setting asked through `kvsim sim`, `kvsim sweep`,
`kvsim advise` and `kvsim plot` names the same codec and transfer policy with the same
committed time to the 32nd token, when they rank the same candidates: sim and sweep are
given advise's policies (their default, transfer=auto, runs one policy per codec, and
advise may find another one faster or tied: at 25 Gbps / 64K, with the H100's measured
codec timings, lynx layer by layer ties lynx's split streams 3 ms ahead). The setting of the
question that found them apart (25 Gbps, 64K context, Llama-3.1-8B on H100), and a second
one (1 Gbps, 16K) where another codec wins. int4 is the fastest in the first and fails the
quality floor: every path leaves it out the same way."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvsim.cli.main import main
from kvsim.commands.plot import run as plot_run
from kvsim.plots.options import PlotOptions

CODECS = "codecs=[int8,int4,lynx]"
ADVISE_POLICIES = "transfer=[monolithic,layerwise,split_stream,split_stream_layerwise]"
SETTINGS = {
    "25g-64k": (["model=llama-3.1-8b", "hardware=h100", "workload.context_tokens=65536"],
                25.0, 50.0),
    "1g-16k": (["model=llama-3.1-8b", "hardware=h100", "workload.context_tokens=16384"],
               1.0, 2.0),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_command_gives_one_answer(name, tmp_path, capsys):
    setting, gbps, other_gbps = SETTINGS[name]
    at = f"link.bandwidth_gbps={gbps:g}"
    # kvsim sim: the pick line and the picked row of its report
    assert main(["sim", *setting, at, CODECS, ADVISE_POLICIES,
                 f"report={tmp_path / 'sim.json'}"]) == 0
    out = capsys.readouterr().out
    sim_rows = json.loads((tmp_path / "sim.json").read_text())["rows"]
    (picked,) = [r for r in sim_rows if r["pick"]]
    answer = (picked["codec"], picked["transfer"])
    time_s = picked["ttkt_committed_s"]["32"]
    assert f"{answer[0]} / {answer[1]}, committed TT32T {time_s:.3f} s" in out
    # kvsim advise (every policy of every listed codec): the same recommendation and time
    assert main(["advise", *setting, at, CODECS, f"report={tmp_path / 'advise.json'}"]) == 0
    out = capsys.readouterr().out
    assert f"recommendation: {answer[0]} / {answer[1]}" in out
    advice = json.loads((tmp_path / "advise.json").read_text())["rows"]
    (best,) = [r for r in advice if r["recommended"]]
    assert (best["codec"], best["transfer"]) == answer
    assert best["ttkt_committed_s"] == pytest.approx(time_s, rel=1e-12)
    assert all(r["rank"] is None for r in advice if r["codec"] == "int4")  # over the floor
    # kvsim sweep over two bandwidths: its summary and table mark the same row at this one
    sweep_dir = tmp_path / "sweep"
    assert main(["sweep", *setting, f"link.bandwidth_gbps={gbps:g},{other_gbps:g}", CODECS,
                 ADVISE_POLICIES, "hydra/launcher=basic",
                 f"hydra.sweep.dir={sweep_dir}"]) == 0
    capsys.readouterr()
    table = pd.read_parquet(sweep_dir / "sweep.parquet")
    here = table[table["bandwidth_gbps"] == gbps]
    (row,) = here[here["pick"]].to_dict("records")
    assert (row["codec"], row["transfer"]) == answer
    assert row["ttkt_committed_s.32"] == pytest.approx(time_s, rel=1e-12)
    # kvsim plot kind=fig11 (committed, from arrival): the same time on the answer's line,
    # and no line of a codec meeting the floor below it
    (fig,) = plot_run(PlotOptions(kind="fig11", input=str(sweep_dir / "sweep.parquet"), k=32,
                                  origin="arrival", out=str(tmp_path / "fig11.png"),
                                  formats=["png"]))
    metric = fig["metric"]
    assert metric == "ttkt_committed_s.32"
    at_gbps = {(s["codec"], s["transfer"]): s[metric][s["bandwidth_gbps"].index(gbps)]
               for s in fig["bandwidth_gbps"]}
    assert at_gbps[answer] == pytest.approx(time_s, rel=1e-12)
    admissible = {k: v for k, v in at_gbps.items() if k[0] != "int4"}
    assert min(admissible.values()) >= time_s - 0.01  # within advise's tie of the answer


def test_a_sweep_over_codecs_or_policies_marks_no_pick(tmp_path, capsys):
    """Each point of such a sweep picks among its own rows only: the summary marks none and
    says why (advise ranks the codecs and policies of one setting together). A display-only
    key (wide) does not make a point new."""
    from kvsim.cli.sweep import point_key

    setting, gbps, _ = SETTINGS["1g-16k"]
    sweep_dir = tmp_path / "policies"
    assert main(["sweep", *setting, f"link.bandwidth_gbps={gbps:g}", CODECS,
                 "transfer=layerwise,auto", "hydra/launcher=basic",
                 f"hydra.sweep.dir={sweep_dir}"]) == 0
    out = capsys.readouterr().out
    assert "no pick marked: transfer swept" in out
    assert point_key({"a": 1, "wide": True}) == point_key({"a": 1, "wide": False})
    assert point_key({"a": 1}) != point_key({"a": 2})
