"""Functions that spawned ranks of rlite's own tests run, importable by name in the child processes
(``tests/conftest.py`` puts this folder on ``sys.path``, which ``spawn`` hands to its children).

They reach into rlite's own implementations (the FSDP2 backend's models: the weight stream's self-check,
the three models' full weights; the SGLang stand-in, ``fake_sglang.py`` beside this file), which is why
they live with the tests and not in :mod:`rlite.testing`, which the product (the audit) imports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from rlite.config import load_config
from rlite.testing import fixed_batch, recorded_runs, tiny_config


def fixed_batch_update(
    rank: int,
    world_size: int,
    init_file: str,
    model_dir: str,
    out_file: str,
    micro_batch_size: int,
    agg_mode: str,
    minibatches: int = 1,
    share_prompts: bool = False,
    optimizer_offload: str = "none",
    plain: bool = False,
    backend_choice: str = "",
    routing_replay: bool = False,
    max_tokens: int = 0,
    pack: bool = False,
) -> None:
    """One optimizer step of the real FSDP2 backend on a fixed global batch; rank r takes slice r.

    Writes the loss metrics and the updated full parameters to ``out_file`` (rank 0). Used by the
    world-size and micro-batching invariance tests. ``plain`` (world size 1) keeps the model without
    FSDP2, accumulating its weight gradients in place (``rlite.training.grad_accumulation``). AdamW runs with
    eps=1 so that its first step is about lr * grad (linear in the gradient) instead of
    lr * sign(grad), which would turn rounding noise in near-zero gradients into full-size weight
    differences. ``backend_choice`` (a ``parallelism.backend`` value such as
    ``{name: megatron, args: {expert_parallel: 2}}``) builds that backend through the plugin registry
    instead of FSDP2. ``routing_replay`` (an MoE model): the batch carries an engine's routing, which
    the forward replays. ``max_tokens``: a token budget per micro-batch (``training.max_tokens_per_micro_batch``);
    ``pack``: padding-free forwards (``training.pack_sequences``).
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        from rlite.algorithms import AdvantageInput
        from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
        from rlite.plugin_manager import build_plugin_manager
        from rlite.plugins.fsdp2.backend import FSDP2Backend
        from rlite.plugins.fsdp2.weights import stream_self_check
        from rlite.rollout import TrainTargets
        from rlite.stages.update import LossSpec, update_policy
        from rlite.training.backend import ForwardSpec

        pm = build_plugin_manager(autoload=False)
        grpo = pm.registry("advantage_estimator").get("grpo")
        ppo_clip = pm.registry("policy_loss").get("ppo_clip")

        if backend_choice:
            from rlite.plugin_manager import resolve_choice

            pm = build_plugin_manager()  # with entry-point plugins, where such backends come from
            run_cfg = load_config(None, [
                f"model.path={model_dir}", "data.task=addition", f"parallelism.backend={backend_choice}",
                "training.lr=1e-2", "training.eps=1.0", "training.grad_clip=0.0",
                f"training.micro_batch_size={micro_batch_size}",
            ], pm)
            factory, backend_cfg = resolve_choice(pm.registry("training_backend"), run_cfg.parallelism.backend)
            backend = factory(run_cfg, backend_cfg, torch.device("cpu"), minibatches)
        else:
            backend = FSDP2Backend.build(
                ModelConfig(path=model_dir),
                ParallelismConfig(shard_single_process=not plain),
                TrainingConfig(
                    lr=1e-2, eps=1.0, grad_clip=0.0, micro_batch_size=micro_batch_size,
                    optimizer_offload=optimizer_offload,
                ),
                torch.device("cpu"),
                total_optimizer_steps=minibatches,
                offload_dir=Path(init_file).parent / f"{Path(out_file).stem}-moments-rank{rank}",
            )
        routing = plan = None
        if routing_replay:
            from transformers import AutoConfig

            from rlite.moe_routing import RoutingPlan

            hf = AutoConfig.from_pretrained(model_dir)
            routing = (hf.num_hidden_layers, hf.num_experts, hf.num_experts_per_tok)
            plan = RoutingPlan(replay=True)
        batch = fixed_batch(num_prompts=4, samples=4, prompt_len=6, max_len=7, vocab=250, routing=routing)
        advantages, returns = grpo.implementation(
            AdvantageInput(batch.scores, batch.group_ids, batch.response_mask), grpo.config_cls()
        )
        targets = TrainTargets(advantages, returns, batch.response_mask.clone())
        layout = backend.data_layout()
        per_rank = len(batch) // layout.size
        mine = slice(layout.rank * per_rank, (layout.rank + 1) * per_rank)
        metrics = update_policy(
            backend,
            batch.select(mine),
            targets.select(mine),
            ForwardSpec(micro_batch_size=micro_batch_size, temperature=1.0, chunk_size=16, exact_layout=False,
                        share_prompts=share_prompts, routing=plan, max_tokens_per_micro_batch=max_tokens,
                        pack_sequences=pack),
            LossSpec(ppo_clip.implementation, ppo_clip.config_cls(), agg_mode, 7.0, None, 0.0, 0.01),
            minibatches=minibatches,
            epochs=1,
            dp_size=layout.size,
            dp_group=layout.group,
        ).metrics
        params = {name: t.detach().clone() for name, t in backend.full_weights()}
        stream_exact = async_gather = None
        if not backend_choice:
            stream_exact, async_gather = stream_self_check(backend.model.lm)
        if rank == 0:
            main_params = getattr(backend, "main_params", None)  # megatron: the bytes of masters and moments it keeps
            optimizer_bytes = main_params.state_bytes(backend.optimizer) if main_params is not None else None
            torch.save(
                {"metrics": metrics, "params": params, "stream_exact": stream_exact, "async_gather": async_gather,
                 "optimizer_bytes": optimizer_bytes},
                out_file,
            )
        backend.close()
        dist.barrier()  # no rank tears the group down while another still uses it (gloo can crash)
    finally:
        dist.destroy_process_group()


