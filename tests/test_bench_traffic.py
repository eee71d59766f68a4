"""`esftctl bench serve`'s traffic (issue 29, item 1): S-LoRA's power-law shares drawn per request follow alpha,
the same run draws the same requests for every server, Gamma arrivals through vLLM's own generator have the
asked coefficient of variation, and each run's per-request numbers (prefill and decode speed, arrivals' cv)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest

from esftctl.bench.load import (
    Load,
    alone,
    bench_args,
    floors,
    per_request,
    prefill_modes,
    prefill_stalls,
    request_ratios,
    routed,
    speeds,
)
from esftctl.bench.traffic import (
    burstiness,
    check_shares,
    chi2_survival,
    draw_adapters,
    gaps_cv,
    run_seed,
    slora_shares,
)

DRAWS = 20000


def test_slora_shares_are_s_loras_power_law():
    assert slora_shares(4, 1.0) == [0.25] * 4  # alpha 1 is uniform
    assert slora_shares(2, 0.3) == pytest.approx([0.5 ** 0.3, 1 - 0.5 ** 0.3])  # ExpertWeave's "about 80%"
    assert slora_shares(20, 0.1)[0] == pytest.approx(0.741, abs=1e-3)
    for n, alpha in ((20, 0.6), (10, 0.3), (5, 0.1)):
        shares = slora_shares(n, alpha)
        assert sum(shares) == pytest.approx(1) and shares == sorted(shares, reverse=True)  # the first the most


@pytest.mark.parametrize("n, alpha", [(20, 1.0), (20, 0.6), (20, 0.3), (20, 0.1), (5, 0.3), (2, 0.1)])
def test_drawn_shares_match_alpha(n, alpha):
    """20,000 draws at a fixed seed: every adapter's count within 4.5 standard errors of n x share, and Pearson's
    chi-square not below its 0.1% point."""
    check = check_shares(draw_adapters(n, alpha, DRAWS, seed=(7, n)), slora_shares(n, alpha))
    assert sum(check.counts) == DRAWS and len(check.counts) == n
    assert check.worst_z < 4.5 and check.p_value > 1e-3, check.to_json()


def test_the_share_check_fails_a_draw_of_another_alpha():
    """The check above could fail: draws at alpha 0.3 are far from alpha 0.6's shares, and from uniform."""
    drawn = draw_adapters(20, 0.3, DRAWS, seed=(7, 20))
    for wrong in (0.6, 1.0):
        check = check_shares(drawn, slora_shares(20, wrong))
        assert check.worst_z > 10 and check.p_value < 1e-9


def test_every_server_gets_the_same_draw():
    seed = run_seed(repeat=1, adapters=5, alpha=0.3, rate=2.0)
    assert draw_adapters(5, 0.3, 100, seed) == draw_adapters(5, 0.3, 100, seed)
    others = {run_seed(repeat=r, adapters=5, alpha=a, rate=q) for r in (0, 1) for a in (0.3, 1.0)
              for q in (2.0, math.inf)}
    assert len(others) == 8  # another repeat, alpha or rate: another draw
    assert all(len(draw_adapters(5, 0.3, 10, other)) == 10 for other in others)
    assert draw_adapters(5, 0.3, 100, seed) != draw_adapters(5, 0.3, 100, run_seed(repeat=2, adapters=5, alpha=0.3,
                                                                                   rate=2.0))
    assert set(draw_adapters(1, 0.3, 50, seed)) == {0}


