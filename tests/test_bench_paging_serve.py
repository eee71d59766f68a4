"""`esftctl bench paging --serve` (esftctl.bench.serve_paging) without a GPU: the scenario matrix, the arguments each
server gets, the slices' order and resumption, the merged report, and what is parsed from vLLM."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from esftctl.bench import serve_paging as sp
from esftctl.bench import slices
from esftctl.bench.slices import anchored
from esftctl.bench.synthetic_model import qwen3_30b_a3b_config, write_model

SMALL_QWEN3 = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                   num_experts_per_tok=2, bos_token_id=500, eos_token_id=501, pad_token_id=502)


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory):
    """Qwen3-30B-A3B's structure at a small size, through the generator the device runs."""
    return write_model(tmp_path_factory.mktemp("qwen3") / "base", qwen3_30b_a3b_config(**SMALL_QWEN3), seed=0,
                       shard_bytes=1 << 20)


def test_full_size_qwen3_config_is_qwen3_30b_a3b():
    from esftctl.bench.synthetic_model import QWEN3_SERVED_LAYERS, _numel, checkpoint_tensors

    sizes = {layers: sum(2 * _numel(s) for _, s in checkpoint_tensors(qwen3_30b_a3b_config(num_hidden_layers=layers)))
             for layers in (48, QWEN3_SERVED_LAYERS)}
    assert 60e9 < sizes[48] < 62e9  # ~61 GB of bf16, as the issue says
    assert sizes[QWEN3_SERVED_LAYERS] < 0.9 * sp.CARD_BYTES < sizes[48]  # resident fits the emulated card; 48 not


def test_every_regime_names_known_servers_and_the_anchors_first():
    for regime in sp.REGIMES.values():
        specs = [sp.server_spec(s) for s in regime.servers]
        assert specs[0].name in ("vllm", "resident") and all(p.concurrency <= regime.max_num_seqs
                                                             for p in regime.points)
        assert regime.anchor in regime.servers[:2]
    assert sp.server_spec("host+adapters").adapters == sp.ADAPTERS and sp.server_spec("host").adapters == 0
    for bad in ("vllm+adapters", "nope", "host+other"):
        with pytest.raises(ValueError):
            sp.server_spec(bad)
    bound = sp.REGIMES["memory-bound"]
    assert bound.points[0].concurrency == 256 and bound.points[0].input_len + bound.points[0].output_len == 4096
    assert {"compressed", "host", "adaptive", "compressed+adapters"} <= set(bound.servers)
    assert {p.concurrency for p in sp.REGIMES["spare"].points} == {1, 32}


def test_slices_interleave_rounds_and_resume(tmp_path):
    order = sp.slice_order({"spare": ("vllm", "resident", "host")}, rounds=3)
    assert [s.server for s in order] == ["vllm", "resident", "host", "resident", "host", "vllm", "host", "vllm",
                                         "resident"]
    assert [s.round for s in order] == [0] * 3 + [1] * 3 + [2] * 3
    done = order[0].path(tmp_path, "m")
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"wall_s": 700}))
    assert sp.estimate_s(order[0], tmp_path, "m") == 700  # a measured slice's wall time, once there is one
    assert sp.estimate_s(order[1], tmp_path, "m") == sp.SLICE_ESTIMATE_S["spare"]
    left = sp.run("m", out=tmp_path, work=tmp_path / "w", regimes=("spare",), servers=("vllm", "resident", "host"),
                  rounds=3, budget_s=0)  # nothing fits: nothing starts, no model is generated
    assert left["ran"] == [] and len(left["left"]) == 8 and not (tmp_path / "w").exists()


def test_engine_arguments_emulate_the_card_on_both_sides():
    bound = sp.engine_args(sp.REGIMES["memory-bound"], total_bytes=80 * 10**9)
    assert bound[bound.index("--gpu-memory-utilization") + 1] == "0.6000"
    assert bound[bound.index("--max-num-seqs") + 1] == "256" and "--enforce-eager" not in bound  # graphs on
    assert "--gpu-memory-utilization" not in sp.engine_args(sp.REGIMES["spare"], total_bytes=80 * 10**9)


