"""The transformers engine's fixed-shape decodes (``rlite.plugins.transformers.decode``).

``static`` keeps every row and does its bookkeeping on the device; on a CPU its tokens and log-probs
must equal the ``loop`` decode's bit for bit for the same seed (the loop is the reference). The
``graph`` path's step (whole-width cache, its own attention, device-side counters) cannot be captured
without CUDA, so here it runs uncaptured: the same tokens as the loop in float32 and log-probs within
float rounding, and no host synchronisation inside the step (which a CUDA graph capture refuses).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from rlite.engines.base import EngineError, SamplingParams
from rlite.plugins.transformers import decode
from rlite.plugins.transformers.engine import TransformersEngine, seeded
from rlite.rollout import left_pad
from rlite.tokenizer import build_tiny_model_dir

PAD, EOS = 256, 258


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("static-decode"), hidden=64, layers=2)


def engine(model_dir, mode: str, dtype=torch.float32, share_prefill: bool = True, **kwargs) -> TransformersEngine:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return TransformersEngine(model, pad_token_id=PAD, eos_token_ids=[EOS], decode=mode, share_prefill=share_prefill,
                              **kwargs)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in (5, 9, 7, 12, 3)]


@pytest.fixture(scope="module")
def stop_tokens(model_dir) -> list[int]:
    """Tokens the tiny model samples often: as stop tokens they end rows at many different lengths."""
    probe = engine(model_dir, "loop").generate(prompts(), SamplingParams(n=4, max_new_tokens=40, seed=5))
    return [token for token, _ in Counter(t for c in probe for t in c.token_ids).most_common(3)]


def as_grid(completions, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((len(completions), width), PAD, dtype=torch.long)
    logprobs = torch.zeros(len(completions), width)
    for row, c in enumerate(completions):
        tokens[row, : len(c.token_ids)] = torch.tensor(c.token_ids)
        logprobs[row, : len(c.logprobs)] = torch.tensor(c.logprobs)
    return tokens, logprobs


CASES = [
    dict(temperature=0.9),
    dict(temperature=0.9, top_k=20, top_p=0.9),
    dict(greedy=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("share_prefill", [True, False], ids=["shared-prefill", "own-prefill"])
@pytest.mark.parametrize("case", CASES, ids=["sampled", "top-k-top-p", "greedy"])
def test_static_decode_equals_the_loop_bit_for_bit(model_dir, stop_tokens, dtype, share_prefill, case):
    params = SamplingParams(n=4, max_new_tokens=40, seed=7, stop_token_ids=stop_tokens, **case)
    loop = engine(model_dir, "loop", dtype, share_prefill).generate(prompts(), params)
    static = engine(model_dir, "static", dtype, share_prefill).generate(prompts(), params)
    lengths = {len(c.token_ids) for c in loop}
    assert len(lengths) > 3 and max(lengths) == 40, "rows must stop at many different steps, some never"
    assert [c.token_ids for c in static] == [c.token_ids for c in loop]
    assert [c.logprobs for c in static] == [c.logprobs for c in loop]  # exactly, not approximately
    assert [c.finish_reason for c in static] == [c.finish_reason for c in loop]


def test_every_row_stopping_early_ends_the_static_decode_at_the_next_look(model_dir, monkeypatch):
    """When every row has stopped, the decode ends within ``CHECK_EVERY`` tokens, not at max_new_tokens."""
    calls = []
    real = decode.next_token_logits
    monkeypatch.setattr(decode, "next_token_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    greedy = engine(model_dir, "loop").generate(prompts(), SamplingParams(n=1, max_new_tokens=3, greedy=True))
    stops = sorted({c.token_ids[0] for c in greedy})  # every row's first greedy token stops it
    params = SamplingParams(n=1, max_new_tokens=200, greedy=True, stop_token_ids=stops)
    out = engine(model_dir, "static").generate(prompts(), params)
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in out)
    assert len(calls) == decode.CHECK_EVERY  # the first look at the stop flags comes after CHECK_EVERY steps


def test_ignore_eos_samples_to_the_length_limit(model_dir):
    e = engine(model_dir, "static")
    e.eos_token_ids = sorted({t for c in e.generate(prompts(), SamplingParams(n=2, max_new_tokens=8, seed=3))
                              for t in c.token_ids})  # every token it samples is an "end of sequence"
    stopped = e.generate(prompts(), SamplingParams(n=2, max_new_tokens=8, seed=3))
    assert all(len(c.token_ids) == 1 for c in stopped)
    full = e.generate(prompts(), SamplingParams(n=2, max_new_tokens=8, seed=3, ignore_eos=True))
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in full)


@contextlib.contextmanager
def no_host_synchronisation():
    """Every way a tensor's value reaches Python raises inside (what a CUDA graph capture refuses)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a host synchronisation inside the decode step")

    saved = {}
    names = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
    for name in names:
        saved[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def graph_path(model_dir, params, stop_ids, dtype=torch.float32, *, guard=False, monkeypatch=None):
    e = engine(model_dir, "static", dtype)
    ids, mask = left_pad([p for p in prompts() for _ in range(params.n)], PAD)
    if guard:  # every step but the first (the prefill's, shared with the loop) runs under the guard
        step = decode.GraphStep.__call__

        def guarded(self):
            with no_host_synchronisation():
                step(self)

        monkeypatch.setattr(decode.GraphStep, "__call__", guarded)
    with seeded(params.seed or 0, torch.device("cpu")):
        return decode.decode_graph(e, prompts(), ids, mask, params, stop_ids, capture=False)


@pytest.mark.parametrize("case", CASES, ids=["sampled", "top-k-top-p", "greedy"])
def test_the_graph_step_uncaptured_samples_the_loops_tokens_within_rounding(model_dir, stop_tokens, case, monkeypatch):
    params = SamplingParams(n=4, max_new_tokens=40, seed=7, stop_token_ids=stop_tokens, **case)
    loop = engine(model_dir, "loop").generate(prompts(), params)
    tokens, logprobs = graph_path(model_dir, params, sorted({*stop_tokens, EOS}), guard=True, monkeypatch=monkeypatch)
    expected_tokens, expected_logprobs = as_grid(loop, 40)
    assert torch.equal(tokens, expected_tokens)
    # the whole-width attention sums other lengths than the loop's: equal to float32 rounding, not bitwise
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-5)