def sharded_load(rank: int, world_size: int, init_file: str, model_dir: str, out_dir: str, lora: bool) -> None:
    """Build the FSDP2 policy, reference and critic as a run does, on ``world_size`` gloo ranks; writes to
    ``out_dir/rank<r>.pt`` the ``from_pretrained`` calls the rank made, how far its peak resident memory
    rose while it built each model (bytes), and (rank 0) the full weights of all three, gathered."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlite.config import CriticConfig, LoraConfig, ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    calls = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        calls.append(str(args[0]))
        return original(cls, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = classmethod(counted)

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            (line,) = [line for line in f if line.startswith(key + ":")]
        return int(line.split()[1]) * 1024

    def reset_peak() -> int:
        """The resident memory now, made the peak (Linux: ``5`` to ``clear_refs`` resets VmHWM)."""
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status("VmRSS")

    model_cfg = ModelConfig(path=model_dir, lora=LoraConfig(enabled=lora, rank=4))
    try:
        from rlite.hf_models import apply_lora, empty_causal_lm

        with torch.device("meta"):  # import what building the model imports before measuring
            apply_lora(empty_causal_lm(model_cfg), model_cfg.lora)
        torch.manual_seed(0)
        start = reset_peak()
        backend = FSDP2Backend.build(model_cfg, ParallelismConfig(), TrainingConfig(), torch.device("cpu"), 1)
        policy_rise = status("VmHWM") - start
        start = reset_peak()
        reference = backend.build_reference()
        reference_rise = status("VmHWM") - start
        start = reset_peak()
        critic = backend.build_critic(CriticConfig(enabled=True))
        critic_rise = status("VmHWM") - start
        weights = {}
        for prefix, model in (("policy", backend.model), ("reference", reference.model), ("critic", critic.model)):
            for name, param in model.state_dict().items():
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                weights[f"{prefix}.{name}"] = full.detach().clone()
            for name, buffer in model.named_buffers():
                weights[f"{prefix}.buffer.{name}"] = buffer.clone()
        result = {"from_pretrained": calls, "rise": (policy_rise, reference_rise, critic_rise)}
        if rank == 0:
            result["weights"] = weights
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def megatron_memory_steps(rank: int, world_size: int, init_file: str, model_dir: str, out_dir: str,
                          variants: dict[str, list[str]]) -> None:
    """For each ``variants`` entry (name -> overrides of a megatron run): two optimizer steps on a fixed
    global batch (rank r takes slice r of it) with a ``torch.distributed.checkpoint`` after the first, then the
    second step again from that checkpoint in a freshly built backend. Writes ``out_dir/<name>.rank<r>.pt``:
    the full weights after each step, after the resumed second step, and the bytes this rank keeps for the
    optimizer (masters and moments) after the first step. AdamW with eps=1, as :func:`fixed_batch_update`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        from rlite.algorithms import AdvantageInput
        from rlite.plugin_manager import build_plugin_manager, resolve_choice
        from rlite.rollout import TrainTargets
        from rlite.stages.update import LossSpec, update_policy
        from rlite.training.backend import ForwardSpec

        pm = build_plugin_manager()
        grpo = pm.registry("advantage_estimator").get("grpo")
        ppo_clip = pm.registry("policy_loss").get("ppo_clip")
        spec = ForwardSpec(micro_batch_size=4, temperature=1.0, chunk_size=16, exact_layout=False)
        loss = LossSpec(ppo_clip.implementation, ppo_clip.config_cls(), "token-mean", 7.0, None, 0.0, 0.01)
        batches = []
        for seed in (0, 1):
            batch = fixed_batch(num_prompts=4, samples=4, prompt_len=6, max_len=7, vocab=250, seed=seed)
            advantages, returns = grpo.implementation(
                AdvantageInput(batch.scores, batch.group_ids, batch.response_mask), grpo.config_cls()
            )
            batches.append((batch, TrainTargets(advantages, returns, batch.response_mask.clone())))

        for name, overrides in variants.items():
            run_cfg = load_config(None, [
                f"model.path={model_dir}", "data.task=addition", "training.lr=1e-2", "training.eps=1.0",
                "training.grad_clip=0.0", "training.micro_batch_size=4", f"logging.run_dir={out_dir}/{name}-run",
                *overrides,
            ], pm)

            def build(run_cfg=run_cfg):
                factory, backend_cfg = resolve_choice(pm.registry("training_backend"), run_cfg.parallelism.backend)
                return factory(run_cfg, backend_cfg, torch.device("cpu"), 2)

            def step(backend, batch_and_targets):
                batch, targets = batch_and_targets
                layout = backend.data_layout()
                per_rank = len(batch) // layout.size
                mine = slice(layout.rank * per_rank, (layout.rank + 1) * per_rank)
                update_policy(backend, batch.select(mine), targets.select(mine), spec, loss, minibatches=1, epochs=1,
                              dp_size=layout.size, dp_group=layout.group)
                return {n: t.detach().clone() for n, t in backend.full_weights()}

            backend = build()
            first = step(backend, batches[0])
            state_bytes = backend.main_params.state_bytes(backend.optimizer)
            checkpoint = Path(out_dir) / f"{name}-checkpoint"
            dcp.save(backend.checkpoint_state(), checkpoint_id=str(checkpoint))
            scheduler = backend.lr_scheduler_state()
            backend.after_checkpoint()
            second = step(backend, batches[1])
            backend.close()
            resumed_backend = build()
            state = resumed_backend.checkpoint_state()
            dcp.load(state, checkpoint_id=str(checkpoint))
            resumed_backend.load_checkpoint_state(state)
            resumed_backend.load_lr_scheduler_state(scheduler)
            resumed = step(resumed_backend, batches[1])
            resumed_backend.close()
            torch.save({"first": first, "second": second, "resumed": resumed, "state_bytes": state_bytes},
                       Path(out_dir) / f"{name}.rank{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def sglang_fake_run(rank: int, world_size: int, init_file: str, model_dir: str, run_dir: str, out_dir: str,
                    overrides: list[str]) -> None:  # fmt: skip
    """A real run at ``world_size`` (gloo) with ``rollout.engine=sglang`` against the fake SGLang
    (:mod:`fake_sglang`); each rank writes what its fake engines saw (ServerArgs, calls,
    the weights each TP rank holds) to ``out_dir/rank<r>.pt``, rank 0 the exported model too."""
    import torch.distributed as dist
    from fake_sglang import FakeSGLangEngine, fake_sglang_modules

    from rlite.run.loop import run_training

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    sys.modules.update(fake_sglang_modules())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        run_training(tiny_config(model_dir, run_dir, "rollout.engine=sglang", *overrides))
        dist.barrier()  # rank 0 may still be exporting; gloo aborts a rank whose peer tore the group down
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    engines = [
        {"server_args": e.server_args, "calls": e.calls, "rank_weights": e.rank_weights}
        for e in FakeSGLangEngine.instances
    ]
    torch.save({"engines": engines}, Path(out_dir) / f"rank{rank}.pt")


def recorded_runs_on_fake_sglang(rank: int, world_size: int, init_file: str, model_dir: str, out_dir: str,
                                 runs: list[tuple[str, list[str]]]) -> None:  # fmt: skip
    """:func:`rlite.testing.recorded_runs` where ``import sglang`` imports the stand-in (:mod:`fake_sglang`):
    for spawned ranks only, whose modules are their own."""
    from fake_sglang import fake_sglang_modules

    sys.modules.update(fake_sglang_modules())
    recorded_runs(rank, world_size, init_file, model_dir, out_dir, runs)
