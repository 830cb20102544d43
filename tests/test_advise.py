"""`kvsim advise`: the Pareto front, the quality floor, and a ranking whose answer is known
by construction (a link so slow that wire bytes decide every time)."""

from __future__ import annotations

import json

import pytest

from kvsim.advise.config import AdviseConfig
from kvsim.advise.floor import CodecQuality, QualityFloor, admissible, parse_floor
from kvsim.advise.pareto import dominates, pareto_front
from kvsim.advise.rank import advise, candidate_policies, load_qualities, simulate
from kvsim.cli.main import main
from kvsim.core.compose import compose

# a tiny model on a 0.05 Gbps link: transfer (seconds) dwarfs prefill and decode (ms), so
# the time to any token orders the codecs as their wire bytes do
SLOW = ["scenario=none", "model=smollm2-135m", "hardware=h100", "link.bandwidth_gbps=0.05",
        "workload.context_tokens=2048", "workload.output_tokens=32", "samples=1",
        "codecs=[bf16,int8,int4]", "transfer=[monolithic]"]


def test_pareto_front_of_hand_made_points():
    pts = [(1.0, 5.0), (2.0, 3.0), (3.0, 3.0), (2.0, 4.0), (4.0, 1.0), (5.0, 2.0), (1.0, 5.0)]
    # (3,3) and (2,4) are dominated by (2,3); (5,2) by (4,1); the duplicate (1,5) is kept
    assert pareto_front(pts) == [0, 6, 1, 4]
    assert pareto_front([]) == []
    assert pareto_front([(7.0, 7.0)]) == [0]
    assert dominates((1.0, 1.0), (1.0, 2.0)) and not dominates((1.0, 2.0), (1.0, 2.0))
    assert not dominates((1.0, 3.0), (2.0, 2.0)) and not dominates((2.0, 2.0), (1.0, 3.0))


def test_every_point_off_the_front_is_dominated_by_one_on_it():
    import random

    rng = random.Random(0)
    pts = [(rng.randint(0, 9) * 1.0, rng.randint(0, 9) * 1.0) for _ in range(200)]
    front = set(pareto_front(pts))
    for i, p in enumerate(pts):
        dominated = any(dominates(pts[j], p) for j in range(len(pts)))
        assert (i in front) == (not dominated)


def test_floor_parsing_and_admissibility():
    assert parse_floor("lossless") == QualityFloor("lossless")
    assert parse_floor("None") == QualityFloor("none")
    assert parse_floor(1e-3) == QualityFloor("vnmse", 1e-3)
    assert parse_floor("0.01") == QualityFloor("vnmse", 0.01)
    for bad in (-1.0, "abc", True, float("nan"), None):
        with pytest.raises(ValueError, match="floor"):
            parse_floor(bad)
    bf16 = CodecQuality("bf16", 1.3e-5, 16.0, "t")
    int4 = CodecQuality("int4", 0.04, 4.5, "t")
    assert admissible(parse_floor(1e-3), bf16, bf16) == (True, "")
    ok, why = admissible(parse_floor(1e-3), int4, bf16)
    assert not ok and "0.04 > 0.001" in why
    assert admissible(parse_floor("lossless"), bf16, bf16)[0]
    assert not admissible(parse_floor("lossless"), int4, bf16)[0]
    assert admissible(parse_floor("none"), None, bf16) == (True, "")
    assert admissible(parse_floor(1.0), None, bf16) == (False, "vNMSE not measured")


def test_objective_keys():
    from kvsim.scenario.objective import objective_key

    assert objective_key("ttkt_committed_s.32") == ("ttkt_committed_s", 32)
    assert objective_key("ttft_s") == ("ttft_s", None)
    for bad in ("ttkt_s", "ttkt_s.0", "ttft_s.3", "tpot_s"):
        with pytest.raises(ValueError, match="objective"):
            objective_key(bad)


