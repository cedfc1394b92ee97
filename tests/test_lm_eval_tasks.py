"""bench.lm_eval_compare's local tasks are well formed (lm-eval itself is never installed here)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench import lm_eval_compare  # imports without lm-eval: it only runs lm-eval's CLI
from bench.lm_eval_data import CHAT, GEN, MC, write_tasks


def test_tasks_and_documents(tmp_path):
    assert callable(lm_eval_compare.main)
    root = write_tasks(tmp_path)
    counts = {"ec_mc": len(MC), "ec_gen": len(GEN), "ec_chat": len(CHAT)}
    for task, n in counts.items():
        cfg = yaml.safe_load((root / f"{task}.yaml").read_text())
        assert cfg["task"] == task and cfg["dataset_path"] == "json"
        (data,) = cfg["dataset_kwargs"]["data_files"].values()
        docs = [json.loads(line) for line in Path(data).read_text().splitlines()]
        assert len(docs) == n and 20 <= n <= 40
    for q, choices, answer in MC:
        assert len(choices) == 4 and len(set(choices)) == 4 and 0 <= answer < 4, q
    gen = yaml.safe_load((root / "ec_gen.yaml").read_text())
    assert gen["output_type"] == "generate_until" and gen["generation_kwargs"]["until"] == ["\n"]
    assert yaml.safe_load((root / "ec_mc.yaml").read_text())["output_type"] == "multiple_choice"
