"""Hugging Face -> megatron-core -> Hugging Face is bitwise, for every tensor/expert-parallel layout
(pure tensor bookkeeping: no megatron-core needed)."""

from __future__ import annotations

import pytest
import torch

from rlite.plugins.megatron.convert import (
    expert_index,
    hf_to_megatron_full,
    hf_to_megatron_local,
    megatron_to_hf,
    model_shape,
    tp_merge,
)


def tiny(kind: str):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    build = {
        "qwen2-tied": lambda: Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)),
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, tie_word_embeddings=False)),
        "qwen3-moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
        "qwen2-moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24)),
    }[kind]
    model = build()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # every entry distinct, so a misplaced row cannot pass
    return model


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama", "qwen3", "qwen3-moe", "qwen2-moe"])
@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_through_every_rank_shard_is_bitwise(kind, tp, ep) -> None:
    model = tiny(kind)
    hf = {name: t.detach() for name, t in model.state_dict().items()}
    shape = model_shape(model.config)
    if not shape.is_moe and ep > 1:
        pytest.skip("expert parallelism needs experts")
    locals_ = {(t, e): hf_to_megatron_local(hf, shape, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep)
               for t in range(tp) for e in range(ep)}
    per_rank = (shape.num_experts or ep) // ep

    def gathered(name):
        parts = expert_index(name)
        if parts is None:
            return tp_merge(name, [locals_[(t, 0)][name] for t in range(tp)])
        prefix, expert, suffix = parts
        owner = expert // per_rank
        return locals_[(0, owner)][f"{prefix}{expert - owner * per_rank}{suffix}"]

    names = [name for name, _ in hf_to_megatron_full(hf, shape, tp_size=tp)]
    back = dict(megatron_to_hf(((n, gathered(n)) for n in names), shape))
    expected = {n for n in hf if not (shape.tied_embeddings and n == "lm_head.weight")}
    assert back.keys() == expected
    for name in expected:
        assert torch.equal(back[name], hf[name]), name


def test_shards_hold_the_documented_rows() -> None:
    """TP rank r holds query groups [r*G/tp, (r+1)*G/tp) of linear_qkv and [gate_r; up_r] of linear_fc1."""
    model = tiny("qwen2-tied")
    hf = {name: t.detach() for name, t in model.state_dict().items()}
    shape = model_shape(model.config)
    rank1 = hf_to_megatron_local(hf, shape, tp_rank=1, tp_size=2, ep_rank=0, ep_size=1)
    hd, a = shape.head_dim, "model.layers.0.self_attn."
    qkv = rank1["decoder.layers.0.self_attention.linear_qkv.weight"]  # group 1 of 2: q heads 2-3, k_1, v_1
    assert torch.equal(qkv, torch.cat([hf[a + "q_proj.weight"][2 * hd : 4 * hd], hf[a + "k_proj.weight"][hd:],
                                       hf[a + "v_proj.weight"][hd:]]))
    fc1 = rank1["decoder.layers.0.mlp.linear_fc1.weight"]
    m = "model.layers.0.mlp."
    assert torch.equal(fc1, torch.cat([hf[m + "gate_proj.weight"][24:], hf[m + "up_proj.weight"][24:]]))
    # the vocabulary (67 rows) is padded to 68 with a zero row on the last TP rank
    embedding = rank1["embedding.word_embeddings.weight"]
    assert embedding.shape[0] == 34 and torch.equal(embedding[-1], torch.zeros(32))


def test_unsupported_models_are_refused_with_what_to_use() -> None:
    from transformers import GPT2Config

    from rlite.config import ConfigError

    with pytest.raises(ConfigError, match="model type 'gpt2' is not supported.*fsdp2"):
        model_shape(GPT2Config())


@pytest.mark.parametrize("kind", ["qwen2-tied", "llama", "qwen3-moe", "qwen2-moe"])
@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 2)])
def test_each_rank_reads_only_its_shard_of_a_safetensors_checkpoint_and_gets_the_same_weights(tmp_path, kind, tp, ep):
    """The lazy checkpoint (what the megatron backend builds a rank's model from) gives every rank the
    same tensors as the whole model loaded through transformers, reading one tensor at a time and
    none of another rank's experts; Qwen3-MoE checkpoints store experts one by one, which
    transformers fuses on load: the lazy state answers to the fused names."""
    from transformers import AutoModelForCausalLM

    from rlite.config import ModelConfig
    from rlite.plugins.megatron.backend import hf_weights
    from rlite.plugins.megatron.checkpoint_state import CheckpointState

    tiny(kind).save_pretrained(tmp_path)
    eager_model = AutoModelForCausalLM.from_pretrained(tmp_path)
    eager = {name: t.detach() for name, t in eager_model.state_dict().items()}
    shape = model_shape(eager_model.config, fused_experts=any(n.endswith("experts.gate_up_proj") for n in eager))
    if not shape.is_moe and ep > 1:
        ep = 1
    for t in range(tp):
        for e in range(ep):
            config, lazy, names = hf_weights(ModelConfig(path=str(tmp_path)))
            assert isinstance(lazy, CheckpointState) and names.keys() == eager.keys()
            assert model_shape(config, fused_experts=shape.fused_experts) == shape
            mine = hf_to_megatron_local(lazy, shape, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep)
            want = hf_to_megatron_local(eager, shape, tp_rank=t, tp_size=tp, ep_rank=e, ep_size=ep)
            assert mine.keys() == want.keys()
            assert all(torch.equal(mine[k], want[k]) for k in want)
            if shape.is_moe:
                own = range(e * shape.num_experts // ep, (e + 1) * shape.num_experts // ep)
                read_experts = {int(n.split(".experts.")[1].split(".")[0]) for n in lazy.reads if ".experts." in n}
                assert read_experts == set(own), (e, read_experts)
            assert len(lazy.reads) == len(set(lazy.reads))  # each tensor read once


def test_a_checkpoint_without_the_models_names_is_loaded_whole(tmp_path):
    from safetensors.torch import load_file, save_file

    from rlite.config import ModelConfig
    from rlite.plugins.megatron.backend import hf_weights

    tiny("llama").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({k.replace("model.norm.", "model.final_norm."): v for k, v in state.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    _, weights, _ = hf_weights(ModelConfig(path=str(tmp_path)))
    assert isinstance(weights, dict)  # not the lazy state: transformers loaded (and warned about) it
