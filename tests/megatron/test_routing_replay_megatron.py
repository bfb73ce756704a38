"""Rollout routing replay through the megatron backend (megatron-core's RouterReplay): the experts its
routers actually dispatch to (their routing map, read from the router module's output) are the
engine's, also after the router weights were perturbed; and the real loop with FP8 rollouts shows
the same effect as with FSDP2 (tests/integration/test_routing_replay.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

import torch.distributed as dist  # noqa: E402

import rlite.plugins.megatron as megatron_plugin  # noqa: E402
from rlite.engines.base import SamplingParams  # noqa: E402
from rlite.hf_models import load_causal_lm  # noqa: E402
from rlite.moe_routing import RoutingPlan, RoutingStats  # noqa: E402
from rlite.plugin_manager import build_plugin_manager  # noqa: E402
from rlite.plugins.megatron.backend import left_aligned_columns  # noqa: E402
from rlite.plugins.megatron.routing import moe_routers  # noqa: E402
from rlite.plugins.transformers.engine import TransformersEngine  # noqa: E402
from rlite.rollout import build_rollout_batch, model_inputs  # noqa: E402
from rlite.testing import tiny_config  # noqa: E402
from rlite.training.backend import ForwardSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_routing_replay import check_replay_metrics, run, strong_experts_moe  # noqa: E402


def plugins():
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    return pm


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return strong_experts_moe(tmp_path_factory.mktemp("moe") / "strong")


def test_megatron_routes_to_the_engines_experts_under_replay_whatever_its_router_weights(tmp_path, moe_dir):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pm = plugins()
    cfg = tiny_config(moe_dir, tmp_path, "parallelism.backend=megatron", pm=pm)
    backend = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 1)
    try:
        engine = TransformersEngine(load_causal_lm(cfg.model), pad_token_id=0, eos_token_ids=[1])
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
        completions = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=1, return_routed_experts=True))
        batch = build_rollout_batch(prompts, completions, [{}] * 3, 0, 0)
        inputs = model_inputs(batch)
        # the forward's token grid: each row rotated past its left padding (the backend's causal-only layout)
        columns, _ = left_aligned_columns(inputs.attention_mask)
        grid = inputs.routed_experts.gather(1, columns[:, :, None, None].expand_as(inputs.routed_experts))
        recorded = grid.transpose(0, 1).reshape(-1, *grid.shape[2:]).long()
        valid = recorded[:, 0, 0] >= 0
        maps = {}
        hooks = [router.register_forward_hook(lambda m, i, out, layer=layer: maps.__setitem__(layer, out[1]))
                 for layer, router in moe_routers(backend.model)]

        def dispatched_as_engine(replay: bool) -> float:
            used = RoutingStats(2)
            spec = ForwardSpec(micro_batch_size=6, temperature=1.0, chunk_size=16, exact_layout=False,
                               routing=RoutingPlan(replay, used_stats=used))
            with torch.no_grad():
                backend.logprobs(batch, spec)
            agree = []
            for layer, routing_map in maps.items():  # [s * b tokens, experts] bool: what megatron dispatched
                engine_map = torch.zeros_like(routing_map).scatter(1, recorded[:, layer].clamp(min=0), True)
                agree.append((routing_map == engine_map).all(-1)[valid].float().mean())
            assert used.compared.sum() == 2 * valid.sum()
            return float(torch.stack(agree).mean())

        assert dispatched_as_engine(True) == 1.0
        with torch.no_grad():
            for _, router in moe_routers(backend.model):
                router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(5)) * 2 * router.weight.abs().mean())
        assert dispatched_as_engine(False) < 0.9  # the perturbed routers would send many tokens elsewhere
        assert dispatched_as_engine(True) == 1.0
        for hook in hooks:
            hook.remove()
    finally:
        backend.close()
        dist.destroy_process_group()


def test_megatron_fp8_rollouts_route_differently_and_replay_lowers_the_mismatch(tmp_path, moe_dir):
    rows = run(tmp_path, moe_dir, "megatron", "parallelism.backend=megatron", "algorithm.routing_replay=rollout", pm=plugins())
    check_replay_metrics(rows)
