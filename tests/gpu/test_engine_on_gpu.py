"""The built-in transformers engine on a GPU, reached by configuration alone. Skipped without CUDA.

* A GRPO run with the default engine settings samples on the trainer's GPU, in process (sharing the
  trainer's storage where the dtypes agree) and with ``rollout.engine.args.process=true`` in a spawned
  process fed CUDA-IPC buckets; after every sync the engine's weights equal the trainer's (in the
  engine's dtype) bit for bit; the run learns; the CUDA-graph decode was captured, not fallen back from.
* The ``static`` and ``graph`` decodes sample the ``loop`` decode's tokens on the GPU (float32, the same
  uniforms: every decode draws them from the CPU generator).
* The decodes' speed and the syncs' time per GB are measured for the report, never asserted.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlite import hookimpl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WARMSTART = str(Path(__file__).resolve().parents[2] / "examples" / "warmstart" / "addition-qwen2-1m")
PRECISIONS = {
    "bf16": ("model.dtype=bfloat16", "parallelism.param_dtype=bfloat16", "parallelism.reduce_dtype=bfloat16"),
    "fp32-masters": ("parallelism.param_dtype=bfloat16",),
}


@dataclass
class DigitRewardConfig:
    digit: str = "1"


class DigitReward:
    """Reward = fraction of completion characters equal to one digit (a random tiny model learns it)."""

    @hookimpl
    def register_reward_functions(self, register):
        def fraction_of_digit(completion, sample, cfg):
            return sum(ch == cfg.digit for ch in completion) / max(len(completion), 1)

        register("digit_fraction", fraction_of_digit, DigitRewardConfig)


class SyncChecker:
    """After every weight sync: the engine's weights, read back, equal the trainer's cast to the engine's
    dtype, bit for bit (``run`` is set once the run is built; the first sync happens while it is built)."""

    def __init__(self) -> None:
        self.run = None
        self.checked: list[int] = []

    @hookimpl
    def after_weight_sync(self, step, weight_version, engine):
        if self.run is None:
            return
        inner = getattr(engine, "engine", engine)  # the supervisor's engine
        held = dict(inner.named_weights())
        for name, weight in self.run.policy.backend.full_weights():
            if name not in held:
                continue  # a tied output layer, listed once
            mine = held[name]
            assert torch.equal(mine.to(weight.device), weight.to(mine.dtype)), f"sync v{weight_version}: {name} differs"
        self.checked.append(weight_version)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("where", ["in-process", "process"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_grpo_run_samples_on_the_gpu_by_default_and_learns(tmp_path, model_dir, where, precision, measure):
    from rlite.distributed import shutdown_distributed
    from rlite.plugin_manager import build_plugin_manager, set_plugin_manager
    from rlite.run.build import build_run
    from rlite.run.loop import train
    from rlite.testing import read_jsonl, tiny_config

    pm = build_plugin_manager(autoload=False)
    pm.register(DigitReward(), name="digit-reward")
    checker = SyncChecker()
    pm.register(checker, name="sync-checker")
    set_plugin_manager(pm)
    process = ("rollout.engine.args.process=true",) if where == "process" else ()
    try:
        cfg = tiny_config(model_dir, tmp_path / "run", *PRECISIONS[precision], *process, "rewards=[digit_fraction]",
                          "training.steps=12", "training.lr=3e-3", "training.eval_every=12",
                          "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6",
                          "training.micro_batch_size=32", "data.num_eval=32", pm=pm)
        run = build_run(cfg, pm)
        checker.run = run
        try:
            engine = getattr(run.engine, "engine", run.engine)
            if where == "in-process":
                assert engine.device.type == "cuda" and engine.decode == "graph"
                assert (engine.shared_bytes > 0) is (precision == "bf16"), "shares the storage where dtypes agree"
            else:
                assert engine.capabilities.reacquires_device_memory
                assert all(slot.buffer.is_cuda for slot in engine._sender.slots), "CUDA-IPC buckets in GPU memory"
            train(run)
            if where == "in-process":
                assert engine.graph_failure is None, f"the decode step was not captured: {engine.graph_failure}"
        finally:
            run.engine.shutdown()
            run.policy.backend.close()
            shutdown_distributed(run.ctx)
    finally:
        set_plugin_manager(None)
    assert checker.checked == list(range(1, 13)), "every sync of the run (after steps 1..12) was checked bitwise"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in rows if "eval/greedy_reward" in r]
    first, last = evals[0], evals[-1]
    measure(f"{precision} {where}: held-out greedy reward", f"{first['eval/greedy_reward']:.3f} -> "
            f"{last['eval/greedy_reward']:.3f}", note="step 0 -> 12, engine on the GPU by default")
    assert last["eval/greedy_reward"] >= first["eval/greedy_reward"] + 0.3
    train_rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(train_rewards[-3:]) > sum(train_rewards[:3])


def _addition_prompts(tokenizer, count: int) -> list[list[int]]:
    from rlite.config import DataConfig
    from rlite.data import load_prompt_splits

    train, _ = load_prompt_splits(DataConfig(task="addition", task_args={"digits": 2}, num_train=count, num_eval=8),
                                  tokenizer)
    return [item.prompt_ids for item in train.items[:count]]


def _engine(model_dir: str, decode: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlite.plugins.transformers.engine import TransformersEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda")
    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
                                decode=decode)
    return engine, tokenizer


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_static_and_graph_decodes_sample_the_loops_tokens_on_the_gpu(greedy, measure):
    from rlite.engines.base import SamplingParams

    params = SamplingParams(n=4, max_new_tokens=8, temperature=0.7, greedy=greedy, seed=3)
    out = {}
    for decode in ("loop", "static", "graph"):
        engine, tokenizer = _engine(WARMSTART, decode)
        out[decode] = engine.generate(_addition_prompts(tokenizer, 64), params)
        if decode == "graph":
            assert engine.graph_failure is None
    loop = out["loop"]
    assert any(c.finish_reason == "stop" for c in loop) and any(len(c.token_ids) > 2 for c in loop)
    for decode in ("static", "graph"):
        assert [c.token_ids for c in out[decode]] == [c.token_ids for c in loop], f"{decode} sampled other tokens"
        worst = max(abs(a - b) for x, y in zip(out[decode], loop) for a, b in zip(x.logprobs, y.logprobs))
        measure(f"{decode} vs loop decode on the GPU ({'greedy' if greedy else 'sampled'}): max |log-prob diff|",
                f"{worst:.2e}", "nats", "fp32, 256 completions of the warm start")
        assert worst < 1e-4


def test_decode_speed_loop_against_graph(tmp_path, measure):
    """Tokens per second of the loop and the graph decode on a 0.2B model in bf16, 128 rows x 256 tokens."""
    from rlite.engines.base import SamplingParams
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "m", hidden=1024, layers=12, heads=16, kv_heads=4,
                                         intermediate=2816, vocab_size=32000, max_position_embeddings=1024))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (200,), generator=g).tolist() for _ in range(16)]
    params = SamplingParams(n=8, max_new_tokens=256, temperature=1.0, seed=0, ignore_eos=True)
    rates = {}
    for decode in ("loop", "graph"):
        engine, _ = _engine(model_dir, decode, torch.bfloat16)
        engine.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=8, seed=0))  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        completions = engine.generate(prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for c in completions)
        assert tokens == 128 * 256
        rates[decode] = tokens / seconds
        measure(f"decode={decode}: generation", f"{rates[decode]:.0f}", "tokens/s",
                f"0.2B Qwen2 bf16, 128 rows x 256 new tokens, {seconds:.2f} s")
        del engine
        torch.cuda.empty_cache()
    measure("graph / loop decode speed", f"{rates['graph'] / rates['loop']:.1f}", "x")


def test_sync_time_per_gb_in_process_and_over_cuda_ipc(tmp_path, measure):
    """A 0.2B model's weights into the default in-process engine (bound, or cast to bf16 beside fp32
    masters) and into the spawned engine over CUDA-IPC buckets: milliseconds per GB of what the engine
    holds, median of later syncs (the first allocates)."""
    import gpu_workers  # noqa: F401  (the spawned engine's functions; puts tests/gpu on the child's path)
    from transformers import AutoTokenizer

    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.distributed import init_distributed, shutdown_distributed
    from rlite.hf_models import skeleton_causal_lm
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.plugins.transformers.engine import TransformersEngine
    from rlite.plugins.transformers.process import ProcessEngine
    from rlite.stages.sync import sync_weights_to_engine
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "m", hidden=1024, layers=12, heads=16, kv_heads=4,
                                         intermediate=2816, vocab_size=32000))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad, eos = tokenizer.pad_token_id, [tokenizer.eos_token_id]
    ctx = init_distributed()
    try:
        for precision, (model_dtype, compute) in {"bf16": ("bfloat16", "bfloat16"),
                                                 "fp32-masters": ("float32", "bfloat16")}.items():
            backend = FSDP2Backend.build(ModelConfig(path=model_dir, dtype=model_dtype),
                                         ParallelismConfig(param_dtype=compute), TrainingConfig(), ctx.device, 1)
            in_process = TransformersEngine(skeleton_causal_lm(model_dir, compute, device=ctx.device),
                                            pad_token_id=pad, eos_token_ids=eos, share_weights=True)
            spawned = ProcessEngine(model_dir, pad_token_id=pad, eos_token_ids=eos, timeout_s=300.0,
                                    dtype=getattr(torch, compute), weights_from_sync=True, device=ctx.device)
            try:
                for name, engine in (("in-process", in_process), ("CUDA IPC", spawned)):
                    times = []
                    for version in range(1, 6):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        sync_weights_to_engine(engine, backend, lora_sync="merged", quantizer=None, version=version)
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                    gb = sum(p.numel() for p in in_process.model.parameters()) * 2 / 1e9  # bf16 bytes the engine holds
                    ms = statistics.median(times[1:]) * 1e3
                    measure(f"sync {precision} -> {name}", f"{ms / gb:.2f}", "ms/GB",
                            f"{ms:.2f} ms for {gb:.2f} GB, median of 4 later syncs (first {times[0] * 1e3:.1f} ms)")
            finally:
                spawned.shutdown()
                backend.close()
                del in_process
                torch.cuda.empty_cache()
    finally:
        shutdown_distributed(ctx)
