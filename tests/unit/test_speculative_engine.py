"""Speculative decoding in the transformers engine: samples keep the policy's exact distribution
(chi-square against an enumerated joint), log-probs are the policy's (a teacher-forced forward),
greedy speculation is greedy decoding, stop tokens end rows inside accepted proposals, and the
spawned engine receives a trained draft's weights in its versioned, checksummed sync."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlite.engines import speculative
from rlite.engines.base import DraftSpec, EngineError, SamplingParams
from rlite.plugins.transformers.engine import TransformersEngine
from rlite.testing import chi_square_pvalue

torch.set_num_threads(1)
PAD, EOS = 0, 1


def peaky_model(vocab: int, seed: int, scale: float, hidden: int = 16, layers: int = 1):
    """A tiny random Qwen2 whose next-token distributions are far from uniform (a large output
    layer), so that a draft and a policy disagree measurably."""
    from rlite.testing import tiny_qwen2

    model = tiny_qwen2(vocab, seed=seed, hidden=hidden, layers=layers)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, scale, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def engine(target, *, method=None, draft_model=None, k=3, true_on_policy=False, eos=(EOS,)):
    spec = None if method is None else DraftSpec(method, k, model_path="in-memory" if draft_model is not None else None,
                                                  ngram_min=1, ngram_max=2)
    return TransformersEngine(target, pad_token_id=PAD, eos_token_ids=list(eos), true_on_policy=true_on_policy,
                              draft=spec, draft_model=draft_model)


@torch.no_grad()
def exact_joint(model, prompt: list[int], length: int, vocab: int) -> torch.Tensor:
    """P(t1..tL | prompt) for every sequence, by teacher-forced forwards of the policy."""
    joint = torch.zeros([vocab] * length, dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=length):
        ids = torch.tensor([prompt + list(seq)])
        probs = torch.softmax(model(ids).logits[0].double(), -1)
        joint[seq] = torch.prod(torch.stack([probs[len(prompt) - 1 + i, t] for i, t in enumerate(seq)]))
    return joint


def sequence_counts(completions, vocab: int, length: int) -> torch.Tensor:
    index = torch.tensor([sum(t * vocab ** (length - 1 - i) for i, t in enumerate(c.token_ids)) for c in completions])
    return torch.bincount(index, minlength=vocab ** length)


VOCAB, LENGTH, PROMPT = 4, 4, [2, 3, 2, 3, 2]


@pytest.fixture(scope="module")
def policy_and_draft():
    """A policy, and a draft that half agrees with it: the policy's output layer plus noise."""
    policy, draft = peaky_model(VOCAB, 0, 1.5), peaky_model(VOCAB, 0, 1.5)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(9)))
    return policy, draft, exact_joint(policy, PROMPT, LENGTH, VOCAB)


@pytest.mark.parametrize("method", ["model", "ngram"])
@pytest.mark.parametrize("true_on_policy", [False, True], ids=["kv-cache", "fixed-shape"])
def test_speculative_samples_have_the_policy_joint_distribution(policy_and_draft, method, true_on_policy):
    policy, draft, joint = policy_and_draft
    eng = engine(policy, method=method, draft_model=draft if method == "model" else None, eos=(),
                 true_on_policy=true_on_policy)
    out = eng.generate([PROMPT], SamplingParams(n=12_000, max_new_tokens=LENGTH, seed=5))
    assert all(len(c.token_ids) == LENGTH for c in out)
    stats = eng.speculation_stats()
    assert 0 < stats.accepted < stats.proposed  # proposals were accepted, and some were not
    assert chi_square_pvalue(sequence_counts(out, VOCAB, LENGTH), joint) > 1e-3
    first = torch.bincount(torch.tensor([c.token_ids[0] for c in out]), minlength=VOCAB)
    assert chi_square_pvalue(first, joint.sum((1, 2, 3))) > 1e-3  # a single token too


