"""Where each SGLang engine runs and how much memory it takes: the ServerArgs of every rank, computed on
CPU from a table of ranks (host, GPU, free memory, the trainer's memory to come), as the ``sglang``
engine plugin computes them at the start of a run.

Without this, every torchrun rank started its engine with SGLang's default ``base_gpu_id=0`` (all of
them on GPU 0) and ``mem_fraction_static`` left to SGLang, which sizes itself from the memory free at
its start and so takes the room the trainer's optimizer states need at its first step.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from fake_sglang import FakeSGLangEngine, fake_sglang_modules

from rlite.config import ConfigError, ModelConfig, RolloutConfig
from rlite.engines.placement import EngineContext, RankDevice
from rlite.plugins.sglang.group import SGLangGroupMember
from rlite.plugins.sglang.placement import GIB, engine_weight_bytes, plan_engines

torch.set_num_threads(1)


def gpu_ranks(hosts: int, per_host: int, *, free_gib=70.0, total_gib=80.0, to_come_gib=0.0, own_gpu_only=False):
    """``hosts`` machines of ``per_host`` ranks, rank r on its machine's GPU r % per_host (torchrun's
    layout); ``own_gpu_only``: every process sees just its own GPU (per-rank CUDA_VISIBLE_DEVICES)."""
    ranks = []
    for rank in range(hosts * per_host):
        host, local = divmod(rank, per_host)
        uuids = tuple(f"GPU-{host}-{i}" for i in range(per_host))
        ranks.append(RankDevice(
            rank=rank, host=f"node{host}", local_rank=local,
            gpu_index=0 if own_gpu_only else local, gpu_uuid=uuids[local],
            visible_gpus=(uuids[local],) if own_gpu_only else uuids,
            free_bytes=int(free_gib * GIB), total_bytes=int(total_gib * GIB), bytes_to_come=int(to_come_gib * GIB),
        ))  # fmt: skip
    return ranks


@pytest.mark.parametrize(
    "hosts, per_host, tp_size, expected",
    [
        (1, 1, 1, [((0,), 0)]),
        (1, 8, 1, [((r,), r) for r in range(8)]),
        (1, 8, 2, [((0, 1), 0), ((2, 3), 2), ((4, 5), 4), ((6, 7), 6)]),
        (1, 8, 4, [((0, 1, 2, 3), 0), ((4, 5, 6, 7), 4)]),
        (2, 4, 2, [((0, 1), 0), ((2, 3), 2), ((4, 5), 0), ((6, 7), 2)]),  # base_gpu_id counts per machine
        (2, 1, 4, [((0,), 0), ((1,), 0)]),  # one trainer rank per machine: its engine spans 4 GPUs there
    ],
)
def test_each_engine_sits_on_the_gpus_of_its_trainer_ranks(hosts, per_host, tp_size, expected):
    plans = plan_engines(gpu_ranks(hosts, per_host), tp_size=tp_size, mem_fraction=0.5)
    assert [(p.ranks, p.base_gpu_id) for p in plans] == expected
    assert all(p.server_args() == dict(tp_size=tp_size, base_gpu_id=p.base_gpu_id, gpu_id_step=1,
                                       mem_fraction_static=0.5) for p in plans)  # fmt: skip


def test_per_rank_visible_devices_place_each_engine_on_its_only_gpu_and_refuse_tensor_parallelism():
    ranks = gpu_ranks(1, 4, own_gpu_only=True)
    assert [p.base_gpu_id for p in plan_engines(ranks, tp_size=1, mem_fraction=0.5)] == [0, 0, 0, 0]
    with pytest.raises(ConfigError, match=r"tp_size=2: SGLang would run TP rank 1 .* trainer rank 1 runs on GPU GPU-0-1"):
        plan_engines(ranks, tp_size=2, mem_fraction=0.5)


def test_tp_size_must_divide_the_engine_ranks_of_a_machine():
    with pytest.raises(ConfigError, match=r"rollout.engine.args.tp_size=3 must divide the 4 engine ranks on node0"):
        plan_engines(gpu_ranks(1, 4), tp_size=3)


def test_memory_fraction_leaves_room_for_the_trainers_optimizer_states_and_sglangs_runtime():
    ranks = gpu_ranks(1, 2, free_gib=60.0, total_gib=80.0, to_come_gib=12.0)
    ranks[1] = RankDevice(**{**vars(ranks[1]), "free_bytes": 50 * GIB, "bytes_to_come": 14 * GIB})
    (plan,) = plan_engines(ranks, tp_size=2, bucket_bytes=512 << 20, weight_bytes=15 * GIB)
    # SGLang takes the fraction of the least free memory of its GPUs (50 GiB) and keeps the rest as slack:
    # the larger optimizer states (14 GiB), its runtime (80 GiB / 8) and twice a bucket must fit in it
    assert plan.mem_fraction_static == pytest.approx(1 - (14 + 10 + 1) / 50, abs=1e-3)
    assert plan.mem_fraction_static <= 1 - (14 + 10 + 1) / 50  # rounded down, never into the slack
    (plain,) = plan_engines(gpu_ranks(1, 1, free_gib=60.0), tp_size=1, runtime_reserve_bytes=4 * GIB,
                            bucket_bytes=0, weight_bytes=GIB)  # fmt: skip
    assert plain.mem_fraction_static == pytest.approx(1 - 4 / 60, abs=1e-3)


def test_weights_that_do_not_fit_beside_the_trainer_are_a_config_error():
    ranks = gpu_ranks(1, 1, free_gib=30.0, total_gib=80.0, to_come_gib=14.0)
    with pytest.raises(ConfigError, match=r"rollout.engine.args.mem_fraction_static: .* weights alone take 15.0 GiB"):
        plan_engines(ranks, tp_size=1, weight_bytes=15 * GIB)
    # a fraction the user sets is taken as it is
    (plan,) = plan_engines(ranks, tp_size=1, mem_fraction=0.7, weight_bytes=15 * GIB)
    assert plan.mem_fraction_static == 0.7


def test_no_gpu_leaves_the_fraction_to_sglang():
    (plan,) = plan_engines([RankDevice(0, "localhost", 0, None, None)], tp_size=1)
    assert plan.mem_fraction_static is None and plan.server_args() == dict(tp_size=1, base_gpu_id=0, gpu_id_step=1)


def test_engine_weight_bytes_count_the_models_parameters_in_the_engines_dtype(tmp_path):
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2)
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    assert engine_weight_bytes(str(model_dir), torch.bfloat16) == 2 * params
    assert engine_weight_bytes(str(model_dir), torch.bfloat16, quantized=True) < 2 * params


# -- the plugin: one call per rank, as build_run makes them -----------------------------------------


@pytest.fixture
def sglang_plugin(monkeypatch, tmp_path):
    for name, module in fake_sglang_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    from rlite.plugins.sglang import SGLangEngineConfig, make_sglang_engine
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2)
    tokenizer = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)

    def build(ranks, **args):
        cfg = SGLangEngineConfig(**args)
        engines = [
            make_sglang_engine(ModelConfig(path=str(model_dir)), tokenizer, RolloutConfig(sync_bucket_mb=64), cfg,
                               EngineContext(rank=r.rank, ranks=tuple(ranks)))
            for r in ranks
        ]  # fmt: skip
        return engines, [e.server_args for e in FakeSGLangEngine.instances]

    return build


def test_every_torchrun_rank_starts_its_engine_on_its_own_gpu(sglang_plugin):
    engines, args = sglang_plugin(gpu_ranks(1, 4, free_gib=70.0, to_come_gib=2.0))
    assert [a["base_gpu_id"] for a in args] == [0, 1, 2, 3] and all(a["tp_size"] == 1 for a in args)
    assert [a["gpu_id_step"] for a in args] == [1] * 4
    expected = 1 - (2 + 10 + 2 * 64 / 1024) / 70  # optimizer states, runtime reserve, two 64 MB buckets
    assert all(a["mem_fraction_static"] == pytest.approx(expected, abs=1e-3) for a in args)


def test_an_engine_over_two_ranks_is_started_by_the_first_and_fed_by_both(sglang_plugin):
    engines, args = sglang_plugin(gpu_ranks(1, 4), tp_size=2, mem_fraction_static=0.6)
    assert [(a["base_gpu_id"], a["tp_size"], a["mem_fraction_static"]) for a in args] == [(0, 2, 0.6), (2, 2, 0.6)]
    leaders, members = engines[0::2], engines[1::2]
    assert all(isinstance(m, SGLangGroupMember) for m in members)
    assert [e.group.ranks for e in leaders] == [(0, 1), (2, 3)] and [m.group.ranks for m in members] == [(0, 1), (2, 3)]
    # the members cast and quantize exactly as their engine's leader: their payloads go to its TP ranks
    assert all(m.capabilities == leaders[0].capabilities for m in members)


def test_placement_keys_cannot_hide_in_engine_kwargs():
    from rlite.plugins.sglang import SGLangEngineConfig

    with pytest.raises(ValueError, match="engine_kwargs.base_gpu_id: rlite puts each engine"):
        SGLangEngineConfig(engine_kwargs={"base_gpu_id": 3})
    with pytest.raises(ValueError, match="engine_kwargs.tp_size: set it as rollout.engine.args.tp_size"):
        SGLangEngineConfig(engine_kwargs={"tp_size": 2})


def test_one_process_on_cpu_leaves_the_memory_to_sglang(sglang_plugin):
    (engine,), (args,) = sglang_plugin(EngineContext.single_process().ranks)
    assert args["base_gpu_id"] == 0 and args["tp_size"] == 1 and "mem_fraction_static" not in args
    assert engine.group is None


# -- what the trainer will still allocate ---------------------------------------------------------


def test_the_backend_counts_adamws_moments_until_its_first_step(tmp_path):
    from rlite.distributed import init_distributed, shutdown_distributed
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2))
    ctx = init_distributed()  # a world of one: fully_shard needs a process group
    try:
        _check_bytes_to_come(tmp_path, model_dir)
    finally:
        shutdown_distributed(ctx)


def _check_bytes_to_come(tmp_path, model_dir):
    from rlite.config import CriticConfig, LoraConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend

    def build(**training):
        cfg = ModelConfig(path=model_dir, lora=LoraConfig(enabled=training.pop("lora", False), rank=4))
        return FSDP2Backend.build(cfg, ParallelismConfig(), TrainingConfig(**training), torch.device("cpu"), 1,
                                  offload_dir=tmp_path / "moments")  # fmt: skip

    backend = build()
    trainable = sum(p.numel() * p.element_size() for p in backend.trainable_parameters())
    assert backend.device_bytes_to_come() == 2 * trainable  # AdamW's two moments, fp32 like the weights
    critic = backend.build_critic(CriticConfig(enabled=True))
    critic_bytes = sum(p.numel() * p.element_size() for p in critic.model.parameters() if p.requires_grad)
    assert backend.device_bytes_to_come() == 2 * (trainable + critic_bytes)
    for param in backend.trainable_parameters():
        param.grad = torch.zeros_like(param)
    backend.step()  # the moments exist now: only the critic's are still to come
    assert backend.device_bytes_to_come() == 2 * critic_bytes
    lora = build(lora=True)
    assert lora.device_bytes_to_come() == 2 * sum(p.numel() * 4 for p in lora.trainable_parameters()) < trainable
    offloaded = build(optimizer_offload="disk")
    assert offloaded.device_bytes_to_come() == 0  # the moments live in files
    offloaded.close()
