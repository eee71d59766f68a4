"""Why a tiny world's adapters miss, measured on its base (issue 33).

    python benchmarks/lab/world_diagnose.py WORLD [WORLD ...]   # one JSON line per world

Per world: the base's exact match on each part of the held-out general mixture (copying, each task's known share,
each task's practice table), and per task
- `twins`: inputs whose hidden state at the task's arrow, after the first MoE layer, lies within 5% of the
  states' mean norm of another input's. Attention is frozen in ESFT, so twins reach every MoE layer alike and no
  expert can tell them apart: on world v9, 10-13 of tagging's objects were twins on 2 of 5 bases, and exactly the
  twins were what those adapters got wrong;
- `unended`: inputs after whose right answer the base does not predict the end. ESFT's relevance leaves the
  end-predicting position out (esftctl.relevance), so the adapter's experts may not be routed there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def diagnose(root: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esftctl.jsonl import read_jsonl
    from esftctl.world.build import World
    from esftctl.world.esft import evaluate
    from esftctl.world.tasks import TASKS

    world = World(root)
    general = list(read_jsonl(world.general_file("test")))
    parts = {"copy": [e for e in general if e["prompt"].startswith("copy:")]}
    for t in TASKS:
        mine = [e for e in general if e["prompt"].startswith(t.keyword + " ")]
        parts[f"{t.name}:known"] = [e for e in mine if e["prompt"].split()[1] in t.known]
        parts[f"{t.name}:practice"] = [e for e in mine if e["prompt"].split()[1] not in t.known]
    exact = {name: round(evaluate(world.base_dir, part)[0], 3) for name, part in parts.items() if part}
    tok = AutoTokenizer.from_pretrained(world.base_dir)
    base = AutoModelForCausalLM.from_pretrained(world.base_dir, dtype=torch.float32).eval()
    tasks = {}
    with torch.no_grad():
        for t in TASKS:
            states, unended = [], 0
            for x in t.inputs:
                ids = tok(f"{t.keyword} {x} {t.arrow} {t.answer(x)}", return_tensors="pt").input_ids
                out = base(ids, output_hidden_states=True)
                states.append(out.hidden_states[2][0, -2])  # the arrow, after the dense layer and the first MoE layer
                unended += int(out.logits[0, -1].argmax()) != tok.eos_token_id
            h = torch.stack(states)
            near = torch.cdist(h, h) < 0.05 * h.norm(dim=-1).mean()
            tasks[t.name] = {"twins": int(((near.sum(1) - 1) > 0).sum()), "unended": unended}
    return {"world": str(root), "general_exact": exact, "tasks": tasks}


if __name__ == "__main__":
    torch.set_num_threads(1)
    for arg in sys.argv[1:]:
        print(json.dumps(diagnose(Path(arg))), flush=True)
