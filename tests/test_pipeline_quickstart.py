"""The quick start's promise, held by CI: on the world CI builds, the four ESFT adapters the quick start makes
meet every target (base weak on each task and competent on the general mixture, each adapter strong on its
task without raising the general loss). Exact match against thresholds, never time."""

from __future__ import annotations

from pathlib import Path

import pytest

from esftctl.world.adapters import PROMISE, Adapter, Recipe, Scores, _start_over_unless, prepare_adapter, verdict


@pytest.fixture(scope="module")
def adapters(world):
    return [prepare_adapter(world, task) for task in world.task_names]


def test_every_target_of_the_promise_is_met(adapters):
    checks = verdict(adapters)
    assert len(checks) == 1 + 3 * len(adapters)
    missed = [f"{c.what}: {c.measured} (wanted {c.target})" for c in checks if not c.met]
    assert not missed, missed


def test_adapters_are_bundles_of_the_selected_experts(adapters):
    from esftctl.formats.bundle import Bundle

    for a in adapters:
        bundle = Bundle.open(a.bundle)
        assert bundle.name == a.task and bundle.experts_per_layer() == a.experts_per_layer


def _adapter(task_exact: float, general_loss: float, base_exact: float = 0.1) -> Adapter:
    return Adapter("t", Path("b"), [3, 3, 3], Scores(base_exact, 0.99, 0.0100), Scores(task_exact, 0.99, general_loss),
                   None)


@pytest.mark.parametrize("adapter, missed", [
    (_adapter(0.80, 0.0100 + 0.0487), []),  # perplexity +4.99%
    (_adapter(0.795, 0.0100), ["ESFT t: t exact"]),
    (_adapter(0.90, 0.0100 + 0.0488), ["ESFT t: general perplexity against the base's"]),  # +5.00004%
    (_adapter(0.90, 0.0050, base_exact=0.205), ["base: t exact"]),
])
def test_verdict_flags_each_missed_target(adapter, missed):
    assert [c.what for c in verdict([adapter], PROMISE) if not c.met] == missed


def test_a_cached_adapter_of_another_recipe_starts_over(tmp_path):
    folder = tmp_path / "task"
    _start_over_unless(folder, Recipe(p=0.25))
    (folder / "experts.json").write_text("{}")
    _start_over_unless(folder, Recipe(p=0.25))
    assert (folder / "experts.json").exists()
    _start_over_unless(folder, Recipe(p=0.35))
    assert not (folder / "experts.json").exists() and (folder / "recipe.json").exists()
