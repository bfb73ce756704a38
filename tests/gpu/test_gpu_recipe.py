"""configs/qwen2.5_gsm8k_1gpu.yaml on one GPU, with no network: a randomly initialised Qwen2 of
Qwen2.5-0.5B's shape built here (rlite's byte tokenizer, vocabulary 151,936) and synthetic GSM8K-style
rows in the recipe's keys stand in for the hub model and the data; everything else is the recipe as a
user runs it. It starts, runs a few steps with the engine on the GPU, its peak GPU memory is compared
with the estimate the run's memory check made, and the steps' times are recorded. Skipped without CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "qwen2.5_gsm8k_1gpu.yaml"
QWEN25_05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_size=151936,
                  tie_word_embeddings=True, max_position_embeddings=4096)
STEPS = 3


def _gsm8k_like(path: Path, count: int) -> str:
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
             "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"}
            for a, b in ((i % 50 + 3, i % 17 + 2) for i in range(count))]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_the_one_gpu_recipe_runs_a_few_steps_within_its_memory_estimate(tmp_path, measure):
    from transformers import AutoConfig

    from rlite.config import load_config
    from rlite.plugin_manager import get_plugin_manager
    from rlite.run.limits import estimate_memory, model_shape
    from rlite.run.loop import run_training
    from rlite.testing import read_jsonl
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path / "qwen2.5-0.5b-shape", **QWEN25_05B)
    try:
        import math_verify  # noqa: F401

        reward = []
    except ImportError:  # its wheel did not travel: a reward of the same kind (the final number) stands in
        reward = ["rewards=[numeric]"]
    overrides = [f"model.path={model_dir}", f"data.train_files={_gsm8k_like(tmp_path / 'train.parquet', 256)}",
                 f"data.eval_files={_gsm8k_like(tmp_path / 'test.parquet', 32)}", f"training.steps={STEPS}",
                 "training.eval_max_prompts=32", f"logging.run_dir={tmp_path / 'run'}", "logging.progress_bar=false",
                 "checkpoint.every=0", "checkpoint.export_hf=false", *reward]
    pm = get_plugin_manager()
    cfg = load_config(RECIPE, overrides, pm=pm)
    estimate = estimate_memory(cfg, model_shape(AutoConfig.from_pretrained(model_dir)), on_gpu=True, pm=pm)
    torch.cuda.reset_peak_memory_stats()
    run_training(cfg, pm)
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    times = {key: [round(r[key], 2) for r in rows] for key in rows[-1] if key.startswith("time/")}
    measure("1-GPU recipe: step times (s)", json.dumps(times), note=f"{STEPS} steps, Qwen2.5-0.5B shape, random init")
    measure("1-GPU recipe: peak GPU memory", f"{peak / 2**30:.2f}", "GiB",
            f"reserved {reserved / 2**30:.2f} GiB; estimate {estimate.total / 2**30:.2f} GiB ({estimate.describe()})")
    measure("1-GPU recipe: peak / estimate", f"{peak / estimate.total:.2f}")
    assert peak <= 1.5 * estimate.total, "the run's memory check under-counts what the run holds"
