"""The trainer's side of a draft (rlite.drafts and the built-in draft plugins): the update moves only
the draft, its losses are the documented formulas, and a draft that does not fit the policy or the
engine is refused with the key and what to do."""

from __future__ import annotations

import copy

import pytest
import torch

from rlite import hookimpl
from rlite.config import ConfigError, load_config
from rlite.distributed import DataLayout
from rlite.drafts import DraftContext, ModelDraft
from rlite.plugin_manager import build_plugin_manager
from rlite.testing import fixed_batch
from rlite.tokenizer import build_tiny_model_dir

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "policy": build_tiny_model_dir(root / "policy", hidden=32, layers=2),
        "draft": build_tiny_model_dir(root / "draft", hidden=16, layers=1, seed=1),
        "wide": build_tiny_model_dir(root / "wide", hidden=16, layers=1, vocab_size=300),
    }


def context(dirs, temperature=0.7):
    from transformers import AutoTokenizer

    from rlite.config import ModelConfig, RolloutConfig

    return DraftContext(ModelConfig(path=str(dirs["policy"])), AutoTokenizer.from_pretrained(dirs["policy"]),
                        RolloutConfig(temperature=temperature), torch.device("cpu"), DataLayout.whole_world())


def rollout_batch(top_k: int = 0):
    batch = fixed_batch(num_prompts=3, samples=2, prompt_len=5, max_len=6, vocab=250, seed=4)
    if top_k:
        g = torch.Generator().manual_seed(1)
        shape = (*batch.response_ids.shape, top_k)
        batch.policy_top_ids = torch.randint(0, 250, shape, generator=g)
        batch.policy_top_logprobs = torch.log_softmax(torch.randn(shape, generator=g), -1)
    return batch


def draft_logits(draft: ModelDraft, batch, temperature: float) -> torch.Tensor:
    """The draft's response logits / T, computed here the plain way (one row at a time, no padding)."""
    rows = []
    for r in range(len(batch)):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r].bool()]
        n = int(batch.response_mask[r].sum())
        ids = torch.cat([prompt, batch.response_ids[r, :n]])[None]
        with torch.no_grad():
            logits = draft.model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n].float() / temperature
        rows.append(logits)
    return rows