def _slow(extra: list[str]) -> AdviseConfig:
    cfg, _ = compose("advise", SLOW + extra, AdviseConfig)
    cfg.validate()
    return cfg


def test_slow_link_smallest_admissible_codec_wins():
    cfg = _slow([])
    rows = simulate(cfg)
    by_codec = {r["codec"]: r for r in rows}
    # the construction: bytes and times are in the same order (int4 < int8 < bf16)
    assert by_codec["int4"]["total_bytes"] < by_codec["int8"]["total_bytes"] \
        < by_codec["bf16"]["total_bytes"]
    assert by_codec["int4"]["ttkt_committed_s"][32] < by_codec["int8"]["ttkt_committed_s"][32]
    qualities = load_qualities(list(cfg.vnmse_tables))

    cfg.floor = "none"  # no floor: the fewest bytes win
    assert advise(cfg, rows, qualities).recommended.codec == "int4"

    cfg.floor = 1e-3  # int4's measured vNMSE (~0.04) is over the bound: int8 is next
    got = advise(cfg, rows, qualities)
    assert got.recommended.codec == "int8"
    assert [c.codec for c in got.candidates] == ["int8", "bf16", "int4"]
    assert not got.candidates[-1].admissible and got.candidates[-1].rank is None
    assert "fastest over the floor: int4/monolithic" in got.reason
    # the front: int4 (fastest), int8, bf16 (best vNMSE) all trade time for quality
    assert [c.codec for c in got.front] == ["int4", "int8", "bf16"]

    cfg.floor = "lossless"  # only the serving precision itself
    assert advise(cfg, rows, qualities).recommended.codec == "bf16"
    cfg.objective = "ttkt_s.32"  # drafted times cannot certify a lossless output
    with pytest.raises(ValueError, match="committed"):
        advise(cfg, rows, qualities)


def test_tie_goes_to_the_better_quality():
    cfg = _slow(["tie_s=0.5"])
    q = {"a": CodecQuality("a", 0.01, 4.0, "t"), "b": CodecQuality("b", 0.001, 8.0, "t")}

    def row(codec, t_s, nbytes):
        return {"codec": codec, "transfer": "monolithic", "total_bytes": nbytes,
                "ttft_s": t_s, "ttkt_committed_s": {32: t_s}, "ttkt_s": {32: t_s}}

    rows = [row("a", 10.0, 1e6), row("b", 10.3, 2e6)]
    cfg.floor = "none"
    assert advise(cfg, rows, q).recommended.codec == "b"  # 0.3 s apart, inside the tie
    cfg.tie_s = 0.1
    assert advise(cfg, rows, q).recommended.codec == "a"  # outside it: the faster


def test_advise_command_end_to_end(tmp_path, capsys):
    path = tmp_path / "advice.json"
    assert main(["advise", *SLOW, "floor=1e-3", f"report={path}"]) == 0
    out = capsys.readouterr().out
    assert "recommendation: int8 / monolithic" in out and "Pareto front" in out
    doc = json.loads(path.read_text())
    assert [r["codec"] for r in doc["rows"] if r["recommended"]] == ["int8"]
    assert doc["config"]["floor"] == 1e-3
    assert main(["advise", *SLOW, "floor=abc"]) == 2  # a usage error, caught before anything runs
    assert "floor" in capsys.readouterr().err