def test_each_server_gets_its_paging_settings(small_qwen3, tmp_path):
    from esftctl.formats.checkpoint import MoECheckpoint

    layers = len(MoECheckpoint(small_qwen3).moe_layers)
    settings = {name: sp.serve_settings(sp.server_spec(name), moe_layers=layers, experts=8, store=tmp_path)
                for name in sp.SERVERS}
    assert settings["vllm"] == settings["resident"] == {}
    assert settings["compressed"] == {"paging_window": sp.WINDOW, "paging_adaptive": False, "paging_store": tmp_path,
                                      "store_experts": 8}
    assert settings["host"] == {"paging_window": sp.WINDOW, "paging_adaptive": False}
    assert settings["fixed"] == {"paging_window": sp.WINDOW, "paging_adaptive": False, "paging_codec": "fixed",
                                 "store_experts": 8}
    assert settings["adaptive"] == {"paging_window": sp.WINDOW, "paging_adaptive": True, "paging_store": tmp_path}
    assert settings["machinery"]["paging_window"] == settings["machinery-store"]["paging_window"] == layers

    store = sp.ensure_store(small_qwen3, tmp_path / "store", lambda msg: None)
    args = sp.engine_args(sp.REGIMES["spare"], total_bytes=None)
    commands = {}
    for name in ("vllm", "resident", "compressed", "fixed", "machinery", "adaptive"):
        plan = sp.plan_server(sp.server_spec(name), base=small_qwen3, bundles={}, store=store, args=args,
                              state=tmp_path / name, port=8123)
        commands[name] = (plan.command(), plan.settings)
        assert plan.adapter_budget == 0 or not plan.esft  # nothing set aside: resident's KV room is plain vLLM's
    assert "--enable-lora" not in commands["vllm"][0] and "--enable-lora" in commands["resident"][0]
    assert all(c[0][-len(args):] == args for c in commands.values())  # the same vLLM arguments for every server
    assert commands["compressed"][1].store_experts == 8 and commands["compressed"][1].paging_store == store.resolve()
    assert commands["machinery"][1].paging_window == layers  # every MoE layer: accepted, the machinery alone
    assert commands["fixed"][1].paging_codec == "fixed" and commands["fixed"][1].paging_store is None
    with pytest.raises(Exception, match="resident already"):
        from esftctl.serve import plan

        plan(small_qwen3, [], paging_window=layers, paging_adaptive=True)


def _slice(tmp_path, server, rnd, tok_s, *, regime="spare", point="batch 32", kv=1000, tiers=None, device="H100",
           machine=None, part=""):
    """A slice file as run_slice writes it (with no machine: as written before machines were recorded)."""
    path = sp.Slice(regime, server, rnd, part).path(tmp_path, "m")
    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = {"output_throughput": tok_s, "median_ttft_ms": 10.0 * rnd, "p99_ttft_ms": 20.0, "median_tpot_ms": 5.0,
               "p99_tpot_ms": 9.0}
    path.write_text(json.dumps({"model": "m", "regime": regime, "server": server, "round": rnd, "device": device,
                                "kv_cache_tokens": kv, "tiers": tiers or {}, "wall_s": 100,
                                **({"machine": machine} if machine else {}),
                                "points": {point: {**metrics, "preemptions": rnd, "fetch": {}}}}))


