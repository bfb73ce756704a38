"""SGLangEngine on a real GPU: flattened-bucket sync from a Hugging Face model, log-probs checked
against a teacher-forced forward of that model. Skipped without CUDA or SGLang.

Not run yet (written on a machine without a GPU); see docs/weight_sync.md.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlite.engines.base import SamplingParams
from rlite.plugins.fsdp2.weights import iter_full_tensors

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang"),
]

EOS = 1


def _tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 64: every SGLang attention backend takes it
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2-gpu")
    torch.manual_seed(0)
    Qwen2ForCausalLM(_tiny_config()).to(torch.bfloat16).save_pretrained(path)
    return path


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32).to(p.dtype) * 0.02)


@torch.no_grad()
def _teacher_forced_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens], device="cuda")
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return (
        torch.log_softmax(logits, -1)
        .gather(-1, torch.tensor(tokens, device="cuda")[:, None])
        .squeeze(-1)
        .cpu()
    )


@pytest.mark.parametrize("launch", ["engine", "server"])
def test_synced_engine_logprobs_match_a_teacher_forced_forward(model_dir, launch):
    from transformers import AutoModelForCausalLM

    from rlite.plugins.sglang.engine import SGLangEngine

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    engine = SGLangEngine(
        model_dir,
        eos_token_ids=[EOS],
        timeout_s=300.0,
        start_timeout_s=600.0,
        launch=launch,
        dtype="bfloat16",
        mem_fraction_static=0.3,
        bucket_bytes=1 << 20,  # several buckets even for a tiny model
        engine_kwargs={"disable_cuda_graph": True, "random_seed": 0},
    )
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        previous = None
        for version in (1, 2):
            _perturb(trainer, version)
            engine.release_memory()  # as before a training step
            engine.update_weights(iter_full_tensors(trainer, lora_merge=False), version)
            engine.resume_memory()
            completions = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0))
            assert len(completions) == 4 and all(c.weight_version == version for c in completions)
            diffs = []
            for c in completions:
                assert len(c.token_ids) == len(c.logprobs) > 0
                reference = _teacher_forced_logprobs(trainer, prompts[c.prompt_index], c.token_ids)
                diffs.append((torch.tensor(c.logprobs) - reference).abs())
            diffs = torch.cat(diffs)
            # bf16 engine vs bf16 teacher-forced forward: rounding-level differences only
            assert diffs.max() < 0.15 and diffs.mean() < 0.03, (diffs.max(), diffs.mean())
            if previous is not None:  # the second sync really changed the served weights
                c = completions[0]
                stale = _teacher_forced_logprobs(previous, prompts[c.prompt_index], c.token_ids)
                assert (torch.tensor(c.logprobs) - stale).abs().max() > 1e-3
            previous = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
            previous.load_state_dict(trainer.state_dict())
    finally:
        engine.shutdown()
