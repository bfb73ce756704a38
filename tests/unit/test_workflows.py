"""Multi-turn rollouts (rlite.workflows): token in and token out, observation masks, the engines, the
built-in environments and their configuration."""

from __future__ import annotations

import pytest
import torch

from rlite.config import ConfigError
from rlite.engines.base import SamplingParams
from rlite.plugin_manager import build_plugin_manager
from rlite.plugins.transformers.engine import TransformersEngine
from rlite.plugins.workflows import (
    ArithmeticChain,
    ArithmeticChainConfig,
    Calculator,
    CalculatorConfig,
    calculate,
)
from rlite.rollout import build_rollout_batch, model_inputs
from rlite.testing import tiny_config
from rlite.tokenizer import build_tiny_model_dir
from rlite.workflows import Action, SingleTurn, TurnRunner, trajectories_to_completions, turn_format

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    return TransformersEngine.from_pretrained(
        model_dir, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id]
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class SpyEngine:
    """Records what the engine was given and what it sampled (the real engine does the work)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        completions = self.engine.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], params.n, [list(c.token_ids) for c in completions],
                           [list(c.logprobs) for c in completions]))
        return completions


class Echo:
    """Observes ``" é!"`` (NFC-normalised text with a non-ASCII letter) after every turn, 3 turns."""

    def reset(self, sample):
        self.seen = []
        return None

    def step(self, action: Action):
        self.seen.append(action.token_ids)
        return " é!", 0.5, action.turn == 2


def test_turn_format_is_the_chat_templates_separators_encoded_once(tokenizer):
    eos = tokenizer.eos_token_id
    fmt = turn_format(tokenizer, "tool", True, [eos])
    assert fmt.before == encode(tokenizer, "<|im_end|>\n<|im_start|>tool\n")
    assert fmt.after == encode(tokenizer, "<|im_end|>\n<|im_start|>assistant\n")
    obs = encode(tokenizer, "42")
    # a turn that ended with its own <|im_end|> gets no second one; a truncated turn gets it closed
    assert fmt.wrap(obs, eos) == fmt.before[1:] + obs + fmt.after
    assert fmt.wrap(obs, ord("7")) == fmt.before + obs + fmt.after
    assert turn_format(tokenizer, "tool", False, [eos]).before == []


def test_trainer_input_ids_are_the_sampled_and_observed_tokens_exactly(engine, tokenizer):
    """The acceptance test of token in / token out: the random tiny model samples bytes that are not
    valid UTF-8, so decoding its turns and encoding them again gives other tokens; the batch the
    trainer reads holds the engine's own tokens and the observations' tokens, and the loss mask is 0
    on every observation token."""
    spy = SpyEngine(engine)
    fmt = turn_format(tokenizer, "user", True, [tokenizer.eos_token_id])
    runner = TurnRunner(Echo, tokenizer, fmt, max_turns=3, max_response_tokens=200)
    prompts = [encode(tokenizer, "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"), encode(tokenizer, "x")]
    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, seed=5)
    trajectories = runner.run(spy, prompts, [{"answer": "3"}, {"answer": ""}], params, lambda turn: 100 + turn)
    completions, masks = trajectories_to_completions(trajectories)
    for row, c in enumerate(completions):
        c.prompt_index = row
    batch = build_rollout_batch([t.context for t in trajectories], completions, [{}] * 6, 0,
                                tokenizer.pad_token_id, loss_masks=masks)  # fmt: skip
    inputs = model_inputs(batch)

    # the first turn is one call with n samples per prompt, later turns one call on the contexts so far
    assert spy.calls[0][0] == prompts and spy.calls[0][1] == 3
    observation = encode(tokenizer, " é!")
    retokenized_differently = 0
    for row, t in enumerate(trajectories):
        expected, expected_mask, expected_logprobs, context = [], [], [], list(t.context)
        for turn, (call_prompts, _, sampled, logprobs) in enumerate(spy.calls):
            if turn == 0:
                index = row
            else:  # later turns: this trajectory's row among the live ones, found by its exact context
                if context + expected not in call_prompts:
                    break
                index = call_prompts.index(context + expected)
            tokens = sampled[index]
            expected += tokens
            expected_mask += [1] * len(tokens)
            expected_logprobs += logprobs[index]
            if turn + 1 < t.turns:
                observed = fmt.wrap(observation, tokens[-1])
                expected += observed
                expected_mask += [0] * len(observed)
                expected_logprobs += [0.0] * len(observed)
        assert t.token_ids == expected
        width = len(expected)
        row_ids = inputs.input_ids[row][inputs.attention_mask[row].bool()].tolist()
        assert row_ids == t.context + expected  # what the trainer's forward reads
        assert batch.response_mask[row, :width].tolist() == expected_mask
        assert batch.response_mask[row, width:].sum() == 0
        assert batch.rollout_logprobs[row, :width].tolist() == pytest.approx(expected_logprobs, abs=0)
        sampled_only = [tok for tok, m in zip(expected, expected_mask) if m]
        retokenized_differently += encode(tokenizer, tokenizer.decode(sampled_only)) != sampled_only
        assert t.turns == 3 and t.finish_reason == "stop" and t.reward == 1.5
    assert retokenized_differently > 0, "the case must be one where text round trips change the tokens"
    assert (batch.response_mask * (1 - batch.response_present)).sum() == 0


def test_single_turn_workflow_samples_what_a_plain_rollout_samples(engine, tokenizer):
    runner = TurnRunner(SingleTurn, tokenizer, turn_format(tokenizer, "user", True, []), max_turns=4,
                        max_response_tokens=64)  # fmt: skip
    prompts = [encode(tokenizer, "12+3="), encode(tokenizer, "7+70=")]
    params = SamplingParams(n=4, max_new_tokens=6, temperature=0.9, seed=11)
    plain = engine.generate(prompts, params)
    trajectories = runner.run(engine, prompts, [{}, {}], params, lambda turn: 11 if turn == 0 else 99)
    assert [t.token_ids for t in trajectories] == [c.token_ids for c in plain]
    assert [t.logprobs for t in trajectories] == [c.logprobs for c in plain]
    assert all(t.turns == 1 and t.finish_reason == "stop" and t.loss_mask == [1] * len(t.token_ids)
               for t in trajectories)  # fmt: skip


def test_budget_and_turn_limit_end_trajectories(engine, tokenizer):
    class Forever:
        def reset(self, sample):
            return [65, 66]  # token ids appended to the prompt as they are

        def step(self, action):
            return [67] * 5, 1.0, False

    fmt = turn_format(tokenizer, "user", False, [])
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=3)
    for max_turns, budget in ((3, 1000), (50, 20)):
        runner = TurnRunner(Forever, tokenizer, fmt, max_turns=max_turns, max_response_tokens=budget)
        trajectories = runner.run(engine, [[70, 71]], [{}], params, lambda turn: turn)
        for t in trajectories:
            assert t.context == [70, 71, 65, 66]
            assert len(t.token_ids) <= budget
            assert t.loss_mask[-1] == 1  # a trajectory always ends with a sampled turn
            if max_turns == 3:
                assert t.turns == 3 and t.reward == 3.0 and t.finish_reason == "turns"
                assert t.loss_mask.count(0) == 2 * 5  # two observations between three turns
            else:
                assert t.finish_reason == "length" and t.turns < 50


def test_sglang_engine_takes_and_returns_token_ids(tokenizer):
    """Against the SGLang fake, whose tokens are a function of the input ids it is sent: every later
    turn's tokens are that function of the exact context (prompt, sampled tokens, observation tokens)."""
    from fake_sglang import FakeSGLang

    from rlite.plugins.sglang.engine import SGLangEngine

    fake = FakeSGLang()
    engine = SGLangEngine("unused", eos_token_ids=[1], backend=fake)
    fmt = turn_format(tokenizer, "user", True, [tokenizer.eos_token_id])
    runner = TurnRunner(Echo, tokenizer, fmt, max_turns=3, max_response_tokens=200)
    trajectories = runner.run(engine, [[5, 6, 7]], [{}], SamplingParams(n=2, max_new_tokens=3), lambda turn: turn)
    observation = fmt.wrap(encode(tokenizer, " é!"), None)

    def fake_tokens(ids):
        return [(sum(ids) + k) % 50 + 2 for k in range(3)]

    for t in trajectories:
        context, expected = [5, 6, 7], []
        for turn in range(3):
            expected += fake_tokens(context + expected)
            if turn < 2:
                expected += observation
        assert t.token_ids == expected
        assert t.loss_mask == ([1] * 3 + [0] * len(observation)) * 2 + [1] * 3
    assert [c for c in fake.calls if c[0] == "generate"] == [("generate", 2), ("generate", 2), ("generate", 2)]


