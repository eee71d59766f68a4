"""benchmarks/lab/side_by_side.py's arithmetic: esftctl set against plain vLLM's runs before and after it
(pooled), plain vLLM's second run against its first, request by request."""

from __future__ import annotations

import pytest
from conftest import load_script


def _run(ttft: float, tpot: float, alone=(True, True, False, False), tokens: int = 4) -> dict:
    return {"start_s": [0.0, 1.0, 2.0, 3.0], "ttft_ms": [ttft] * 4, "latency_ms": [ttft + tokens * tpot] * 4,
            "alone": list(alone)}


def test_esftctl_pools_both_plain_runs_of_its_round_and_plain_is_set_against_itself():
    script = load_script("side_by_side")
    # round 0: plain 20 ms then 24 ms (the minute moved it), esftctl 22; round 1 the same without the drift
    rounds = [{"plain": _run(20.0, 1.0), "esftctl": _run(22.0, 1.0), "plain again": _run(24.0, 1.2)},
              {"plain": _run(20.0, 1.0), "esftctl": _run(22.0, 1.0), "plain again": _run(20.0, 1.0)}]
    out = script.summarize(rounds, output_len=5)
    esft, plain = out["esftctl / plain"], out["plain again / plain"]
    assert esft["pairs"] == 16 and plain["pairs"] == 8  # 4 requests x 2 plain runs x 2 rounds; 4 x 2
    # esftctl: 1.1 against 20 ms (12 pairs), 22/24 against 24 ms (4): the median 1.1, its interval reaching down to
    # 22/24 where the bootstrap draws round 0 twice
    assert esft["ttft"][0] == pytest.approx(1.1) and esft["ttft"][1] == pytest.approx(22 / 24)
    assert esft["tpot"][0] == pytest.approx(1.0) and esft["tpot"][1] == pytest.approx(1 / 1.2)
    assert plain["ttft"][0] == pytest.approx((1.2 + 1.0) / 2) and plain["ttft"][2] == pytest.approx(1.2)
    assert esft["ttft_alone"][0] == pytest.approx(1.1)  # the two prompts both prefilled alone, each pair
    table = script.table({2.0: out}, rounds=2)
    assert [c.header for c in table.columns][3:] == ["TTFT x", "TTFT x, both alone", "TPOT x"]



def test_each_arms_machine_is_its_median_over_rounds():
    script = load_script("side_by_side")
    rounds = [{arm: _run(20.0, 1.0) | {"machine": {"gpu_sm_mhz": mhz, "gpu_idle_share": 0.5, "host_steal": steal}}
               for arm, mhz, steal in (("plain", 1900.0, 0.01), ("esftctl", 1500.0, 0.02), ("plain again", 1980.0,
                                                                                            None))}
              for _ in range(3)]
    rounds[0]["esftctl"]["machine"]["gpu_sm_mhz"] = 900.0  # one slow round does not move the median
    machines = script.machine(rounds)
    assert machines["esftctl"]["gpu_sm_mhz"] == 1500.0 and machines["plain"]["gpu_sm_mhz"] == 1900.0
    assert machines["plain again"]["host_steal"] is None and machines["esftctl"]["gpu_sm_mhz_p10"] is None
    assert script.summarize(rounds, output_len=5)["esftctl / plain"]["ttft"][0] == pytest.approx(1.0)
    table = script.machine_table({1.0: machines})
    assert [c.header for c in table.columns] == ["rate", "arm", "SM MHz", "SM p10", "GPU busy %", "idle", "slowed",
                                                "steal"]
    assert table.row_count == 3


