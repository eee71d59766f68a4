"""`esftctl bench offline` at a small size: every command runs as a child, is measured, and the disk is probed."""

from __future__ import annotations

import pytest

from esftctl.bench import offline
from esftctl.errors import EsftError

SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, n_routed_experts=8,
             num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=32, v_head_dim=64, bos_token_id=1000,
             eos_token_id=1001, pad_token_id=1002)


def test_every_offline_command_is_measured(tmp_path):
    result = offline.run(layers=3, root=tmp_path / "cache", work=tmp_path / "work", overrides=SMALL,
                         probe_bytes=64 << 20)
    rows = {r["command"]: r for r in result["rows"]}
    assert list(rows) == ["inspect", "pack", "merge", "compress base", "compress bundle", "decompress", "consolidate",
                          "materialize"]
    assert result["moe_layers"] == 2 and result["capacity"] == 8  # half of 2 x 8 positions
    for r in rows.values():
        assert r["seconds"] > 0 and r["peak_rss"] > 20 << 20  # a Python with torch, at least
        assert 0 < r["peak_anon"] <= r["peak_rss"]
    base = offline.tree_bytes(tmp_path / "cache" / "deepseek-v2-lite-3l" / "base")
    assert rows["inspect"]["read_bytes"] == 0 and rows["inspect"]["x_floor"] is None
    assert rows["compress base"]["read_bytes"] == base
    assert rows["compress base"]["full_model_s"] == pytest.approx(rows["compress base"]["seconds"] * 31.4e9 / base)
    assert rows["consolidate"]["read_bytes"] == 3 * offline.tree_bytes(tmp_path / "cache" / "deepseek-v2-lite-3l" /
                                                                       "full-finetune-1")
    assert rows["merge"]["written_bytes"] > base // 2  # a whole checkpoint, then deleted
    for r in rows.values():
        if r["floor_s"]:
            floor = r["read_bytes"] / result["disk"]["read_Bps"] + r["written_bytes"] / result["disk"]["write_Bps"]
            assert r["floor_s"] == pytest.approx(floor) and r["x_floor"] == pytest.approx(r["seconds"] / floor)
    kept = sorted(p.name for p in (tmp_path / "work").iterdir())
    assert kept == ["base.store", "bundle", "map"]  # what later commands read; the rest was deleted once measured
    assert offline.tree_bytes(tmp_path / "work" / "bundle") == rows["pack"]["written_bytes"]


def test_disk_speed_leaves_nothing(tmp_path):
    disk = offline.disk_speed(tmp_path, 64 << 20)
    assert disk["write_Bps"] > 0 and disk["read_Bps"] > 0 and disk["bytes"] == 64 << 20
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_disk_too_small_before_writing(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 10**6, 10**6))
    with pytest.raises(EsftError, match=r"needs .* GB free for 3 layers .* has 0.0 GB"):
        offline.prepare(tmp_path / "cache", 3, lambda msg: None, SMALL)
    assert not (tmp_path / "cache").exists()
