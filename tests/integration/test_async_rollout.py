"""Asynchronous rollouts (rollout.mode): the staleness bound holds on every sample, one_step_off is
exactly one version behind, max_staleness 0 is the synchronous run bitwise, and the engine's log-probs
are the behaviour policy's (the mismatch metrics see the lag)."""

from __future__ import annotations

import time

import pytest
import torch
from rank_workers import recorded_runs_on_fake_sglang

from rlite import hookimpl
from rlite.config import ConfigError
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, recorded_runs, spawn_ranks, tiny_config
from rlite.tokenizer import build_tiny_model_dir


class Recorder:
    """A learnable reward (the fraction of digits) and a record of every batch and the final weights."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int], torch.Tensor, torch.Tensor]] = []
        self.weights: dict[str, torch.Tensor] = {}

    @hookimpl
    def register_reward_functions(self, register):
        register("digits", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))

    @hookimpl
    def after_rewards(self, step, batch):
        self.batches.append((step, list(batch.weight_versions), batch.response_ids.clone(), batch.rollout_logprobs.clone()))

    @hookimpl
    def after_optimizer_step(self, step, model):
        self.weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                        for k, v in model.state_dict().items()}  # FSDP2 shards are DTensors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def run(model_dir, run_dir, *overrides, recorder: Recorder | None = None):
    pm = build_plugin_manager(autoload=False)
    recorder = recorder or Recorder()
    pm.register(recorder, name="recorder")
    cfg = tiny_config(model_dir, run_dir, "rewards=[digits]", "training.lr=3e-3", "rollout.temperature=1.0",
                      *overrides, pm=pm)  # fmt: skip
    run_training(cfg, pm)
    return recorder, [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def test_max_staleness_zero_is_the_synchronous_run_bitwise(tmp_path, model_dir):
    sync, sync_rows = run(model_dir, tmp_path / "sync", "training.steps=3")
    zero, zero_rows = run(model_dir, tmp_path / "async", "training.steps=3", "rollout.mode=async",
                          "rollout.max_staleness=0")  # fmt: skip
    assert len(sync.batches) == len(zero.batches) == 3
    for (s, v, ids, lp), (s2, v2, ids2, lp2) in zip(sync.batches, zero.batches):
        assert s == s2 and v == v2 == [s - 1] * len(v)
        assert torch.equal(ids, ids2) and torch.equal(lp, lp2)
    for name, tensor in sync.weights.items():
        assert torch.equal(tensor, zero.weights[name]), name
    assert [r["reward/mean"] for r in sync_rows] == [r["reward/mean"] for r in zero_rows]
    assert all(r["rollout/staleness_max"] == 0 for r in zero_rows)


class SlowAfterSync(Recorder):
    """The trainer lingers after each weight sync, so the producer is drawing the next batch by the time
    the trainer reports this one."""

    @hookimpl
    def after_weight_sync(self, step, weight_version, engine):
        time.sleep(0.5)


def test_speculation_metrics_are_those_of_the_steps_batch(tmp_path, model_dir):
    counts = ("spec/acceptance_rate", "spec/mean_accepted_length", "spec/proposed_per_target_forward")
    _, sync_rows = run(model_dir, tmp_path / "sync", "training.steps=3", "rollout.draft=ngram")
    _, zero_rows = run(model_dir, tmp_path / "async", "training.steps=3", "rollout.draft=ngram", "rollout.mode=async",
                       "rollout.max_staleness=0", recorder=SlowAfterSync())  # fmt: skip
    assert [[r[k] for k in counts] for r in sync_rows] == [[r[k] for k in counts] for r in zero_rows]
    assert any(r["spec/proposed_per_target_forward"] > 0 for r in sync_rows)


@pytest.mark.parametrize("mode, bound", [("one_step_off", 1), ("async", 2)])
def test_staleness_never_exceeds_the_bound(tmp_path, model_dir, mode, bound):
    recorder, rows = run(model_dir, tmp_path / mode, "training.steps=6", f"rollout.mode={mode}",
                         f"rollout.max_staleness={bound}", "rollout.engine.args.share_weights=false")  # fmt: skip
    assert [s for s, *_ in recorder.batches] == list(range(1, 7))
    for step, versions, *_ in recorder.batches:
        staleness = [step - 1 - v for v in versions]
        assert all(0 <= lag <= bound for lag in staleness), (step, versions)
        if mode == "one_step_off":  # deterministic: exactly one version behind from step 2 on
            assert staleness == [min(step - 1, 1)] * len(versions)
    assert max(r["rollout/staleness_max"] for r in rows) <= bound
    # the engine's log-probs are those of the older weights that sampled: the trainer's differ from them
    lagging = [abs(r["mismatch/kl"]) for r, (step, versions, *_) in zip(rows, recorder.batches)
               if any(step - 1 - v > 0 for v in versions)]  # fmt: skip
    assert lagging and max(lagging) > 1e-6


def test_async_needs_an_engine_with_its_own_weights(tmp_path, model_dir):
    pm = build_plugin_manager(autoload=False)
    with pytest.raises(ConfigError, match=r"rollout.mode=one_step_off with rollout.engine=transformers with "
                                          r"rollout.engine.args.share_weights=true \(binds the trainer's own tensors\): "
                                          r"the engine samples while the trainer updates.*leave out the rollout.engine.args"):
        tiny_config(model_dir, tmp_path, "rollout.mode=one_step_off", "rollout.engine.args.share_weights=true",
                    pm=pm)  # refused as the config loads
    with pytest.raises(ConfigError, match="rollout.mode"):
        tiny_config(model_dir, tmp_path, "rollout.mode=later", pm=pm)
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        tiny_config(model_dir, tmp_path, "rollout.max_staleness=-1", pm=pm)


def test_overlapping_modes_give_the_default_engine_its_own_copy(tmp_path, model_dir, caplog):
    """With share_weights left at its default, one_step_off and async choose the engine's own copy of the
    weights (said once) instead of refusing; sync mode keeps sharing the trainer's storage."""
    import logging

    from rlite.distributed import shutdown_distributed
    from rlite.plugin_manager import get_plugin_manager
    from rlite.run.build import build_run

    for mode, shares in (("sync", True), ("one_step_off", False)):
        cfg = tiny_config(model_dir, tmp_path / mode, f"rollout.mode={mode}", "training.steps=1")
        with caplog.at_level(logging.INFO, logger="rlite"):
            run = build_run(cfg, get_plugin_manager())
        try:
            assert run.engine.share_weights is shares
            assert (run.engine.shared_bytes > 0) is shares
        finally:
            run.engine.shutdown()
            run.policy.backend.close()
            shutdown_distributed(run.ctx)
    said = [r.getMessage() for r in caplog.records if "keeps its own copy" in r.getMessage()]
    assert len(said) == 1 and "rollout.mode=one_step_off" in said[0]


