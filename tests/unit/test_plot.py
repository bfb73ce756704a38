"""``plot.png`` (reward with a smoothed curve, response length, entropy and KL panels from a metrics file) and the
plain progress lines printed without a terminal."""

from __future__ import annotations

import json

import pytest

from rlite.metrics import SMOOTHING, plot_figure, plot_run, read_metrics, smooth


def test_smooth_is_a_debiased_exponential_moving_average():
    # m1 = 0.5*2 = 1 -> 1/(1-0.5) = 2; m2 = 0.5*1 + 0.5*4 = 2.5 -> 2.5/0.75; m3 = 0.5*2.5 + 0 -> 1.25/0.875
    assert smooth([2.0, 4.0, 0.0], weight=0.5) == pytest.approx([2.0, 2.5 / 0.75, 1.25 / 0.875])
    assert smooth([3.0] * 5) == pytest.approx([3.0] * 5), "a constant stays itself (no pull towards 0)"


@pytest.fixture
def metrics_file(tmp_path):
    rows = [{"step": 0, "eval/greedy_accuracy": 0.25, "eval/sampled_accuracy": 0.125}]
    for step in range(1, 21):
        rows.append({"step": step, "reward/mean": (step % 4) / 4, "response/length": 10.0 + step,
                     "actor/entropy": 2.0 - step / 20, "mismatch/kl": 1e-4 * step})
    rows.append({"step": 20, "eval/greedy_accuracy": 0.5, "eval/sampled_accuracy": 0.375})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_has_reward_length_entropy_and_kl_panels(metrics_file, tmp_path):
    rows = read_metrics(metrics_file)
    fig = plot_figure(rows)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == {"reward", "response length", "entropy", "KL"}
    lines = {line.get_label(): line for ax in fig.axes for line in ax.lines}
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert list(lines["train reward (sampled)"].get_ydata()) == rewards
    smoothed = lines[f"train reward, smoothed (EMA {SMOOTHING})"]
    assert list(smoothed.get_ydata()) == pytest.approx(smooth(rewards))
    assert list(lines["eval accuracy (greedy)"].get_xdata()) == [0, 20]
    assert list(lines["mean response length (tokens)"].get_ydata()) == [11.0 + i for i in range(20)]
    assert list(lines["policy entropy (nats/token)"].get_ydata())[-1] == pytest.approx(1.0)
    kl_labels = [line.get_label() for line in axes["KL"].lines]
    assert kl_labels == ["rollout vs trainer (mismatch)"], "metrics the run did not log are left out"
    out = plot_run(metrics_file, tmp_path / "plot.png")
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_progress_lines_without_a_terminal():
    import io

    from rlite.metrics import ProgressBar

    out = io.StringIO()  # not a TTY
    bar = ProgressBar(total=25, start=4, enabled=True, plain_every=10, stream=out)
    for step in range(5, 26):
        bar.update(step, {"reward/mean": step / 100, "eval/greedy_accuracy": 0.5} if step == 12 else {"reward/mean": 0.0})
    bar.close()
    lines = out.getvalue().splitlines()
    # the resumed run's first step, every 10th, the last; the latest held-out accuracy is carried
    assert [line.split(" | ")[0] for line in lines] == ["step 5/25", "step 10/25", "step 20/25", "step 25/25"]
    assert "eval acc" not in lines[1] and "eval acc 0.500" in lines[2]
    assert "\x1b" not in out.getvalue()


@pytest.mark.parametrize("in_reward", [False, True])
def test_the_kl_panel_draws_what_a_run_with_a_kl_term_logs(tmp_path, in_reward):
    """Each KL curve is a metric the loop logs (the panel once named ``actor/reward_kl_penalty``, a key
    rlite never logs, so the reward's KL was never drawn)."""
    import torch

    from rlite.metrics import PLOT_PANELS
    from rlite.run.loop import run_training
    from rlite.testing import tiny_config
    from rlite.tokenizer import build_tiny_model_dir

    torch.set_num_threads(1)
    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    run_training(tiny_config(model_dir, run_dir, "algorithm.kl.coef=0.1", f"algorithm.kl.in_reward={in_reward}"))
    rows = read_metrics(run_dir / "metrics.jsonl")
    fig = plot_figure(rows)
    (kl_axes,) = [ax for ax in fig.axes if ax.get_title() == "KL"]
    drawn = {line.get_label() for line in kl_axes.lines}
    labels = dict(PLOT_PANELS["KL"])
    expected = labels["actor/reward_kl"] if in_reward else labels["actor/kl_loss"]
    assert expected in drawn
    assert labels["mismatch/kl"] in drawn