def test_resampling_from_p_instead_of_the_residual_fails_in_the_engine(policy_and_draft, monkeypatch):
    policy, draft, joint = policy_and_draft
    monkeypatch.setattr(speculative, "residual_distribution", lambda p, x, q, at: p.gather(
        1, at[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1))
    out = engine(policy, method="model", draft_model=draft, eos=()).generate(
        [PROMPT], SamplingParams(n=12_000, max_new_tokens=LENGTH, seed=5))
    assert chi_square_pvalue(sequence_counts(out, VOCAB, LENGTH), joint) < 1e-6


@pytest.fixture(scope="module")
def models():
    from rlite.testing import tiny_qwen2

    return tiny_qwen2(64, seed=0, hidden=32, layers=2), tiny_qwen2(64, seed=1, hidden=16, layers=1)


PROMPTS = [[5, 6, 7, 5, 6], [9, 10], [11, 12, 13, 14, 15, 16, 11, 12]]


@pytest.mark.parametrize("method", ["model", "ngram"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 8, 0.9)])
def test_logprobs_and_top_logprobs_are_a_teacher_forced_forward_of_the_policy(models, method, temperature, top_k, top_p):
    policy, draft = models
    eng = engine(policy, method=method, draft_model=draft if method == "model" else None, k=4)
    params = SamplingParams(n=4, max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, seed=3,
                            stop_token_ids=[7], top_logprobs=3)
    out = eng.generate(PROMPTS, params)
    assert eng.speculation_stats().emitted == sum(len(c.token_ids) for c in out)
    for c in out:
        prompt = PROMPTS[c.prompt_index]
        with torch.no_grad():
            logits = policy(torch.tensor([prompt + c.token_ids])).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        expected = logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=2e-5)
        values, ids = logp.topk(3, -1)
        torch.testing.assert_close(torch.from_numpy(c.top_logprobs), values, rtol=0, atol=2e-5)
        assert (torch.from_numpy(c.top_ids) == ids).float().mean() > 0.95  # near-ties may swap
        assert c.finish_reason == ("stop" if c.token_ids[-1] in (7, EOS) else "length")
        assert all(t not in (7, EOS) for t in c.token_ids[:-1])  # nothing after a stop token


@pytest.mark.parametrize("method", ["model", "ngram"])
@pytest.mark.parametrize("true_on_policy", [False, True], ids=["kv-cache", "fixed-shape"])
def test_greedy_speculation_is_greedy_decoding(models, method, true_on_policy):
    policy, draft = models
    plain = engine(policy, true_on_policy=true_on_policy).generate(
        PROMPTS, SamplingParams(n=2, max_new_tokens=12, greedy=True, seed=0))
    stop = plain[0].token_ids[4]  # stops some rows mid-way, maybe inside accepted proposals
    params = SamplingParams(n=2, max_new_tokens=12, greedy=True, seed=0, stop_token_ids=[stop])
    plain = engine(policy, true_on_policy=true_on_policy).generate(PROMPTS, params)
    spec_engine = engine(policy, method=method, draft_model=draft if method == "model" else None, k=3,
                         true_on_policy=true_on_policy)
    spec = spec_engine.generate(PROMPTS, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]
    assert "stop" in [c.finish_reason for c in spec]
    for a, b in zip(plain, spec):
        if true_on_policy:  # the trainer's fixed-shape forward on both sides: bitwise
            assert a.logprobs == b.logprobs
        else:
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=2e-5)


def test_a_draft_the_policy_agrees_with_is_always_accepted(models):
    """The policy as its own draft: q = p, every proposal accepted, k + 1 tokens per verification
    (the first step of a call is a plain one, and the last ones are cut by max_new_tokens)."""
    policy, _ = models
    eng = engine(policy, method="model", draft_model=policy, k=3, eos=())
    out = eng.generate([[5, 6, 7]], SamplingParams(n=8, max_new_tokens=9, seed=1))
    stats = eng.speculation_stats()
    assert stats.accepted == stats.proposed > 0
    assert stats.verifications == 8 * 3  # 1 plain + 4 tokens + 4 tokens = 9
    assert stats.emitted == sum(len(c.token_ids) for c in out) == 8 * 9


def test_an_engine_refuses_what_it_cannot_run(models):
    policy, draft = models
    with pytest.raises(EngineError, match="cannot run a 'eagle' draft"):
        TransformersEngine(policy, pad_token_id=PAD, eos_token_ids=[EOS], draft=DraftSpec("eagle", 2, model_path="x"))
    from rlite.testing import tiny_qwen2

    with pytest.raises(EngineError, match="draft's vocabulary has 80 tokens, the policy's 64"):
        engine(policy, method="model", draft_model=tiny_qwen2(80, seed=2, hidden=16, layers=1))