def test_codec_entries_pin_transfer_and_measured_acceptance_per_codec():
    cfg = _slow(["codecs=[int8,lynx,lynx-2+2+4,{preset:lynx-oscar,transfer:layerwise}]",
                 "transfer=[monolithic,split_stream]",
                 "acceptance_files=smollm2-135m-CODEC-s1-greedy"])
    got = {(entry if isinstance(entry, str) else entry["preset"]): (entry, policies)
           for entry, policies in candidate_policies(cfg)}
    assert got["int8"] == ("int8", ["monolithic"])  # one stream: nothing to split
    assert got["lynx-oscar"][1] == ["layerwise"]  # the entry's own transfer
    assert got["lynx"] == ({"preset": "lynx", "acceptance": "smollm2-135m-lynx-s1-greedy"},
                           ["monolithic", "split_stream"])
    rows = simulate(cfg)
    acc = {(r["codec"], r["transfer"]): r["acceptance"] for r in rows}
    assert acc[("lynx-2+2+4", "split_stream")] == "smollm2-135m-lynx-2+2+4-s1-greedy"
    assert acc[("lynx-oscar", "layerwise")] == "smollm2-135m-lynx-oscar-s1-greedy"
    assert acc[("int8", "monolithic")] == cfg.speculative.acceptance
    with pytest.raises(ValueError, match="acceptance_files must contain"):
        _slow(["acceptance_files=smollm2-135m-lynx-s1-greedy"])


@pytest.mark.parametrize("key", ["trace_path", "requests_path"])
def test_sim_output_paths_are_refused_not_ignored(key: str):
    with pytest.raises(ValueError, match=f"{key} is a `kvsim sim` output"):
        _slow([f"{key}=/tmp/never-written.csv"])


def test_a_ranking_of_drawn_times_averages_enough_samples(tmp_path, capsys):
    """samples=1 with split-stream candidates that draft: one acceptance draw would decide
    the ranking; advise raises samples to min_samples and says so. Deterministic candidates
    keep samples=1."""
    from kvsim.advise.rank import candidate_policies
    from kvsim.scenario.samples import enough_samples

    def raised(cfg) -> str:
        return enough_samples(cfg, [p for _, ps in candidate_policies(cfg) for p in ps])

    cfg = _slow(["codecs=[int8,lynx]", "transfer=[monolithic,split_stream]"])
    note = raised(cfg)
    assert cfg.samples == 8 and "speculative acceptance" in note
    cfg = _slow([])  # bf16 / int8 / int4 monolithic: nothing drawn
    assert raised(cfg) == "" and cfg.samples == 1
    cfg = _slow(["codecs=[int8,lynx]", "transfer=[monolithic,split_stream]", "min_samples=1"])
    assert raised(cfg) == "" and cfg.samples == 1
    report = tmp_path / "advice.json"
    assert main(["advise", *SLOW, "codecs=[int8,lynx]", "transfer=[monolithic,split_stream]",
                 "min_samples=3", f"report={report}"]) == 0
    assert "samples=1 raised to 3" in capsys.readouterr().err
    rows = json.loads(report.read_text())["rows"]
    assert rows and all(r["samples"] == 3 for r in rows)


def test_ties_are_shown_as_ties_and_the_reason_is_one_sentence_then_details(capsys):
    """Candidates within tie_s are marked `tie` in the rank column (their order is the tie
    rule's, not the time column's), and the reason prints as a sentence plus detail lines."""
    from kvsim.advise.floor import CodecQuality
    from kvsim.advise.rank import Advice, advise

    cfg = _slow(["tie_s=1.0"])
    rows = [{"codec": c, "transfer": "monolithic", "total_bytes": b, "ttft_s": t,
             "ttft_committed_s": t, "ttkt_s": {32: t + 1}, "ttkt_committed_s": {32: t + 1},
             "streams": 1} for c, b, t in (("int8", 2.0, 1.00), ("int4", 1.0, 1.05),
                                            ("bf16", 4.0, 3.0))]
    q = {c: CodecQuality(c, v, None, "test") for c, v in (("int8", 1e-5), ("int4", 1e-4),
                                                    ("bf16", 0.0))}
    got: Advice = advise(cfg, rows, q)
    status = {c.codec: (c.rank, c.tied) for c in got.candidates}
    assert status == {"int8": (1, True), "int4": (2, True), "bf16": (3, False)}
    head, *details = got.reason_lines
    assert head.startswith("int8 / monolithic ties for the shortest committed TT32T") and details
    assert all(len(line) < 120 for line in got.reason_lines)
