"""The ``perf/*`` metrics of a real tiny run on CPU (:mod:`rlite.perf`): the model FLOPs of each step equal
the formula on the step's own sequences and passes, MFU is reported against ``logging.peak_tflops`` and
shows in the progress line and the summary; with no peak (CPU) there is no MFU anywhere, and the model
TFLOP/s still are."""

from __future__ import annotations

import pytest
import torch

from rlite import hookimpl
from rlite.hf_models import load_causal_lm
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir

STEPS = 3


class BatchLengths:
    """Each step's real sequence lengths (prompt + response), as the engine produced them."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[int]] = {}

    @hookimpl
    def after_rollout(self, step, batch):
        self.by_step[step] = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("model"), hidden=32, layers=2, heads=4, kv_heads=2,
                                intermediate=64, tie_word_embeddings=True)  # fmt: skip


def train(model_dir, run_dir, *overrides):
    pm = build_plugin_manager(autoload=False)
    lengths = BatchLengths()
    pm.register(lengths, name="batch-lengths")
    cfg = tiny_config(model_dir, run_dir, f"training.steps={STEPS}", "logging.progress_bar=true",
                      "logging.log_every=1", *overrides, pm=pm)  # fmt: skip
    summary = run_training(cfg, pm)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] >= 1]  # step 0: the baseline evaluation
    return rows, lengths.by_step, summary, cfg


def by_hand(model_dir, cfg, lengths: list[int]) -> tuple[float, float]:
    """Forward and forward + backward FLOPs of a pass over sequences of these lengths: N from the model's own
    linear layers (the output head included, tied or not), attention over the causal pairs of each sequence."""
    model = load_causal_lm(cfg.model)
    config = model.config
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    d_attn = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    forward = sum(2 * n * s + 4 * config.num_hidden_layers * d_attn * s * (s + 1) / 2 for s in lengths)
    return forward, 3 * forward


def test_mfu_against_the_configured_peak_with_the_scoring_passes_counted(model_dir, tmp_path, capsys):
    # two epochs: pi_old is recomputed; a KL coefficient: the reference model scores too
    rows, lengths, summary, cfg = train(model_dir, tmp_path / "run", "logging.peak_tflops=0.25",
                                        "algorithm.epochs_per_step=2", "algorithm.kl.coef=0.1")  # fmt: skip
    out = capsys.readouterr().out
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        forward, both = by_hand(model_dir, cfg, lengths[row["step"]])
        assert row["perf/model_flops"] == pytest.approx(2 * both + 2 * forward, rel=1e-12)  # 2 epochs + pi_old + pi_ref
        assert row["perf/train_tokens"] == sum(lengths[row["step"]])
        trainer_s = row["time/logprobs"] + row["time/train"]
        assert row["perf/model_tflops"] == pytest.approx(row["perf/model_flops"] / trainer_s / 1e12)
        assert row["perf/peak_tflops"] == 0.25
        assert row["perf/mfu"] == pytest.approx(row["perf/model_tflops"] / 0.25)
        update_s = row["time/train/forward"] + row["time/train/backward"]
        assert row["perf/train_tokens_per_s"] == pytest.approx(2 * row["perf/train_tokens"] / update_s)
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS
    for row, line in zip(rows, lines):
        assert f"| MFU {row['perf/mfu']:.1%} |" in line
    mean = sum(r["perf/mfu"] for r in rows[1:]) / (STEPS - 1)
    assert summary[f"mfu (mean of steps 2-{STEPS})"] == pytest.approx(mean)
    assert summary["mfu_peak_tflops"] == 0.25
    assert f"mfu (mean of steps 2-{STEPS})" in out and f"{mean:.1%}" in out  # the printed summary table


def test_without_a_peak_there_is_no_mfu_but_model_tflops_are_reported(model_dir, tmp_path, capsys):
    rows, lengths, summary, cfg = train(model_dir, tmp_path / "run")
    out = capsys.readouterr().out
    for row in rows:
        _, both = by_hand(model_dir, cfg, lengths[row["step"]])
        assert row["perf/model_flops"] == pytest.approx(both, rel=1e-12)  # one epoch, no pi_old, no reference
        assert row["perf/model_tflops"] > 0
        assert "perf/mfu" not in row and "perf/peak_tflops" not in row
    assert "MFU" not in out
    assert not any(key.startswith("mfu") for key in summary)
    assert f"model_tflops_per_gpu (mean of steps 2-{STEPS})" in summary