def test_report_merges_slices_into_medians_ratios_and_targets(tmp_path):
    for rnd, (vllm, resident, host) in enumerate([(100, 200, 150), (110, 180, 120), (90, 220, 160)]):
        _slice(tmp_path, "vllm", rnd, vllm)
        _slice(tmp_path, "resident", rnd, resident)
        _slice(tmp_path, "host", rnd, host, tiers={"paging_store_bytes": 0, "paging_freed_kv_tokens": 5})
    result = sp.report(tmp_path)
    rows = {r["server"]: r for r in result["rows"]}
    assert [r["server"] for r in result["rows"]] == ["vllm", "resident", "host"]
    assert rows["host"]["rounds"] == 3 and rows["host"]["output_throughput"] == 150
    assert rows["host"]["output_throughput_range"] == [120, 160] and rows["host"]["vs_resident"] == 0.75
    assert rows["resident"]["vs_vllm"] == 2.0 and rows["host"]["preemptions"] == 1
    assert rows["host"]["tiers"]["paging_freed_kv_tokens"] == 5
    (target,) = [t for t in result["targets"] if t["target"] == "spare/batch 32"]
    assert target["server"] == "host" and target["met"] is True
    assert json.loads((tmp_path / "paging_serve.json").read_text())["rows"][2]["server"] == "host"
    sp.tables(result)
    sp.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_report_sets_no_ratio_across_cards(tmp_path):
    _slice(tmp_path, "vllm", 0, 100, device="H200")
    _slice(tmp_path, "resident", 0, 200, device="H100")
    _slice(tmp_path, "host", 0, 150, device="H100")
    _slice(tmp_path, "host", 1, 150, device="H200")
    rows = {r["server"]: r for r in sp.report(tmp_path)["rows"]}
    assert rows["resident"]["vs_vllm"] is None and rows["resident"]["device"] == ["H100"]
    assert rows["host"]["vs_resident"] is None and rows["host"]["device"] == ["H100", "H200"]


def test_report_pairs_rounds_within_a_machine(tmp_path):
    _slice(tmp_path, "resident", 0, 200, machine="A")
    _slice(tmp_path, "resident", 1, 160, machine="B")  # a slower card
    _slice(tmp_path, "host", 0, 150, machine="A")
    _slice(tmp_path, "host", 1, 140, machine="B")
    _slice(tmp_path, "host", 2, 100, machine="C")  # no resident run there: left out
    _slice(tmp_path, "compressed", 0, 170)  # written before machines were recorded: the medians' ratio
    result = sp.report(tmp_path)
    rows = {r["server"]: r for r in result["rows"]}
    host = rows["host"]
    assert host["vs_resident"] == pytest.approx((150 / 200 + 140 / 160) / 2) and host["vs_resident_paired"] == 2
    assert host["vs_resident_range"] == pytest.approx([0.75, 0.875])  # the medians' ratio would be 140 / 180
    unknown = rows["compressed"]
    assert unknown["vs_resident"] == pytest.approx(170 / 180) and unknown["vs_resident_paired"] == 0
    text = io.StringIO()
    Console(file=text, width=400).print(sp.tables(result)[0])
    assert "0.81 " in text.getvalue() and "0.94*" in text.getvalue()


def test_each_machine_runs_the_anchor_of_each_round_first(tmp_path):
    """A slice follows its anchor's run of the same round (the same traffic) on the same machine: the anchor's own
    slice of the round where it is not written yet, else the round once more (on-<machine>); rounds whose anchor
    runs anyway go first."""
    _slice(tmp_path, "resident", 0, 200, machine="A")
    todo = [sp.Slice("spare", "host", 0), sp.Slice("spare", "resident", 1), sp.Slice("spare", "adaptive", 0),
            sp.Slice("machinery", "machinery", 0)]
    anchors = {"spare": ("resident",), "machinery": ("resident",)}

    def order(machine, todo=todo):
        return [(s.group, s.server, s.round, s.part) for s in anchored(todo, out=tmp_path, model="m",
                                                                       machine=machine, anchors=anchors)]
    assert order("A") == [("spare", "host", 0, ""), ("spare", "resident", 1, ""), ("spare", "adaptive", 0, ""),
                          ("machinery", "resident", 0, ""), ("machinery", "machinery", 0, "")]  # A ran spare's r0
    again = ("spare", "resident", 0, slices.copy_part("B"))
    assert order("B") == [("spare", "resident", 1, ""),  # its round's anchor runs anyway: first
                          again, ("spare", "host", 0, ""), ("spare", "adaptive", 0, ""),  # round 0 once more on B
                          ("machinery", "resident", 0, ""), ("machinery", "machinery", 0, "")]
    assert again[3].startswith("on-") and slices.copy_part("B") != slices.copy_part("C")
    assert slices.measured_part(again[3]) == "" and slices.measured_part("n20") == "n20"
    late = [sp.Slice("spare", "host", 1), sp.Slice("spare", "host", 0), sp.Slice("spare", "resident", 1)]
    assert order("B", late) == [("spare", "resident", 1, ""), ("spare", "host", 1, ""),  # the cheap round first
                                again, ("spare", "host", 0, "")]
    _slice(tmp_path, "resident", 0, 190, machine="B", part=again[3])
    assert order("B", todo[:1]) == [("spare", "host", 0, "")]  # B has its run of round 0 now
    _slice(tmp_path, "host", 2, 100, machine="C")
    _slice(tmp_path, "resident", 2, 200, machine="A")  # round 2's anchor ran, but elsewhere
    _slice(tmp_path, "resident", 1, 220, machine="C")  # C ran the anchor, on another round's traffic
    rows = {r["server"]: r for r in sp.report(tmp_path)["rows"]}
    assert rows["host"]["vs_resident_paired"] == 0 and rows["resident"]["rounds"] == 4  # the copy is a run too
    _slice(tmp_path, "resident", 2, 125, machine="C", part=slices.copy_part("C"))
    rows = {r["server"]: r for r in sp.report(tmp_path)["rows"]}
    assert rows["host"]["vs_resident_paired"] == 1 and rows["host"]["vs_resident"] == pytest.approx(100 / 125)


