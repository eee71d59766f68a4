"""`esftctl bench train` (issue 86, item 4) on a tiny DeepSeek-V2 shape on the CPU: every method trains in a process
of its own over the same batches, and the numbers it reports are the ones the runs had. The GPU numbers come from
the device run (benchmarks/RESULTS.md); here the machinery is checked, not the speed."""

import pytest

from esftctl.bench import train as bench

TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, vocab_size=3000, bos_token_id=0, eos_token_id=1, pad_token_id=2)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return bench.run("deepseek-v2-lite", 3, ("esft-token", "fft", "lora"), steps=4, warmup=1, batch_size=2,
                     prompt_len=6, completion_len=6, examples=12, config_overrides=TINY,
                     work=tmp_path_factory.mktemp("work"))


def test_every_method_reports_what_its_run_trained_and_stored(result):
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"esft-token", "fft", "lora"} and not any("error" in r for r in rows.values())
    esft, fft, lora = rows["esft-token"], rows["fft"], rows["lora"]
    assert fft["trained_parameters"] == fft["model_parameters"] == esft["model_parameters"]
    # ESFT trains the selected experts' rows: 3 x 32 x 64 parameters an expert, nothing else
    assert esft["experts"] > 0 and esft["trained_parameters"] == esft["experts"] * 3 * 32 * 64
    # its bundle is those experts in bf16 plus a header and manifest, not a model
    assert esft["expert_bytes"] == esft["experts"] * 3 * 32 * 64 * 2
    assert esft["expert_bytes"] < esft["stored_bytes"] < esft["expert_bytes"] + 64 * 1024
    assert fft["stored_bytes"] == 2 * fft["model_parameters"]
    assert 0 < lora["trained_parameters"] < fft["trained_parameters"]
    for r in rows.values():
        # 4 steps of 2 examples of the same length (12 words and the specials), none of it padding
        assert r["tokens"] % 8 == 0 and 12 <= r["tokens"] // 8 <= 16
        assert r["tokens_per_second"] > 0 and r["peak_gb"] is None


def test_the_methods_see_the_same_tokens(result):
    assert len({r["tokens"] for r in result["rows"]}) == 1


def test_the_table_and_plot_render(result, tmp_path):
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(bench.table(result))
    text = console.export_text()
    assert "esft-token" in text and "1.00x" in text  # fft's own ratio
    bench.plot(result, tmp_path / "tmp-plot")  # the temporary name esftctl's atomic write gives: no extension
    assert (tmp_path / "tmp-plot").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_refuses_bad_options_in_one_line():
    import torch
    from conftest import run_cli

    cases = [(["--methods", "esft-token,qlora"], "unknown 'qlora'"), (["--model", "mixtral"], "--model"),
             (["--steps", "3"], "at least --warmup + 2")]
    if not torch.cuda.is_available():
        cases.append(([], "no CUDA GPU"))
    for args, says in cases:
        r = run_cli("bench", "train", *args)
        assert r.returncode == 1 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