def test_spawned_engine_runs_the_same_turns(model_dir, engine, tokenizer):
    from rlite.plugins.transformers.process import ProcessEngine

    fmt = turn_format(tokenizer, "user", True, [tokenizer.eos_token_id])
    runner = TurnRunner(Echo, tokenizer, fmt, max_turns=3, max_response_tokens=64)
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=7)
    prompts = [encode(tokenizer, "3+4=")]
    spawned = ProcessEngine(model_dir, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
                            timeout_s=60.0, start_timeout_s=120.0)  # fmt: skip
    try:
        remote = runner.run(spawned, prompts, [{}], params, lambda turn: 40 + turn)
    finally:
        spawned.shutdown()
    local = runner.run(engine, prompts, [{}], params, lambda turn: 40 + turn)
    assert [t.token_ids for t in remote] == [t.token_ids for t in local]
    assert [t.loss_mask for t in remote] == [t.loss_mask for t in local]
    assert any(0 in t.loss_mask for t in local)


# -- built-in environments ------------------------------------------------------------------------


def action(text: str, turn: int = 0) -> Action:
    return Action([], text, "stop", turn)


def test_calculate_evaluates_integer_arithmetic_only():
    assert calculate("17*23") == 391
    assert calculate("2+3*4") == 14
    assert calculate("-(5-8)*2") == 6
    for bad in ("__import__('os')", "7/2", "2**10", "1.5+1", "x+1", "9" * 14 + "*10", "1+"):
        assert calculate(bad) is None, bad