def test_what_is_read_from_vllm():
    log = ("INFO 11-25 [kv_cache_utils.py:1087] GPU KV cache size: 412,160 tokens\n"
           "INFO Maximum concurrency for 4,096 tokens per request: 100.62x\n")
    assert sp.kv_tokens_from_log(log) == 412160 and sp.kv_tokens_from_log("nothing") is None
    metrics = ('# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n'
               'vllm:num_preemptions_total{engine="0",model_name="base"} 17.0\n'
               'vllm:num_preemptions_created{engine="0",model_name="base"} 1.7e9\n')
    assert sp.preemptions(metrics) == 17 and sp.preemptions("") == 0
    before = {"paging_fetches": 10, "paging_fetched_rows": 60}
    after = {"paging_fetches": 30, "paging_fetched_rows": 180, "paging_held_rows": 64,
             "paging_decisions": [{"timed": False, "compute_ms": 0, "load_ms": 1},
                                  {"timed": True, "compute_ms": 0.5, "load_ms": 2.0}]}
    assert sp.fetch_delta(before, after) == {"fetches": 20, "fetched_rows": 120, "rows_per_fetch": 6.0,
                                             "held_rows": 64, "planner_compute_ms": 0.5, "planner_load_ms": 2.0}
    assert sp.fetch_delta(None, after) == {} and sp.tiers(None) == {}


def test_settled_status_holds_every_fetch_of_the_run(monkeypatch):
    """The worker publishes the pager's counters between steps, at most once a second, a copy behind: right after
    a run the status lacks its last fetches; two nudges a second apart bring them in (and nothing of the nudges')."""
    class Worker:  # runtime/vllm/worker.py's publication, PagedExperts.counters(wait=False)'s copy a call behind
        def __init__(self):
            self.clock, self.written, self.total, self.copied, self.published = 0.0, -9.0, 0, 0, 0

        def step(self, fetches):
            if self.clock - self.written > sp.STATUS_EVERY_S:
                self.written, self.published, self.copied = self.clock, self.copied, self.total
            self.total += fetches

    w = Worker()
    for _ in range(50):  # a run: 50 steps of 26 fetches over 2.5 s
        w.step(26)
        w.clock += 0.05
    monkeypatch.setattr(sp, "_status", lambda url: {"paging_fetches": w.published})
    assert sp._status("url")["paging_fetches"] < w.total == 1300  # the run's last second is not in it
    nudges = []

    def pause(seconds):
        w.clock += seconds

    def nudge():
        nudges.append(w.clock)
        w.step(26)
    assert sp.settled_status("url", nudge, pause=pause) == {"paging_fetches": 1300}
    assert len(nudges) == 2 and nudges[1] - nudges[0] > sp.STATUS_EVERY_S
    monkeypatch.setattr(sp, "_status", lambda url: None)  # plain vLLM: no status, no nudge
    assert sp.settled_status("url", lambda: nudges.append("no"), pause=pause) is None and len(nudges) == 2
