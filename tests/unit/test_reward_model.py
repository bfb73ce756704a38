"""The built-in ``reward_model`` reward: a tiny randomly initialised sequence-classification model,
saved to a folder with the byte tokenizer, scores prompt + completion exactly as the model alone does."""

from __future__ import annotations

import pytest
import torch

from rlite.config import Choice, ConfigError
from rlite.plugin_manager import RlitePluginManager
from rlite.plugins import rewards as builtin
from rlite.reward_runner import build_reward_runner
from rlite.tokenizer import build_byte_tokenizer


def save_classifier(path, num_labels: int, seed: int = 0) -> str:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_byte_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def registry():
    pm = RlitePluginManager()
    pm.register(builtin, name="rlite.plugins.rewards")
    return pm.registry("reward_function")


@pytest.fixture(scope="module")
def scalar_model(tmp_path_factory):
    return save_classifier(tmp_path_factory.mktemp("rm"), num_labels=1)


def reference_scores(path: str, texts: list[str]) -> torch.Tensor:
    """Each text alone through the model (no padding): the logits at its last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.cat([model(**tokenizer(text, return_tensors="pt")).logits for text in texts])


PROMPTS = [{"prompt": "12+30=", "answer": "42"}, {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"},
           {"prompt": "7+1=", "answer": "8"}]
COMPLETIONS = ["42", "a much longer completion than the others", "8"]


def chatml(prompt, completion: str) -> str:
    content = prompt if isinstance(prompt, str) else prompt[0]["content"]
    return (f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n{completion}<|im_end|>\n")


def test_one_output_model_gives_its_logit_batched_and_padded(registry, scalar_model):
    runner = build_reward_runner([Choice("reward_model", {"path": scalar_model, "batch_size": 2})], registry,
                                 example_sample=PROMPTS[0])
    entry = runner.entries[0]
    assert (entry.isolation, entry.batched) == ("inline", True)
    result = runner.score(COMPLETIONS, PROMPTS)
    texts = [chatml(s["prompt"], c) for c, s in zip(COMPLETIONS, PROMPTS)]
    expected = reference_scores(scalar_model, texts)[:, 0]
    assert result.scores == pytest.approx(expected.tolist(), abs=1e-5)
    assert len(set(result.scores)) == 3 and result.error is None


def test_without_chat_template_the_texts_are_prompt_then_completion(registry, scalar_model):
    cfg = builtin.RewardModelConfig(path=scalar_model, chat_template=False)
    scores = builtin.reward_model(COMPLETIONS, PROMPTS, cfg)
    expected = reference_scores(scalar_model, ["12+30=42", "2+2=" + COMPLETIONS[1], "7+1=8"])[:, 0]
    assert scores == pytest.approx(expected.tolist(), abs=1e-5)


def test_classifier_gives_the_probability_of_its_label(tmp_path, registry):
    path = save_classifier(tmp_path / "clf", num_labels=3, seed=1)
    runner = build_reward_runner([Choice("reward_model", {"path": path, "label": 2})], registry,
                                 example_sample=PROMPTS[0])
    result = runner.score(COMPLETIONS, PROMPTS)
    logits = reference_scores(path, [chatml(s["prompt"], c) for c, s in zip(COMPLETIONS, PROMPTS)])
    assert result.scores == pytest.approx(logits.softmax(-1)[:, 2].tolist(), abs=1e-6)
    with pytest.raises(ConfigError, match=r"rewards\[0\]: args.label: 3 is not a label of .* \(it has 3\)"):
        build_reward_runner([Choice("reward_model", {"path": path, "label": 3})], registry, example_sample=PROMPTS[0])


def test_bad_paths_fail_at_config_load(tmp_path, registry):
    with pytest.raises(ConfigError, match=r"path: the folder .*nowhere does not exist"):
        builtin.RewardModelConfig(path=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"rewards\[0\]: args.path: .*empty does not load as a sequence-classification"):
        build_reward_runner([Choice("reward_model", {"path": str(tmp_path / "empty")})], registry,
                            example_sample=PROMPTS[0])


def test_a_run_trains_on_the_reward_models_scores(tmp_path, scalar_model):
    from rlite.testing import read_jsonl
    from rlite.tokenizer import build_tiny_model_dir
    from rlite.tools.cli import main

    policy = build_tiny_model_dir(tmp_path / "policy")
    config = tmp_path / "run.yaml"
    config.write_text(f"""\
model: {{path: {policy}}}
data: {{task: addition, num_train: 64, num_eval: 8}}
training: {{steps: 2, micro_batch_size: 8, eval_every: 0}}
rollout: {{prompts_per_step: 2, samples_per_prompt: 4, max_new_tokens: 4}}
logging: {{run_dir: {tmp_path / 'run'}, progress_bar: false, plot: false, loggers: [jsonl]}}
checkpoint: {{resume: never, save_final: false, export_hf: false}}
rewards:
  - {{name: reward_model, args: {{path: {scalar_model}}}}}
""")
    assert main(["train", str(config)]) == 0
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(steps) == 2
    for row in steps:
        assert row["reward/failures"] == 0 and row["reward/mean"] == pytest.approx(row["reward/reward_model"])
        assert row["reward/mean"] != 0.0