def test_calculator_answers_tool_calls_and_rewards_the_final_answer():
    env = Calculator(CalculatorConfig(call_cost=0.25))
    assert env.reset({"answer": "391"}) is None
    assert env.step(action("17*23=")) == ("391", -0.25, False)
    assert env.step(action("17*x=")) == ("error", -0.25, False)
    assert env.step(action(" 391\n")) == (None, 1.0, True)
    assert env.metrics() == {"tool_calls": 2.0, "used_tool": 1.0, "correct": 1.0}
    env.reset({"answer": "391"})
    assert env.step(action("390")) == (None, 0.0, True)
    assert env.metrics() == {"tool_calls": 0.0, "used_tool": 0.0, "correct": 0.0}


def test_arithmetic_chain_poses_the_same_problems_to_a_group_and_scores_each():
    cfg = ArithmeticChainConfig(steps=3, digits=2)
    a, b = ArithmeticChain(cfg), ArithmeticChain(cfg)
    a.reset({"prompt": "12+35=", "answer": "47"})
    b.reset({"prompt": "12+35=", "answer": "47"})
    assert a.problems == b.problems and len(a.problems) == 2
    x, y = map(int, a.problems[0][:-1].split("+"))
    observation, reward, done = a.step(action("47", 0))
    assert (observation, reward, done) == (a.problems[0], pytest.approx(1 / 3), False)
    assert a.step(action(str(x + y + 1), 1)) == (a.problems[1], 0.0, False)
    assert b.metrics() == {"turn_0_correct": 0.0, "turn_1_correct": 0.0, "turn_2_correct": 0.0, "correct": 0.0}
    x, y = map(int, a.problems[1][:-1].split("+"))
    assert a.step(action(str(x + y), 2)) == (None, pytest.approx(1 / 3), True)
    assert a.metrics() == {"turn_0_correct": 1.0, "turn_1_correct": 0.0, "turn_2_correct": 1.0, "correct": 0.0}
    with pytest.raises(ValueError, match="steps"):
        ArithmeticChainConfig(steps=0)