def test_async_refuses_tensor_parallel_replicas(tmp_path, model_dir):
    from rlite.distributed import DataLayout
    from rlite.engines.base import IdleEngine
    from rlite.run.build import build_rollouts

    cfg = tiny_config(model_dir, tmp_path, "rollout.mode=async", "rollout.engine.args.share_weights=false",
                      pm=build_plugin_manager(autoload=False))
    layout = DataLayout(rank=0, size=1, replica_rank=0, replica_size=2)  # two ranks share one batch
    with pytest.raises(ConfigError, match="rollout.mode=async: .*replicas of 2 ranks"):
        build_rollouts(cfg, IdleEngine(), None, None, None, layout, None, None, None)


class ThreeTurns:
    def reset(self, sample):
        return None

    def step(self, action):
        return "go on", 0.0, action.turn == 2


def test_multiturn_async_records_each_tokens_version_within_the_bound(tmp_path, model_dir):
    pm = build_plugin_manager(autoload=False)
    seen = []

    class Plugin(Recorder):
        @hookimpl
        def register_rollout_workflows(self, register):
            register("three_turns", lambda cfg, tokenizer: ThreeTurns())

        @hookimpl
        def after_rewards(self, step, batch):
            seen.append((step, batch.token_weight_versions.clone(), batch.response_mask.clone(),
                         batch.response_present.clone(), list(batch.weight_versions)))  # fmt: skip

    pm.register(Plugin(), name="recorder")
    cfg = tiny_config(model_dir, tmp_path, "rewards=[digits]", "training.lr=3e-3", "rollout.workflow=three_turns",
                      "rollout.max_turns=3", "rollout.max_response_tokens=64", "training.steps=6",
                      "rollout.mode=async", "rollout.max_staleness=2", "rollout.engine.args.share_weights=false",
                      pm=pm)  # fmt: skip
    run_training(cfg, pm)
    assert [s for s, *_ in seen] == list(range(1, 7))
    for step, versions, loss_mask, present, sample_versions in seen:
        sampled = loss_mask.bool()
        assert (versions[~sampled] == -1).all()  # observations and padding have no version
        for row in range(versions.shape[0]):
            row_versions = versions[row][sampled[row]].tolist()
            assert row_versions == sorted(row_versions)  # a sync between turns only moves forward
            assert sample_versions[row] == min(row_versions)
            assert step - 1 - 2 <= min(row_versions) and max(row_versions) <= step - 1
        assert (present.bool() & ~sampled).any()  # there are observations inside
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert all(0.0 <= r["rollout/partial_fraction"] <= 1.0 and r["rollout/staleness_max"] <= 2 for r in rows)


