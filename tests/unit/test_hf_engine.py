"""The transformers engine: one prefill per prompt gives the same samples as a prefill per sample."""

from __future__ import annotations

import pytest
import torch

from rlite.engines.base import SamplingParams
from rlite.plugins.transformers.engine import TransformersEngine
from rlite.tokenizer import build_tiny_model_dir


def _engine(tmp_path, share):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model_dir(tmp_path / "m"))
    return TransformersEngine(model, pad_token_id=256, eos_token_ids=[258], share_prefill=share)


def test_shared_prefill_gives_the_same_greedy_tokens_and_close_logprobs(tmp_path):
    prompts = [[10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34, 35]]
    params = SamplingParams(n=3, max_new_tokens=5, greedy=True, seed=0)
    plain = _engine(tmp_path, False).generate(prompts, params)
    shared = _engine(tmp_path, True).generate(prompts, params)
    assert [c.token_ids for c in plain] == [c.token_ids for c in shared]
    assert [c.prompt_index for c in shared] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for a, b in zip(plain, shared):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)


def test_sampling_is_reproducible_from_the_seed(tmp_path):
    engine = _engine(tmp_path, True)
    params = SamplingParams(n=4, max_new_tokens=6, temperature=0.8, seed=123)
    first = engine.generate([[5, 6, 7], [8, 9]], params)
    again = engine.generate([[5, 6, 7], [8, 9]], params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert all(c.finish_reason in ("stop", "length") for c in first)
    assert all(len(c.logprobs) == len(c.token_ids) for c in first)


def test_lean_decode_loop_matches_generate(tmp_path):
    """The lean loop (finished rows leave the batch) samples greedily exactly what HF generate does."""
    from transformers import AutoModelForCausalLM
    from transformers import AutoModelForCausalLM as Auto

    model_dir = build_tiny_model_dir(tmp_path / "m")
    prompts = [[10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34, 35], [40]]
    free = TransformersEngine(Auto.from_pretrained(model_dir), pad_token_id=256, eos_token_ids=[258], decode="generate")
    unstopped = free.generate(prompts, SamplingParams(n=1, max_new_tokens=8, greedy=True, seed=0))
    stop_id = unstopped[0].token_ids[2]  # stops the first prompt early; the others may run on
    for n in (1, 3):
        params = SamplingParams(n=n, max_new_tokens=8, greedy=True, seed=0, stop_token_ids=[stop_id])
        outs = {}
        for decode in ("loop", "generate"):
            model = AutoModelForCausalLM.from_pretrained(model_dir)
            engine = TransformersEngine(model, pad_token_id=256, eos_token_ids=[258], decode=decode)
            outs[decode] = engine.generate(prompts, params)
        assert [c.token_ids for c in outs["loop"]] == [c.token_ids for c in outs["generate"]]
        assert [c.finish_reason for c in outs["loop"]] == [c.finish_reason for c in outs["generate"]]
        assert "stop" in [c.finish_reason for c in outs["loop"]]
        for a, b in zip(outs["loop"], outs["generate"]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)


def test_inverse_cdf_sampler_draws_the_categorical_distribution():
    from rlite.plugins.transformers.engine import sample_categorical

    # two rows with different distributions; unnormalised; a zero-probability (filtered) token
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.125, 0.125], [1e-3, 2.0, 0.0, 0.999, 1.0]])
    expected = probs / probs.sum(-1, keepdim=True)
    n = 40_000
    torch.manual_seed(0)
    draws = torch.stack([sample_categorical(probs) for _ in range(n)])  # [n, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=5).double()
        assert counts[expected[row] == 0].sum() == 0  # a filtered token is never drawn
        nonzero = expected[row] > 0
        e = n * expected[row][nonzero].double()
        chi2 = ((counts[nonzero] - e) ** 2 / e).sum().item()
        assert chi2 < 20.0, (row, counts, e)  # 99.95th percentile of chi2 with <= 4 dof is ~20
    # the rarest token (p = 2.5e-4 in row 1) still gets its share
    assert 2 <= int((draws[:, 1] == 0).sum()) <= 25


def test_inverse_cdf_sampler_rejects_invalid_rows():
    from rlite.engines.base import EngineError
    from rlite.plugins.transformers.engine import sample_categorical

    for bad in ([float("nan"), 1.0], [0.0, 0.0], [float("inf"), 1.0]):
        with pytest.raises(EngineError, match="NaN, infinite or all zero"):
            sample_categorical(torch.tensor([[0.5, 0.5], bad]))
