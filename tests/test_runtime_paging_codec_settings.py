"""`serve --paging-codec`: the compressed GPU tier's choice as a typed setting, from the CLI to the engine's
processes (ServeSettings -> ServeConfig's environment -> the worker), and the one-line refusals of combinations
that cannot work (fixed with a store, huffman without one, a codec without a window, variants)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from esftctl.errors import EsftError
from esftctl.runtime.serve_config import ServeConfig, ServeSettings


def test_the_codec_crosses_to_the_engine_and_resolves_the_tier(tmp_path, monkeypatch):
    fixed = ServeSettings(base=tmp_path, paging_window=2, paging_codec="fixed", store_experts=5)
    config = ServeConfig(settings=fixed, slots=1, experts_per_slot=2, status_file=str(tmp_path / "s.json"))
    for key, value in config.to_env().items():
        monkeypatch.setenv(key, value)
    back = ServeConfig.from_env().settings
    assert back == fixed and back.compressed_tier == "fixed" and back.store_experts == 5
    assert ServeSettings(base=tmp_path, paging_window=1, paging_store=tmp_path).compressed_tier == "huffman"
    assert ServeSettings(base=tmp_path, paging_window=1, paging_store=tmp_path,
                         paging_codec="huffman").compressed_tier == "huffman"
    assert ServeSettings(base=tmp_path, paging_window=1).compressed_tier is None
    assert ServeSettings(base=tmp_path, paging_window=1, paging_codec="fixed-host").compressed_tier == "fixed-host"


@pytest.mark.parametrize("options,message", [
    ({"paging_window": 1, "paging_codec": "fixed", "paging_store": Path("s")}, "drop --paging-store"),
    ({"paging_window": 1, "paging_codec": "fixed-host", "paging_store": Path("s")}, "drop --paging-store"),
    ({"paging_window": 1, "paging_codec": "huffman"}, "give --paging-store STORE"),
    ({"paging_window": 1, "paging_codec": "zstd"}, "--paging-codec zstd: choose huffman"),
    ({"paging_codec": "fixed"}, "need --paging-window"),
    ({"paging_window": 1, "store_experts": 2}, "--store-experts needs --paging-store"),
])
def test_bad_codec_settings_are_refused_in_one_line(tmp_path, options, message):
    with pytest.raises(EsftError, match=message):
        ServeSettings(base=tmp_path, **options)


def test_fixed_with_variants_is_refused(tmp_path):
    with pytest.raises(EsftError, match="--paging-codec fixed keeps the base's own experts"):
        ServeSettings(variants=tmp_path, paging_window=1, paging_codec="fixed")


def test_the_cli_refuses_fixed_with_a_store_before_starting_anything(tmp_path):
    proc = run_cli("serve", tmp_path, "--paging-window", "1", "--paging-codec", "fixed", "--paging-store", tmp_path)
    assert proc.returncode == 1 and "--paging-codec fixed encodes the base" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
