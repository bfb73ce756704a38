"""The megatron backend's core attention through ``scaled_dot_product_attention``
(``rlite.plugins.megatron.attention``, issue #32): megatron's ``DotProductAttention`` formula, equal to float
rounding, for each mask the backend builds (causal ``[1, 1, S, S]``, dense causal-and-padding ``[B, 1, S, S]``
and the shared-prompt ``[b, 1, T, P + T]``), outputs and gradients, grouped-query heads included; rows
whose keys are all masked stay finite."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

import torch.distributed as dist  # noqa: E402

import rlite.plugins.megatron as megatron_plugin  # noqa: E402
from rlite.plugin_manager import build_plugin_manager  # noqa: E402
from rlite.testing import tiny_config  # noqa: E402
from rlite.tokenizer import build_tiny_model_dir  # noqa: E402


@pytest.fixture
def core_attention(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "dense", hidden=32, layers=1, heads=4, kv_heads=2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    cfg = tiny_config(model_dir, tmp_path, "parallelism.backend=megatron", pm=pm)
    made = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 1)
    yield made.model.decoder.layers[0].self_attention.core_attention
    made.close()
    dist.destroy_process_group()


def masks(batch: int, sq: int, prompt: int) -> dict[str, torch.Tensor]:
    """True where masked, as the backend builds them."""
    causal = torch.ones(sq, sq, dtype=torch.bool).triu(1)
    padding = torch.ones(batch, sq, dtype=torch.long)
    padding[0, :2] = 0  # leading padding: query rows 0 and 1 of row 0 see no key at all
    padding[1, 3] = 0  # a hole
    prompt_masked = torch.arange(prompt)[None] >= torch.tensor([prompt, prompt - 2, 1])[:batch, None]
    return {
        "causal": causal[None, None],
        "dense": causal[None, None] | (padding == 0)[:, None, None, :],
        "shared-prompt": torch.cat([prompt_masked[:, None].expand(-1, sq, -1), causal.expand(batch, -1, -1)], -1)[:, None],
    }


@pytest.mark.parametrize("kind", ["causal", "dense", "shared-prompt"])
def test_sdpa_attention_is_megatrons_formula(core_attention, kind):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rlite.plugins.megatron.attention import SDPAttention

    assert isinstance(core_attention, SDPAttention) and core_attention.supported()
    heads, groups = core_attention.num_attention_heads_per_partition, core_attention.num_query_groups_per_partition
    assert heads > groups, "grouped-query heads"
    batch, sq, prompt, dim = 3, 7, 5, core_attention.hidden_size_per_attention_head
    mask = masks(batch, sq, prompt)[kind]
    sk = mask.shape[-1]
    g = torch.Generator().manual_seed(0)
    query = torch.randn(sq, batch, heads, dim, generator=g)
    key, value = (torch.randn(sk, batch, groups, dim, generator=g) for _ in range(2))
    seen = ~mask.expand(batch, 1, sq, sk).all(-1)[:, 0].T  # [sq, b]: query rows with a key to attend to
    assert kind != "dense" or not seen.all(), "the case of a row whose keys are all masked"
    # a fully masked row's output is arbitrary (finite, never read): no gradient flows from it
    upstream = torch.randn(sq, batch, heads * dim, generator=g) * seen[..., None]
    results = []
    for forward in (SDPAttention.forward, DotProductAttention.forward):
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        out = forward(core_attention, *inputs, mask)
        (out * upstream).sum().backward()
        results.append((out.detach(), [t.grad for t in inputs]))
    (ours, our_grads), (theirs, their_grads) = results
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[seen], theirs[seen], atol=1e-6, rtol=1e-5)
    for mine, reference in zip(our_grads, their_grads):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=1e-4)