# -- N ranks: the producers of all ranks agree on one schedule of generations and weight syncs --------------
# top_k=1 samples the same tokens whatever the seed (the seeds depend on the rank), so world size 2
# draws the batches of world size 1; REINFORCE++ whitens over the global batch, so they still learn.
# AdamW's eps=1 as in tests/invariants: a step about lr * grad, not lr * sign(grad) (which turns rounding
# noise in near-zero gradients into full-size weight differences)
RANKS_COMMON = ["rewards=[digits]", "training.lr=3e-3", "training.eps=1.0", "rollout.top_k=1",
                "algorithm.advantage=reinforce_pp",
                "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.engine.args.share_weights=false"]
RANK_RUNS = [
    ("one_step_off", [*RANKS_COMMON, "training.steps=3", "rollout.mode=one_step_off"]),
    ("sync", [*RANKS_COMMON, "training.steps=3"]),
    ("zero", [*RANKS_COMMON, "training.steps=3", "rollout.mode=async", "rollout.max_staleness=0"]),
    ("async", [*RANKS_COMMON, "training.steps=5", "rollout.mode=async", "rollout.max_staleness=2",
               "training.eval_every=2"]),
    # rank r's trajectories take r + 1 turns: the ranks pass different numbers of points between turns
    ("multiturn", [*RANKS_COMMON, "training.steps=4", "rollout.mode=async", "rollout.max_staleness=1",
                   "rollout.workflow=rank_turns", "rollout.max_turns=3", "rollout.max_response_tokens=64"]),
    # and each turn sampled in segments of 2 tokens: the ranks' calls take different numbers of segments
    ("multiturn_segments", [*RANKS_COMMON, "training.steps=3", "rollout.mode=async", "rollout.max_staleness=1",
                            "rollout.workflow=rank_turns", "rollout.max_turns=3", "rollout.max_response_tokens=64",
                            "rollout.partial_segment_tokens=2", "rollout.timeout_s=120"]),
    # one (fake) SGLang engine on both ranks' GPUs: rank 1's prompts and weights go through rank 0
    ("engine_group", [*RANKS_COMMON, "training.steps=3", "rollout.mode=async", "rollout.max_staleness=1",
                      "rollout.engine={name: sglang, args: {tp_size: 2, dtype: bfloat16}}", "training.eval_every=1"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, model_dir):
    """Every run of RANK_RUNS at world size 2, one after the other in the same two processes."""
    out = tmp_path_factory.mktemp("ranks")
    spawn_ranks(recorded_runs_on_fake_sglang, (2, str(out / "init"), model_dir, str(out), RANK_RUNS), nprocs=2)
    return {name: [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
            for name, _ in RANK_RUNS}  # fmt: skip


def test_one_step_off_at_world_size_2_equals_world_size_1(tmp_path, model_dir, two_ranks):
    recorded_runs(0, 1, "", model_dir, str(tmp_path), RANK_RUNS[:1])
    single = torch.load(tmp_path / "one_step_off.rank0.pt", weights_only=False)
    double = two_ranks["one_step_off"]
    assert [b["step"] for b in single["batches"]] == [1, 2, 3]
    for step, whole in enumerate(single["batches"], start=1):
        halves = [rank["batches"][step - 1] for rank in double]
        assert all(h["step"] == step for h in halves)
        # the same prompts, tokens, rewards and weight version (exactly one behind from step 2 on)
        assert all(v == max(0, step - 2) for h in halves for v in h["versions"]) and set(whole["versions"]) == {
            max(0, step - 2)}
        assert torch.equal(torch.cat([h["scores"] for h in halves]), whole["scores"])
        for key in ("prompts", "responses"):  # unpadded: the ranks pad to their own widths
            assert [row for h in halves for row in h[key]] == whole[key], (step, key)
    rows1, rows2 = single["rows"], double[0]["rows"]
    assert [r["step"] for r in rows1] == [r["step"] for r in rows2] == [1, 2, 3]
    for a, b in zip(rows1, rows2):
        # exact: the same samples and rewards (the engines hold the same weights: v0 for steps 1 and 2)
        for key in ("reward/mean", "reward/accuracy", "response/length", "rollout/staleness_mean",
                    "rollout/staleness_max"):
            assert a[key] == b[key], (a["step"], key)
        # not exact, and cannot be: at world size 2 each rank runs its forward on its half of the batch,
        # padded to its own width (other matmul shapes, other float32 rounding of the log-probs), and its
        # gradient is the sum of two half-batch sums (the reduce-scatter adds them in another order than one
        # process summing the whole batch). Measured: these agree to about 1e-7 relative (grad_norm 7e-8,
        # training_ppl 1.2e-7 at step 3); 1e-5 leaves room for other BLAS kernels
        for key in ("actor/pg_loss", "actor/grad_norm", "mismatch/training_ppl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
        # mismatch/kl is a mean of differences of log-probs near -5, where a float32 step is 4.8e-7, rounded
        # as above: it agrees to a fraction of that step (1.5e-7 at step 2, the same in every run), not to
        # 1e-5 of its own small value (5e-3 with one step of staleness: 5e-8)
        assert a["mismatch/kl"] == pytest.approx(b["mismatch/kl"], abs=4.8e-7), a["step"]
    assert max(r["actor/grad_norm"] for r in rows1) > 0  # it learned something
    # the weights after three AdamW steps (eps=1: a step about lr * grad) of those gradients: measured max
    # difference 3.7e-9 (8 of 27 tensors bitwise equal); the tolerance of tests/invariants (ws2 vs ws1)
    for name, tensor in single["weights"].items():
        for rank in double:
            torch.testing.assert_close(rank["weights"][name], tensor, rtol=1e-5, atol=1e-7, msg=name)


def test_async_at_world_size_2_keeps_the_bound_and_max_staleness_0_is_sync_bitwise(two_ranks):
    for sync, zero in zip(two_ranks["sync"], two_ranks["zero"]):  # on each rank
        assert [b["step"] for b in zero["batches"]] == [1, 2, 3]
        for a, b in zip(sync["batches"], zero["batches"], strict=True):
            assert a["versions"] == b["versions"] == [a["step"] - 1] * len(a["versions"])
            assert torch.equal(a["response_ids"], b["response_ids"]) and torch.equal(a["scores"], b["scores"])
        for name, tensor in sync["weights"].items():
            assert torch.equal(tensor, zero["weights"][name]), name
    assert [r["reward/mean"] for r in two_ranks["sync"][0]["rows"]] == [
        r["reward/mean"] for r in two_ranks["zero"][0]["rows"]]
    for name, bound in (("async", 2), ("multiturn", 1), ("multiturn_segments", 1), ("engine_group", 1)):
        for rank in two_ranks[name]:
            steps = [b["step"] for b in rank["batches"]]
            assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
            for batch in rank["batches"]:
                step = batch["step"]
                assert all(0 <= step - 1 - v <= bound for v in batch["versions"]), (name, step, batch["versions"])
                if batch["token_versions"] is not None:  # every sampled token within the bound
                    sampled = batch["token_versions"][batch["loss_mask"].bool()]
                    assert ((step - 1 - sampled >= 0) & (step - 1 - sampled <= bound)).all(), (name, step)
        assert max(r["rollout/staleness_max"] for r in two_ranks[name][0]["rows"]) <= bound
        # the ranks' producers keep different paces (rank 1 pauses after each generation), and still every
        # rank's engine took the same syncs between the same batches
        assert [b["versions"] for b in two_ranks[name][0]["batches"]] == [
            b["versions"] for b in two_ranks[name][1]["batches"]]
    # rank r's trajectories took r + 1 turns: 2 sampled stretches on rank 1, 1 on rank 0
    turns = [float(rank["batches"][0]["loss_mask"].diff(dim=1).clamp(min=0).sum(dim=1).max()) for rank in
             two_ranks["multiturn"]]
    assert turns[1] > turns[0]
