"""``rlite eval``: a checkpoint (or an exported model) evaluated without training scores what the run's
own evaluation at that step scored, and the run's files are left as they were."""

from __future__ import annotations

from rlite.config import config_to_yaml
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main

LENGTH_REWARD = """
from rlite import hookimpl


@hookimpl
def register_reward_functions(register):
    register("minus_length", lambda completion, sample, cfg: -len(completion) / 10)
"""


def test_eval_of_a_checkpoint_and_of_the_export_equals_the_runs_last_evaluation(
    tmp_path, capsys, fake_distribution, clean_plugin_env
):
    # a reward on which completions differ (minus their length), installed as a plugin the CLI finds
    fake_distribution("rlite-length-reward", {"length_reward": "length_reward"}, {"length_reward": LENGTH_REWARD})
    pm = build_plugin_manager()
    model_dir = build_tiny_model_dir(tmp_path / "model")
    run_dir = tmp_path / "run"
    cfg = tiny_config(model_dir, run_dir, "checkpoint.save_final=true", "checkpoint.export_hf=true",
                      "training.lr=5e-2", "data.num_eval=6", "logging.samples_every=1", "rewards=[minus_length]",
                      pm=pm)  # fmt: skip
    run_training(cfg, pm)
    trained = {row["step"]: row for row in read_jsonl(run_dir / "metrics.jsonl")}
    final_eval = {k: v for k, v in trained[2].items() if k.startswith("eval/")}
    assert set(final_eval) >= {"eval/greedy_accuracy", "eval/greedy_reward", "eval/sampled_reward"}
    assert final_eval["eval/sampled_reward"] < 0
    before = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}

    config_file = tmp_path / "run.yaml"
    config_file.write_text(config_to_yaml(cfg).replace("resume: never", "resume: auto"))
    capsys.readouterr()
    assert main(["eval", str(config_file)]) == 0  # the latest checkpoint: step 2
    printed = capsys.readouterr().out
    assert main(["eval", str(config_file), f"model.path={run_dir / 'hf_model'}", "checkpoint.resume=never"]) == 0

    from_checkpoint, from_export = read_jsonl(run_dir / "eval.jsonl")
    assert from_checkpoint["step"] == 2 and from_checkpoint["model"].endswith("step_00000002")
    assert {k: from_checkpoint[k] for k in final_eval} == final_eval
    assert f"eval/greedy_reward: {final_eval['eval/greedy_reward']:.4f}" in printed
    # the export holds the checkpoint's weights: the same greedy generations (greedy needs no seed)
    assert from_export["model"] == str(run_dir / "hf_model") and from_export["step"] == 0
    for key in ("eval/greedy_accuracy", "eval/greedy_reward"):
        assert from_export[key] == final_eval[key]
    greedy = [r for r in read_jsonl(run_dir / "samples.jsonl") if r["kind"] == "eval" and r["mode"] == "greedy"]
    run_final, of_checkpoint, of_export = greedy[4:8], greedy[8:12], greedy[12:16]  # after the run's step-0 rows
    assert [r["step"] for r in greedy] == [0] * 4 + [2] * 8 + [0] * 4
    assert [r["completion"] for r in of_checkpoint] == [r["completion"] for r in run_final]
    assert [r["completion"] for r in of_export] == [r["completion"] for r in run_final]

    # model.path without a checkpoint: the run's baseline evaluation at step 0
    assert main(["eval", str(config_file), "checkpoint.resume=never"]) == 0
    from_start = read_jsonl(run_dir / "eval.jsonl")[-1]
    assert {k: from_start[k] for k in final_eval} == {k: trained[0][k] for k in final_eval}
    # nothing of the training run was rewritten
    assert {name: (run_dir / name).read_bytes() for name in before} == before
