"""benchmarks/lab/admit_cost.py times the admission order over vLLM's own queue class: the first call moves the
queue (the stats count one reorder a run), the second finds it in order and leaves it."""
import pytest
from conftest import load_script


@pytest.mark.vllm
def test_admit_cost_times_a_move_and_a_queue_already_in_order():
    admit_cost = load_script("admit_cost")
    row = admit_cost.cost(queued=40, adapters=5, free=4, reps=3)
    assert row["reordered"] == 3  # once a run: the in-order call changed nothing
    assert row["moved_ms"] > 0 and row["in_order_ms"] > 0