# -- configuration ----------------------------------------------------------------------------------


def test_workflow_config_is_checked(tmp_path, model_dir):
    pm = build_plugin_manager(autoload=False)
    with pytest.raises(ConfigError, match=r"rollout.workflow: unknown .*'calculatr'.*Did you mean 'calculator'"):
        tiny_config(model_dir, tmp_path, "rollout.workflow=calculatr", pm=pm)
    with pytest.raises(ConfigError, match="rollout.workflow=calculator \\(multi-turn\\) with rollout.true_on_policy=true.*set rollout.true_on_policy=false"):
        tiny_config(model_dir, tmp_path, "rollout.workflow=calculator", "rollout.true_on_policy=true", pm=pm)
    with pytest.raises(ConfigError, match="rollout.workflow.args: need steps >= 1"):
        tiny_config(model_dir, tmp_path, "rollout.workflow={name: arithmetic_chain, args: {steps: 0}}", pm=pm)
    with pytest.raises(ConfigError, match="max_turns"):
        tiny_config(model_dir, tmp_path, "rollout.max_turns=0", pm=pm)
    cfg = tiny_config(model_dir, tmp_path, "rollout.workflow={name: arithmetic_chain, args: {steps: 2}}", pm=pm)
    assert cfg.rollout.workflow.args == {"steps": 2, "digits": 2}


def test_a_weight_update_between_turns_resumes_under_the_new_weights(model_dir, tokenizer):
    """Partial rollouts at turn granularity: a sync between two turns (what asynchronous rollouts let
    in) makes the next turns sample from the new weights, and every token records its version."""
    kwargs = dict(pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id], share_weights=False)
    engine = TransformersEngine.from_pretrained(model_dir, **kwargs)
    versions = []

    def perturbed(version: int):
        g = torch.Generator().manual_seed(version)
        return [(name, p.detach() + 0.2 * torch.randn(p.shape, generator=g))
                for name, p in engine.model.named_parameters()]  # fmt: skip

    def sync_between_turns():
        version = engine.weight_version + 1
        weights = perturbed(version)
        versions.append((version, weights))
        engine.update_weights(weights, version)

    fmt = turn_format(tokenizer, "user", True, [tokenizer.eos_token_id])
    runner = TurnRunner(Echo, tokenizer, fmt, max_turns=3, max_response_tokens=200)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=9)
    spy = SpyEngine(engine)
    trajectories = runner.run(spy, [encode(tokenizer, "5+5=")], [{}], params, lambda turn: 30 + turn, sync_between_turns)
    assert [v for v, _ in versions] == [1, 2]
    for t in trajectories:
        turn_of_token, turn = [], 0
        for i, m in enumerate(t.loss_mask):
            turn += i > 0 and m == 1 and t.loss_mask[i - 1] == 0
            turn_of_token.append(turn if m else -1)
        assert t.weight_versions == turn_of_token  # turn k sampled with version k, observations -1
    completions, _ = trajectories_to_completions(trajectories)
    assert all(c.weight_version == 0 for c in completions)  # a sample's version is its oldest token's
    # turn 2 is what an engine holding version 2 from the start samples from the same contexts
    fresh = TransformersEngine.from_pretrained(model_dir, **kwargs)
    fresh.update_weights(versions[1][1], 2)
    prompts = spy.calls[2][0]
    again = fresh.generate(prompts, SamplingParams(n=1, max_new_tokens=6, temperature=1.0, seed=32))
    assert [c.token_ids for c in again] == spy.calls[2][2]
    assert [c.logprobs for c in again] == spy.calls[2][3]