def test_chi2_survival_matches_the_tables():
    assert chi2_survival(3.841, 1) == pytest.approx(0.05, abs=2e-4)
    assert chi2_survival(18.307, 10) == pytest.approx(0.05, abs=2e-4)
    assert chi2_survival(0.0, 19) == 1.0 and chi2_survival(5.0, 0) == 1.0


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_gamma_arrivals_through_vllms_generator_have_the_asked_cv(cv, monkeypatch):
    """vLLM's own get_request (what `vllm bench serve` sends by), on a simulated clock: the gaps between 50,000
    requests have coefficient of variation cv within 5%, and the run lasts requests / rate."""
    import vllm.benchmarks.serve as vllm_bench

    clock = [0.0]

    async def sleep(seconds: float) -> None:
        clock[0] += seconds

    monkeypatch.setattr(vllm_bench, "time", SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.setattr(vllm_bench, "asyncio", SimpleNamespace(sleep=sleep))
    np.random.seed(0)  # as vLLM's main seeds it with --seed
    sent = []

    async def collect() -> None:
        async for _request, _rate in vllm_bench.get_request([SimpleNamespace(timestamp=None)] * 50000, 5.0,
                                                            burstiness(cv)):
            sent.append(clock[0])

    asyncio.run(collect())
    assert gaps_cv(sent) == pytest.approx(cv, rel=0.05)
    assert sent[-1] == pytest.approx(50000 / 5.0, rel=1e-6)


def test_load_arguments_parse_in_vllms_benchmark(tmp_path):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    load = Load(rate=2.0, prompts=3, input_len=24, output_len=8, seed=3, cv=2.0, concurrency=1)
    args = parser.parse_args(bench_args("http://127.0.0.1:1", model="base", tokenizer=tmp_path, load=load,
                                        models=["a", "a", "b"], result_dir=tmp_path, result_file="r.json"))
    assert args.request_rate == 2.0 and args.num_prompts == 3 and args.seed == 3 and args.burstiness == 0.25
    assert (args.random_input_len, args.random_output_len, float(args.random_range_ratio)) == (24, 8, 0.0)
    assert args.lora_modules == ["a", "a", "b"] and args.lora_assignment == "round-robin"  # request k: entry k
    assert args.temperature == 0 and args.ignore_eos and args.save_detailed and args.max_concurrency == 1
    assert set(args.percentile_metrics.split(",")) == {"ttft", "tpot", "itl", "e2el"}
    with pytest.raises(ValueError, match="one per request"):
        bench_args("http://127.0.0.1:1", model="base", tokenizer=tmp_path, load=load, models=["a"],
                   result_dir=tmp_path, result_file="r.json")


def test_routes_send_each_model_to_its_server(monkeypatch):
    from vllm.benchmarks.lib import endpoint_request_func as funcs

    seen = []

    async def plain(request_func_input, session, pbar=None):
        seen.append(request_func_input.api_url)

    monkeypatch.setitem(funcs.ASYNC_REQUEST_FUNCS, "openai", plain)
    request = funcs.RequestFuncInput(prompt="x", api_url="http://127.0.0.1:1/v1/completions", prompt_len=1,
                                     output_len=1, model="merged-1")
    with routed({"merged-0": "http://127.0.0.1:7", "merged-1": "http://127.0.0.1:8/"}):
        asyncio.run(funcs.ASYNC_REQUEST_FUNCS["openai"](request, None))
    assert seen == ["http://127.0.0.1:8/v1/completions"] and funcs.ASYNC_REQUEST_FUNCS["openai"] is plain


def test_speeds_from_per_request_times():
    result = {"ttfts": [0.1, 0.2, 0.0], "input_lens": [100, 100, 100], "output_lens": [5, 5, 5],
              "itls": [[0.01] * 4, [0.02] * 4, []], "start_times": [0.0, 1.0, 3.0, 4.0],
              "total_input_tokens": 300, "total_output_tokens": 15}
    out = speeds(result)
    assert out["median_prefill_tps"] == pytest.approx(750) and out["p1_prefill_tps"] == pytest.approx(505)
    assert out["median_decode_tps"] == pytest.approx(75) and out["p1_decode_tps"] == pytest.approx(50.5)
    assert out["arrival_cv"] == pytest.approx(np.std([1, 2, 1]) / (4 / 3))
    assert speeds({})["median_prefill_tps"] is None and speeds({})["arrival_cv"] is None


def test_a_prompt_prefilled_beside_decodes_stalls_them_by_the_longest_gap_before_its_first_token():
    # r0 decodes from 0.1 s in 10 ms steps, except an 80 ms one (0.60-0.68 s: r1's prefill, r1 arrived at 0.55 s)
    # and a 3 ms one after it, before r1's first token at 0.684 s; r3 (sent at 0.12 s, first token at 0.22 s, beside
    # r0's 10 ms steps) decodes in 5 ms steps and saw that prefill as 40 ms; r2 comes alone later
    r0_gaps = [0.01] * 50 + [0.08, 0.003] + [0.01] * 20
    r3_gaps = [0.005] * 84 + [0.04, 0.003] + [0.005] * 20
    result = {"start_times": [0.0, 0.55, 5.0, 0.12], "ttfts": [0.1, 0.134, 0.1, 0.1],
              "itls": [r0_gaps, [0.01] * 3, [0.01] * 3, r3_gaps]}
    assert alone(result) == [True, False, True, False]
    assert prefill_stalls(result)["median_stall_ms"] == pytest.approx((80.0 + 10.0) / 2)  # r1: 80 (not 40); r3: 10
    apart = {**result, "start_times": [0.0, 2.0, 5.0, 7.0]}
    assert prefill_stalls(apart)["median_stall_ms"] is None  # all alone
    assert prefill_stalls({"ttfts": [0.1]}) == {"median_stall_ms": None}  # no per-request times: unknown


def test_ttft_is_split_by_what_each_prompt_met():
    # r0 alone (r1 comes after its first token); r1 beside r0's decode; r2 alone; r3 beside r2; r4 failed
    result = {"start_times": [0.0, 0.5, 3.0, 3.2, 10.0], "ttfts": [0.1, 0.3, 0.05, 0.2, 0.0],
              "latencies": [1.0, 1.0, 0.5, 1.0, 0.0]}
    assert alone(result) == [True, False, True, False, False]
    assert prefill_modes(result) == {"alone_share": 0.4, "median_ttft_alone_ms": pytest.approx(75),
                                     "median_ttft_beside_ms": pytest.approx(250)}
    kept = per_request({**result, "start_times": [s + 100 for s in result["start_times"]]})
    assert kept["start_s"] == [0.0, 0.5, 3.0, 3.2, 10.0] and kept["ttft_ms"] == [100.0, 300.0, 50.0, 200.0, 0.0]
    assert kept["alone"] == [True, False, True, False, False] and kept["latency_ms"][1] == 1000.0
    assert prefill_modes({"ttfts": [0.1]}) == dict.fromkeys(("alone_share", "median_ttft_alone_ms",
                                                             "median_ttft_beside_ms"))  # no start times: unknown
    assert prefill_modes({**result, "ttfts": [0.1, 0.3, 0.05, 0.2, 0.1], "start_times": [0.0] * 5,
                          "latencies": [1.0] * 5})["alone_share"] == 0.0  # all at once: none alone
    gaps = [[(lat - t) / 4] * 4 for t, lat in zip(result["ttfts"], result["latencies"])]
    streamed = {k: v for k, v in result.items() if k != "latencies"} | {"itls": gaps}  # vLLM 0.25 keeps no latencies
    assert alone(streamed) == alone(result) and per_request(streamed)["latency_ms"][1] == 1000.0


def test_the_fastest_tenth_of_a_run_comes_from_its_kept_requests():
    # ten requests of 5 tokens (4 gaps): TPOT 1..10 ms; lone prompts' TTFT 20, 22, 24, 26; one failed request
    ttfts = [20.0, 30.0, 22.0, 31.0, 24.0, 32.0, 26.0, 33.0, 34.0, 35.0, 0.0]
    kept = {"ttft_ms": ttfts, "latency_ms": [t + 4 * (i + 1) for i, t in enumerate(ttfts[:10])] + [0.0],
            "alone": [True, False] * 3 + [True] + [False] * 3 + [True]}
    out = floors(kept, output_len=5)
    assert out["p10_tpot_ms"] == pytest.approx(np.percentile(range(1, 11), 10))  # 1.9: the failed one left out
    assert out["p10_ttft_alone_ms"] == pytest.approx(np.percentile([20, 22, 24, 26], 10))
    assert floors({}, output_len=5) == {"p10_tpot_ms": None, "p10_ttft_alone_ms": None}  # slices that kept none
    assert floors(kept, output_len=1)["p10_tpot_ms"] is None  # one token: no TPOT


def test_requests_pair_with_the_same_requests_of_the_base_run_of_their_round():
    # four requests of 5 tokens (4 gaps); the run: TTFT +10% each, TPOT 2 ms against the base's 1 ms, and its third
    # request failed; both prefilled the first two alone, only the base the third
    base = {"start_s": [0.0, 1.0, 2.0, 3.0], "ttft_ms": [20.0, 30.0, 40.0, 50.0],
            "latency_ms": [24.0, 34.0, 44.0, 54.0], "alone": [True, True, True, False]}
    run = {"start_s": [0.0, 1.001, 2.0, 2.999], "ttft_ms": [22.0, 33.0, 0.0, 55.0],
           "latency_ms": [30.0, 41.0, 0.0, 63.0], "alone": [True, True, False, False]}
    out = request_ratios(run, base, output_len=5)
    assert out["ttft"] == pytest.approx([1.1, 1.1, 1.1]) and out["ttft_alone"] == pytest.approx([1.1, 1.1])
    assert out["tpot"] == pytest.approx([2.0, 2.0, 2.0])
    each = request_ratios(run, base, output_len=5, aligned=True)  # one entry per request, in the order sent
    assert each["ttft"] == pytest.approx([1.1, 1.1, None, 1.1]) and each["ttft_alone"][2:] == [None, None]
    nothing = {"ttft": [], "ttft_alone": [], "tpot": []}
    assert request_ratios({**run, "start_s": [0.0, 1.5, 2.0, 3.0]}, base, output_len=5) == nothing  # other traffic
    assert request_ratios({k: v[:3] for k, v in run.items()}, base, output_len=5) == nothing  # other count
    assert request_ratios({}, base, output_len=5) == nothing  # a slice that kept no requests
    assert request_ratios(run, base, output_len=1)["tpot"] == []  # one token: no TPOT