def test_where_ttft_went_splits_the_client_mean_by_vllms_histograms_and_takes_each_arms_median():
    script = load_script("side_by_side")
    means = {"server_queue_ms": 0.5, "server_prefill_ms": 18.0, "server_ttft_ms": 21.0, "server_decode_ms": 400.0}
    split = script.server_split(means, 24.0)
    assert split == pytest.approx({"ttft_ms": 24.0, "queue_ms": 0.5, "prefill_ms": 18.0, "api_ms": 2.5,
                                   "outside_ms": 3.0})
    missing = script.server_split({"server_queue_ms": None, "server_prefill_ms": 18.0, "server_ttft_ms": 21.0}, None)
    assert missing["api_ms"] is None and missing["outside_ms"] is None and missing["prefill_ms"] == 18.0
    rounds = [{arm: {"server": script.server_split(means | {"server_prefill_ms": prefill}, 24.0 + extra)}
               for arm, prefill, extra in (("plain", 18.0, 0.0), ("esftctl", 20.0 + r, 2.0 + r), ("plain again", 18.0,
                                                                                                    0.0))}
              for r in (0.0, 0.5, 3.0)]
    splits = script.where(rounds)
    assert splits["esftctl"]["prefill_ms"] == 20.5 and splits["esftctl"]["ttft_ms"] == 26.5
    assert splits["esftctl"]["api_ms"] == pytest.approx(0.0)  # each key's own median: 21 - 0.5 - 20.5, the middle
    assert splits["plain"]["outside_ms"] == pytest.approx(3.0)
    table = script.where_table({2.0: splits})
    assert [c.header for c in table.columns] == ["rate", "arm", "TTFT", "queue", "prefill", "API server", "outside"]
    assert table.row_count == 3


def test_a_split_that_leaves_a_server_no_room_is_refused_before_any_start():
    """DeepSeek-V2-Lite's 29.3 GiB base twice: with 5 adapters' 9.5 GiB at a 0.95 share of an 80 GB H100 both
    servers keep 3.8 GiB past their weights; with 20 adapters' 37.9 GiB neither holds its base; the CPU build's
    arguments carry no share and are not checked."""
    from esftctl.bench.serve import split_memory

    script = load_script("side_by_side")
    gib, card, weights = 2**30, 81559 * 2**20, int(29.26 * 2**30)
    engine = ("--max-model-len", "4096", "--gpu-memory-utilization", "0.95")
    for adapters, fits in ((9.5, True), (37.9, False)):
        aside = {"plain": 0, "esftctl": int(adapters * gib)}
        args = dict(zip(aside, split_memory(engine, list(aside.values()), card=card)))
        if fits:
            script.check_room(args, aside, weights, card=card)
        else:
            with pytest.raises(SystemExit, match=r"side_by_side: plain would have -\d+\.\d GiB past the base's 29\.3"):
                script.check_room(args, aside, weights, card=card)
    script.check_room({"plain": ["--max-model-len", "256"]}, {"plain": 0}, weights, card=0)