@pytest.mark.parametrize("loss", ["tokens", "distill"])
def test_the_draft_update_changes_only_the_draft_and_its_loss_is_the_formula(dirs, loss):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(dirs["policy"])  # the policy the rollouts came from
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    draft = ModelDraft(str(dirs["draft"]), context(dirs), loss=loss, distill_top_k=4, lr=1e-2, micro_batch_size=2)
    batch = rollout_batch(top_k=4 if loss == "distill" else 0)
    draft_before = {n: p.detach().clone() for n, p in draft.model.named_parameters()}
    # the documented loss, by hand: mean over every response token of the batch
    per_token = []
    for r, logits in enumerate(draft_logits(draft, batch, 0.7)):
        log_q = torch.log_softmax(logits, -1)
        n = logits.shape[0]
        if loss == "tokens":
            per_token.append(-log_q.gather(-1, batch.response_ids[r, :n, None]).squeeze(-1))
        else:
            teacher = torch.softmax(batch.policy_top_logprobs[r, :n], -1)
            per_token.append(-(teacher * log_q.gather(-1, batch.policy_top_ids[r, :n])).sum(-1))
    expected = torch.cat(per_token).mean()
    metrics = draft.update(batch)
    assert metrics["draft/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert metrics["draft/grad_norm"] > 0
    assert 0 <= metrics["draft/top1_agreement"] <= 1
    changed = [n for n, p in draft.model.named_parameters() if not torch.equal(p, draft_before[n])]
    assert len(changed) == len(draft_before)  # every draft weight moved
    for name, param in policy.named_parameters():  # and nothing of the policy did
        assert torch.equal(param, before[name]) and param.grad is None
    assert all(p.grad is None for p in draft.model.parameters())  # the draft's step cleared its gradients


def test_a_trained_draft_checkpoints_and_resumes_its_optimizer(dirs):
    batch = rollout_batch()
    a = ModelDraft(str(dirs["draft"]), context(dirs), lr=1e-2)
    a.update(batch)
    b = ModelDraft(str(dirs["draft"]), context(dirs), lr=1e-2)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as a checkpoint would: a copy, not a's own tensors
    a.update(batch), b.update(batch)  # the same second step: Adam's moments came along
    for (name, pa), (_, pb) in zip(a.named_weights(), b.named_weights()):
        assert torch.equal(pa, pb), name


def test_a_frozen_draft_keeps_nothing_on_the_trainer(dirs):
    draft = ModelDraft(str(dirs["draft"]), context(dirs), train=False)
    assert draft.model is None and draft.update(rollout_batch()) == {} and draft.state_dict() == {}
    assert not draft.spec.trained and draft.spec.model_path == str(dirs["draft"])


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(dirs, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.draft.args.path: the draft's vocabulary has 300 tokens, the policy's 259"):
        ModelDraft(str(dirs["wide"]), context(dirs))
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(dirs["draft"], other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra>"])  # one more id than the policy knows
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match=r"rollout.draft.args.path: the draft's tokenizer differs from the policy's in 1 tokens"):
        ModelDraft(str(other), context(dirs))
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        ModelDraft(str(tmp_path), context(dirs))


# --------------------------------------------------------------------------------------------------
# config: the draft against the engine
# --------------------------------------------------------------------------------------------------


REQUIRED = ["model.path=m", "data.task=addition"]


def config_error(pm, *overrides) -> str:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, [*REQUIRED, *overrides], pm)
    return str(excinfo.value)


def test_the_draft_model_needs_its_path():
    pm = build_plugin_manager(autoload=False)
    assert config_error(pm, "rollout.draft=draft_model").startswith("rollout.draft.args.path: missing value")
    assert "rollout.draft.args: loss" in config_error(pm, "rollout.draft=draft_model", "rollout.draft.args.path=d",
                                                      "rollout.draft.args.loss=kl")
    cfg = load_config(None, [*REQUIRED, "rollout.draft=ngram", "rollout.draft.args.max_match=4"], pm)
    assert cfg.rollout.draft.args == {"num_speculative_tokens": 4, "min_match": 1, "max_match": 4}


class EngineWithoutDrafts:
    @hookimpl
    def register_rollout_engines(self, register):
        register("no_drafts", lambda *args: None)

    @hookimpl
    def register_speculative_drafts(self, register):
        register("head", lambda context, cfg: None, method="eagle")
        register("unmarked", lambda context, cfg: None)


def test_a_draft_the_engine_cannot_run_is_refused_at_load():
    pm = build_plugin_manager(autoload=False)
    pm.register(EngineWithoutDrafts(), name="test-engines")
    message = config_error(pm, "rollout.engine=no_drafts", "rollout.draft=ngram")
    assert message.startswith("rollout.draft=ngram: the 'no_drafts' engine cannot run a 'ngram' draft (it runs: no drafts)")
    assert "rollout.engine to one that runs it (transformers, sglang)" in message
    message = config_error(pm, "rollout.draft=head")
    assert "the 'transformers' engine cannot run a 'eagle' draft (it runs: model, ngram)" in message
    assert "(sglang)" in message
    assert "registered it without method=" in config_error(pm, "rollout.draft=unmarked")
    load_config(None, [*REQUIRED, "rollout.engine=sglang", "rollout.draft=head"], pm)  # SGLang runs EAGLE


def test_a_trained_draft_with_adapter_only_lora_sync_is_refused(dirs, tmp_path):
    from rlite.run.loop import run_training
    from rlite.testing import tiny_config

    class AdapterEngine:  # an engine that serves adapters, so that only the draft is in the way
        @hookimpl
        def register_rollout_engines(self, register):
            from rlite.engines.base import EngineCapabilities, IdleEngine

            class Engine(IdleEngine):
                capabilities = EngineCapabilities(lora_adapters=True, draft_methods=("model",))

            register("adapters", lambda *args, **kwargs: Engine(), draft_methods=("model",))

    pm = build_plugin_manager(autoload=False)
    pm.register(AdapterEngine(), name="test-adapter-engine")
    cfg = tiny_config(dirs["policy"], tmp_path / "run", "rollout.engine=adapters", "model.lora.enabled=true",
                      "rollout.lora_sync=adapter", "rollout.draft=draft_model", f"rollout.draft.args.path={dirs['draft']}",
                      pm=pm)
    with pytest.raises(ConfigError, match="rollout.lora_sync=adapter sends only the LoRA adapter"):
        run_training(cfg, pm)


def test_the_user_page_lists_every_option_of_the_built_in_drafts_with_its_default():
    import dataclasses
    import re
    from pathlib import Path

    from rlite.plugins.drafts import DraftModelConfig, NgramDraftConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "speculative.md").read_text()
    for section, cls in (("### `draft_model`", DraftModelConfig), ("### `ngram`", NgramDraftConfig)):
        start = text.index(section)
        table = text[start : text.index("\n#", start + 1)]
        rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.M))
        assert set(rows) == {f.name for f in dataclasses.fields(cls)}, section
        for field in dataclasses.fields(cls):
            shown = rows[field.name].strip().strip("`")
            if field.default == "???":
                assert shown == "(required)"
            elif isinstance(field.default, bool):
                assert shown == str(field.default).lower(), field.name
            elif isinstance(field.default, (int, float)):
                assert float(shown) == field.default, field.name
            else:
                assert shown == str(field.default), field.name