def test_the_graph_steps_attention_equals_sdpa_over_repeated_heads():
    """``static_decode_attention`` groups the query heads of each key/value head instead of repeating the
    cache: the same attention as repeating keys and values per query head (transformers' repeat_kv)."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, width, dim = 3, 8, 2, 11, 16
    q = torch.randn(batch, heads, 1, dim, generator=g)
    k, v = torch.randn(2, batch, kv_heads, width, dim, generator=g)
    mask = torch.rand(batch, 1, 1, width, generator=g) > 0.3
    mask[..., 0] = True
    got, _ = decode.static_decode_attention(None, q, k, v, mask, scaling=dim**-0.5)
    groups = heads // kv_heads
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=mask, scale=dim**-0.5)
    assert got.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(got, reference.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_graph_decode_is_refused_where_it_cannot_run(model_dir):
    with pytest.raises(EngineError, match="decode='graph': CUDA graphs need a CUDA device"):
        engine(model_dir, "graph")
    with pytest.raises(EngineError, match="decode='static': true on-policy mode samples with the trainer's own"):
        engine(model_dir, "static", true_on_policy=True)


def test_a_failed_capture_refuses_an_explicit_graph_decode_and_falls_back_under_auto(model_dir):
    class Uncapturable:
        graph = None

        def capture(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    explicit = engine(model_dir, "static")
    explicit.decode = "graph"
    with pytest.raises(EngineError, match="decode='graph': the transformers engine could not capture .*operation not "
                                          "permitted.*set rollout.engine.args.decode=static"):
        decode.try_capture(Uncapturable(), explicit._graph_failed)
    chosen = engine(model_dir, "static", auto_decode=True)
    chosen.decode = "graph"
    with pytest.warns(RuntimeWarning, match="could not capture its decode step"):
        assert decode.try_capture(Uncapturable(), chosen._graph_failed) is False
    assert chosen.graph_failure.startswith("RuntimeError: operation not permitted")
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    expected = engine(model_dir, "static").generate(prompts(), params)  # what it decodes from then on
    assert [c.token_ids for c in chosen.generate(prompts(), params)] == [c.token_ids for c in expected]


def test_graph_decode_refuses_models_it_cannot_decode(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert decode.graph_decode_refusal(model) is None
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert "full attention only" in decode.graph_decode_refusal(model)


def test_the_host_synchronisation_guard_catches_a_planted_one():
    x = torch.ones(2)
    with no_host_synchronisation():
        for reach in (lambda: x.sum().item(), lambda: bool(x.all()), lambda: x.tolist(), lambda: int(x[0]),
                      lambda: float(x[0]), lambda: x.cpu()):
            with pytest.raises(AssertionError, match="host synchronisation"):
                reach()
    assert x.sum().item() == 2.0  # restored