def test_the_trade_is_each_runs_median_p99_and_throughput_and_esftctl_over_both_plain_runs_a_round_at_a_time():
    """Issue 29's trade table (TTFT and TPOT median and p99, output tok/s): from each run's requests, plain vLLM's
    two runs of a round averaged, esftctl's ratio taken a round at a time, [median, lowest, highest] over rounds."""
    script = load_script("side_by_side")
    run = {"start_s": [0.0, 1.0, 2.0, 3.0, 3.5], "ttft_ms": [10.0, 20.0, 30.0, 40.0, 0.0],
           "latency_ms": [14.0, 24.0, 34.0, 1000.0, 0.0], "alone": [True] * 5}  # the last request failed
    n = script.run_numbers(run, output_len=5)
    assert n["ttft_p50"] == 25.0 and n["ttft_p99"] == pytest.approx(30.0 + 0.97 * 10.0)  # linear, as vLLM's
    waves = {"start_s": [0.0] * 4, "ttft_ms": [10.0, 10.0, 11.0, 100.0], "latency_ms": [20.0, 20.0, 21.0, 110.0]}
    assert script.run_numbers(waves, 5)["ttft_mean"] == pytest.approx(32.75)  # the second wave's weight, not 10.5
    assert n["tpot_p50"] == 1.0 and n["tpot_p99"] == pytest.approx(1.0 + 0.97 * 239.0)
    assert n["tok_s"] == pytest.approx(4 * 5 / 4.0)  # 4 requests of 5 tokens from 0 s to the last finish at 4 s
    assert script.run_numbers({"start_s": [0.0], "ttft_ms": [0.0], "latency_ms": [0.0]}, 5)["tpot_p50"] is None
    rounds = [{"plain": _run(20.0, 1.0), "esftctl": _run(22.0, 1.1), "plain again": _run(24.0, 1.2)},
              {"plain": _run(20.0, 1.0), "esftctl": _run(22.0, 1.1), "plain again": _run(20.0, 1.0)}]
    out = script.trade(rounds, output_len=5)
    assert out["plain"]["tpot_p50"] == pytest.approx(1.05)  # 1.1 and 1.0, the two rounds' means of both plain runs
    assert out["esftctl / plain"]["tpot_p50"] == pytest.approx([1.05, 1.0, 1.1])
    assert out["esftctl / plain"]["ttft_p99"] == pytest.approx([1.05, 1.0, 1.1])
    assert out["esftctl / plain"]["ttft_mean"] == pytest.approx([1.05, 1.0, 1.1])
    assert out["esftctl / plain"]["tok_s"][0] < 1  # esftctl's requests end later, over the same sends
    assert script.ranged([1.05, 1.0, 1.1]) == "1.050 [1.000-1.100]" and script.ranged([1.0, 1.0, 1.0]) == "1.000"


def test_report_rereads_each_settings_json_and_names_a_file_that_is_not_one(tmp_path, capsys):
    """`--report`: the tables again from kept runs, the trade included for a run that predates it; one line naming
    a file that is not side_by_side's."""
    import json

    script = load_script("side_by_side")
    rnd = {"plain": _run(20.0, 1.0), "esftctl": _run(22.0, 1.0), "plain again": _run(20.0, 1.0)}
    kept = (("side_by_side.json", {}), ("side_by_side-groups-2.json", {"group_adapters": "2", "group_wait": "8"}),
            ("side_by_side-admit-10.json", {"group_adapters": "0", "group_wait": "8", "admit_by_adapter": "10.0"}),
            ("side_by_side-max-loras-2.json", {"group_adapters": "0", "admit_by_adapter": "0.0", "max_loras": "2"}))
    for name, args in kept:  # the first as kept before the settings had flags
        (tmp_path / name).write_text(json.dumps({"args": {"model": "tiny"} | args, "rounds": {"5": [rnd, rnd]}}))
    results = script.reread([tmp_path])
    # ungrouped first, though its file sorts last
    assert [script.setting(r) for r in results] == ["", " (esftctl --max-loras 2)", " (esftctl --admit-by-adapter 10)",
                                                     " (esftctl --group-adapters 2 --group-wait 8)"]
    assert [script.out_file(tmp_path, script.setting_of(r)).name for r in results] == [
        "side_by_side.json", "side_by_side-max-loras-2.json", "side_by_side-admit-10.json",
        "side_by_side-groups-2.json"]
    assert results[1]["trade"]["5"]["esftctl / plain"]["ttft_p50"] == pytest.approx([1.1, 1.1, 1.1])
    assert script.trade_table(results).row_count == 12  # plain, esftctl and their ratio, per setting
    (tmp_path / "notes.json").write_text(json.dumps({"args": {"model": "tiny"}}))
    with pytest.raises(SystemExit, match=r"notes\.json: not side_by_side\.py's JSON \(KeyError"):
        script.reread([tmp_path])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"empty: no \.json files"):
        script.reread([tmp_path / "empty"])
    with pytest.raises(SystemExit, match=r"nothing: file not found"):
        script.reread([tmp_path / "nothing"])
