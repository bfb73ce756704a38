"""The micro-batch loop never makes the host wait for the device.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, a boolean mask's count, a
``torch.tensor`` of Python data) waits until every kernel queued before it has run, and the device then
idles while the host launches the next ones. The same ops run on a CPU, so the check runs here: the
update's forward, loss and backward of every micro-batch run under :class:`rlite.testing.HostSyncRecorder`,
and only the host-side preparation of a micro-batch (:func:`rlite.plugins.fsdp2.backend.forward_inputs`,
which reads the batch's host tensors by design) may read values. The one exception is transformers' own
mask construction, which reads the padding mask once per decoder call over whole sequences to decide
whether sdpa may take ``is_causal`` (``transformers/masking_utils.py``): outside rlite's code, counted here
so that a change shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rlite.plugins.fsdp2.backend as fsdp2_backend
import rlite.stages.update as update_stage
from rlite.testing import HostSyncRecorder, fixed_batch

TRANSFORMERS_MASKS = f"transformers{__import__('os').sep}masking_utils.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _targets(batch):
    from rlite.algorithms import AdvantageInput
    from rlite.plugin_manager import build_plugin_manager
    from rlite.rollout import TrainTargets

    grpo = build_plugin_manager(autoload=False).registry("advantage_estimator").get("grpo")
    advantages, returns = grpo.implementation(AdvantageInput(batch.scores, batch.group_ids, batch.response_mask),
                                              grpo.config_cls())
    return TrainTargets(advantages, returns, batch.response_mask.clone(), ref_logprobs=torch.zeros_like(batch.response_mask))


def _watched(backend, recorder, monkeypatch):
    """The loop's device work (the backend's forward and backward, the loss) under ``recorder``; the host-side
    preparation of each micro-batch allowed."""
    planner = fsdp2_backend.forward_inputs

    def prepare(*args, **kwargs):
        with recorder.allowed():
            return planner(*args, **kwargs)

    def watch(fn):
        def run(*args, **kwargs):
            with recorder:
                return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(fsdp2_backend, "forward_inputs", prepare)
    monkeypatch.setattr(update_stage, "micro_batch_loss", watch(update_stage.micro_batch_loss))
    monkeypatch.setattr(update_stage, "loss_inputs", watch(update_stage.loss_inputs))
    monkeypatch.setattr(backend, "logprobs", watch(backend.logprobs))
    monkeypatch.setattr(backend, "backward", watch(backend.backward))


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "fsdp2"])
@pytest.mark.parametrize("layout", ["shared-prompts", "full", "packed", "token-budget"])
def test_the_micro_batch_loop_reads_no_device_value(model_dir, world_of_one, monkeypatch, plain, layout):
    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugin_manager import build_plugin_manager
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.stages.update import LossSpec, update_policy
    from rlite.training.backend import ForwardSpec

    backend = FSDP2Backend.build(ModelConfig(path=model_dir), ParallelismConfig(shard_single_process=not plain),
                                 TrainingConfig(), torch.device("cpu"), total_optimizer_steps=1)
    pm = build_plugin_manager(autoload=False)
    ppo = pm.registry("policy_loss").get("ppo_clip")
    k3 = pm.registry("kl_estimator").get("k3").implementation
    batch = fixed_batch(num_prompts=4, samples=4, prompt_len=6, max_len=7, vocab=250)
    spec = ForwardSpec(micro_batch_size=4, temperature=0.9, chunk_size=8, exact_layout=False,
                       share_prompts=layout == "shared-prompts", pack_sequences=layout == "packed",
                       max_tokens_per_micro_batch=40 if layout == "token-budget" else 0)
    recorder = HostSyncRecorder()
    _watched(backend, recorder, monkeypatch)
    # a KL term and an entropy bonus: every part of the loss runs
    loss = LossSpec(ppo.implementation, ppo.config_cls(), "seq-mean-token-mean", 7.0, k3, 0.1, 0.01)
    update = update_policy(backend, batch, _targets(batch), spec, loss, minibatches=2, epochs=1, dp_size=1)
    metrics, first = update.metrics, update.first_pass_logprobs
    assert metrics["actor/grad_norm"] > 0 and first.abs().sum() > 0, "the loop ran and trained"
    ours = [(op, where) for op, where in recorder.found if TRANSFORMERS_MASKS not in where]
    assert ours == [], f"the loop waits for the device at {ours}"
    # transformers reads the padding mask once per decoder call that covers whole sequences (the shared
    # prompt pass, the full forward) and the packed position ids once per packed call: at most twice each
    micro_batches = metrics["batching/micro_batches"] * 2
    assert len(recorder.found) <= 2 * micro_batches, recorder.found


def test_the_recorder_sees_what_waits_for_a_device():
    """The check itself: each kind of op that reads device values is recorded; index tensors, slices and
    arithmetic are not, nor anything inside ``allowed()``."""
    x = torch.arange(6.0)
    mask = x > 2
    with HostSyncRecorder() as recorder:
        x.sum().item()
        x.tolist()
        bool(x.any())
        _ = x[mask]
        x.nonzero()
        torch.tensor([1, 2])
        with recorder.allowed():
            x.tolist()
    ops = [op for op, _ in recorder.found]
    assert ops == ["_local_scalar_dense", "tolist", "_local_scalar_dense", "index", "nonzero", "lift_fresh"]
    assert all(where.startswith(__file__) for _, where in recorder.found), "each names the line that asked"
    with HostSyncRecorder() as quiet:
        index = torch.arange(3)
        _ = (x[index] * 2 + x[1:4]).sum() / 3
        torch.zeros(0).new_tensor([])  # empty: copies nothing
    assert quiet.found == []


def test_loss_inputs_follow_the_log_probs_and_stay_put_on_their_device():
    """``loss_inputs`` moves a micro-batch's targets and rollout log-probs to the log-probs' device; on the
    CPU (the batch's own device) it returns the very same object: no copy, CPU runs unchanged."""
    from rlite.stages.update import loss_inputs
    from rlite.training.device import to_device

    batch = fixed_batch(num_prompts=2, samples=2, prompt_len=4, max_len=5, vocab=50)
    targets = _targets(batch)
    same, same_targets = loss_inputs(batch, targets, torch.device("cpu"))
    assert same is batch and same_targets is targets
    moved = to_device(targets, torch.device("meta"))  # a device without data: only placement is checked
    assert all(t.device.type == "meta" for t in dataclasses.astuple(moved) if isinstance(t, torch.Tensor))
    meta, meta_targets = loss_inputs(batch, targets, torch.device("meta"))
    assert meta_targets.advantages.device.type == meta.rollout_logprobs.device.type == "meta"
    assert meta.prompt_ids.device.type == "cpu", "only what the loss reads moves"
    assert to_device(targets, torch.device("cpu")) is targets
