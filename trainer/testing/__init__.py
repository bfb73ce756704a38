"""Helpers for tests of rlite and of rlite plugins: tiny models, tiny configs, fixed batches.

Functions that run in spawned worker processes live here (not in test files) so that ``spawn`` can
import them by name.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from rlite.config import RunConfig, load_config
from rlite.distributed import spawn_local_ranks as spawn_ranks  # noqa: F401  (the tests' name for it)
from rlite.hookspecs import hookimpl


def tiny_config(model_dir: str | Path, run_dir: str | Path, *overrides: str, pm=None) -> RunConfig:
    """A run of a tiny model on the addition task: a few seconds per step on one CPU thread."""
    base = [
        f"model.path={model_dir}",
        "data.task=addition",
        "data.num_train=64",
        "data.num_eval=8",
        "training.steps=2",
        "training.micro_batch_size=8",
        "training.lr=1e-3",
        "training.eval_every=0",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        f"logging.run_dir={run_dir}",
        "logging.progress_bar=false",
        "logging.plot=false",
        "logging.loggers=[jsonl]",
        "checkpoint.resume=never",
        "checkpoint.save_final=false",
        "checkpoint.export_hf=false",
    ]
    if pm is None:
        from rlite.plugin_manager import get_plugin_manager

        pm = get_plugin_manager()
    return load_config(None, base + list(overrides), pm=pm)


def tiny_qwen2(vocab_size: int = 96, *, tie: bool = False, seed: int = 0, hidden: int = 32, layers: int = 2,
               arch: str = "qwen2"):
    """An in-memory random Qwen2ForCausalLM (or, with ``arch="llama"``, LlamaForCausalLM) of a few ten
    thousand parameters (eval mode); seeds the global RNG with ``seed`` first, so the weights are a
    function of the arguments."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    torch.manual_seed(seed)
    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return model_cls(cfg).eval()


def fixed_batch(num_prompts: int, samples: int, prompt_len: int, max_len: int, vocab: int, seed: int = 0,
                routing: tuple[int, int, int] | None = None):
    """A deterministic :class:`~rlite.rollout.ScoredBatch` with ragged prompts and responses and scores with
    spread (one reward function, whose value is the score; an answer is right where it scored above 0).

    ``routing = (layers, experts, top_k)``: every completion also carries an engine's routing (``top_k``
    distinct experts per token and MoE layer, drawn at random), as an MoE engine reports it."""
    from rlite.engines.base import Completion
    from rlite.rollout import ScoredBatch, Scores, build_rollout_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, vocab - 3, (int(torch.randint(2, prompt_len + 1, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_prompts)
    ]
    completions = []
    for p in range(num_prompts):
        for _ in range(samples):
            length = int(torch.randint(1, max_len + 1, (1,), generator=g))
            ids = torch.randint(3, vocab - 3, (length,), generator=g).tolist()
            routed = None
            if routing is not None:
                layers, experts, top_k = routing
                tokens = len(prompts[p]) + length - 1
                routed = torch.stack([torch.randperm(experts, generator=g)[:top_k]
                                      for _ in range(tokens * layers)]).reshape(tokens, layers, top_k)
            completions.append(Completion(p, ids, [0.0] * length, "length", 0, routed_experts=routed))
    batch = build_rollout_batch(prompts, completions, [{"answer": ""}] * num_prompts, 0, pad_token_id=0)
    scores = torch.randint(0, 3, (len(completions),), generator=g).float()
    return ScoredBatch.of(batch, Scores(scores=scores, correct=scores > 0, reward_components=scores[:, None]))


def run_in_subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child ``rlite`` process: offline, one thread."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's log (``metrics.jsonl``, ``samples.jsonl``, ``eval.jsonl``), read by rlite's one
    reader of them, :func:`rlite.metrics.read_metrics` (provenance rows skipped, a torn last line dropped)."""
    from rlite.metrics import read_metrics

    return read_metrics(path)


class RankTurns:
    """A multi-turn environment whose trajectories end after ``rank + 1`` turns (``LOCAL_RANK``): the ranks
    of a run take different numbers of turns, and so pass different numbers of points between turns."""

    def __init__(self) -> None:
        self.turns = 1 + int(os.environ.get("LOCAL_RANK", "0"))

    def reset(self, sample):
        return None

    def step(self, action):
        return "go on", 0.0, action.turn + 1 >= self.turns


class RunRecorder:
    """A learnable reward (``digits``: the fraction of digits), the ``rank_turns`` workflow, and a record of
    every batch this rank drew and of the weights after every optimizer step. Rank r's producer pauses
    0.2 r s after each generation, so the ranks do not keep the same pace."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.weights: dict[str, torch.Tensor] = {}

    @hookimpl
    def register_reward_functions(self, register):
        register("digits", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))

    @hookimpl
    def register_rollout_workflows(self, register):
        register("rank_turns", lambda cfg, tokenizer: RankTurns())

    @hookimpl
    def after_rollout(self, step, batch):
        time.sleep(0.2 * int(os.environ.get("LOCAL_RANK", "0")))  # the ranks' producers keep different paces

    @hookimpl
    def after_rewards(self, step, batch):
        self.batches.append({
            "step": step, "versions": list(batch.weight_versions), "response_ids": batch.response_ids.clone(),
            "prompts": [row[mask.bool()].tolist() for row, mask in zip(batch.prompt_ids, batch.prompt_mask)],
            "responses": [row[: int(n)].tolist() for row, n in zip(batch.response_ids, batch.response_lengths.tolist())],
            "scores": batch.scores.clone(),
            "token_versions": None if batch.token_weight_versions is None else batch.token_weight_versions.clone(),
            "loss_mask": batch.response_mask.clone(),
        })  # fmt: skip

    @hookimpl
    def after_optimizer_step(self, step, model):
        self.weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                        for k, v in model.state_dict().items()}  # FSDP2 shards are DTensors: a collective


def recorded_runs(rank: int, world_size: int, init_file: str, model_dir: str, out_dir: str,
                  runs: list[tuple[str, list[str]]]) -> None:  # fmt: skip
    """Real runs one after the other at ``world_size`` (gloo; a world of one without a group of its own),
    each ``(name, overrides of tiny_config)`` with :class:`RunRecorder`'s plugins: every rank writes
    ``out_dir/<name>.rank<r>.pt`` with the batches it drew, the final weights and the metric rows."""
    import torch.distributed as dist

    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training

    torch.set_num_threads(1)
    if world_size > 1:
        os.environ["LOCAL_RANK"] = str(rank)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        for name, overrides in runs:
            pm = build_plugin_manager(autoload=False)
            recorder = RunRecorder()
            pm.register(recorder, name="recorder")
            run_dir = Path(out_dir) / name
            run_training(tiny_config(model_dir, run_dir, *overrides, pm=pm), pm)
            if world_size > 1:
                dist.barrier()  # rank 0 has written the metrics
            rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
            torch.save({"batches": recorder.batches, "weights": recorder.weights, "rows": rows},
                       Path(out_dir) / f"{name}.rank{rank}.pt")
        if world_size > 1:
            dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


class EvenChars:
    """A plugin with a dense test reward, ``even_chars`` (the share of a completion's characters with even code
    points): a group's advantages are rarely all zero, so every step has a gradient."""

    @hookimpl
    def register_reward_functions(self, register):
        register("even_chars", lambda completion, sample, cfg: sum(ord(c) % 2 == 0 for c in completion) / max(len(completion), 1))


class SavedActivations:
    """Activation memory: the bytes of the distinct storages autograd saves for backward inside the ``with``
    block, weights left out (leaf tensors that require a gradient, and views of them)::

        with SavedActivations() as saved:
            loss = model(x).sum()
        saved.bytes
    """

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if not (base.is_leaf and base.requires_grad):
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of a chi-square goodness-of-fit test of ``counts`` (draws per outcome) against ``probs``;
    outcomes expecting fewer than 5 draws are merged into one cell. Asserts that no outcome of
    probability 0 was drawn."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    assert counts[expected == 0].sum() == 0, "an outcome of probability 0 was drawn"
    small, big = (expected < 5) & (expected > 0), expected >= 5
    observed, wanted = counts[big], expected[big]
    if small.any():
        observed = torch.cat([observed, counts[small].sum()[None]])
        wanted = torch.cat([wanted, expected[small].sum()[None]])
    dof = len(observed) - 1
    if dof == 0:  # one possible outcome, and only it was drawn
        return 1.0
    chi2 = ((observed - wanted) ** 2 / wanted).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), chi2 / 2))


def per_micro_batch_mean_loss(logprobs, old_logprobs, advantages, response_mask, cfg):
    """A deliberately broken policy loss for tests of ``rlite audit``: PPO's unclipped surrogate divided by
    the *micro-batch's* token count inside the loss, so the objective depends on how the batch is split.
    (It lives here, not in a test file, so that spawned ranks can import it.)"""
    mask = response_mask.to(logprobs.dtype)
    per_token = -advantages.detach() * (logprobs - old_logprobs.detach()).exp() * mask
    return per_token / mask.sum().clamp(min=1), {}


class HostSyncRecorder:
    """Records every op inside the ``with`` block that makes the host wait for a GPU: reading a tensor's
    value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``.numpy()``), ops whose output size
    depends on values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ...), a tensor
    built from Python data (``torch.tensor([...])``: a copy to the device), and a blocking copy between
    host and device. On a CPU nothing waits, yet the same ops run: so the check can run there::

        with HostSyncRecorder() as syncs:
            loss = model(x).sum()
        assert syncs.found == []

    ``found``: ``(op, "file:line")`` of the nearest frame outside torch (the code that asked).
    ``allowed()``: a context in which ops are not recorded (the host-side preparation of a micro-batch).
    """

    VALUE_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "allclose",
                           "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_scatter", "bincount",
                           "histc"})
    TENSOR_METHODS = frozenset({"tolist", "numpy"})
    """Methods that read values without dispatching an op on a CPU tensor (``item()``, ``bool()`` and the like
    dispatch ``_local_scalar_dense``, recorded once there)."""

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self
        self.found: list[tuple[str, str]] = []
        self._paused = 0

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in recorder.TENSOR_METHODS:
                    recorder._record(name)
                return func(*args, **(kwargs or {}))

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func._overloadpacket.__name__
                if recorder._waits(name, args, kwargs):
                    recorder._record(name)
                return func(*args, **kwargs)

        self._modes = (Functions(), Dispatch())

    def _waits(self, name: str, args, kwargs) -> bool:
        if name in self.VALUE_OPS:
            return True
        if name == "lift_fresh":  # torch.tensor(python data); an empty one copies nothing
            return args[0].numel() > 0
        if name == "repeat_interleave":
            return kwargs.get("output_size") is None
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        positional_non_blocking = len(args) > 2 and bool(args[2]) if name == "copy_" else False
        if name in ("_to_copy", "copy_") and not (kwargs.get("non_blocking", False) or positional_non_blocking):
            source = args[1] if name == "copy_" else args[0]
            target = args[0].device if name == "copy_" else kwargs.get("device") or source.device
            return isinstance(source, torch.Tensor) and {source.device.type, torch.device(target).type} == {"cpu", "cuda"}
        return False

    def _record(self, name: str) -> None:
        if self._paused:
            return
        import traceback

        here = __file__
        frames = [f for f in traceback.extract_stack() if f.filename != here and f"{os.sep}torch{os.sep}" not in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self.found.append((name, where))

    def allowed(self):
        """A context in which nothing is recorded."""
        import contextlib

        @contextlib.contextmanager
        def pause():
            self._paused += 1
            try:
                yield
            finally:
                self._paused -= 1

        return pause()

    def __enter__(self) -> HostSyncRecorder:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


# -- damaged and tampered checkpoints (tests/faults, benchmarks/fault_campaign.py) ------------------

MALFORMED_TRAINER_STATES = ("view_out_of_bounds", "nested_200000_deep", "int_as_state")
"""Trainer states that unpickle with ``weights_only=True`` (nothing to refuse as code) but are no state rlite
wrote: a tensor view past the end of its storage, a list nested 200,000 levels deep in place of the sampler's
state, and an int as the whole state."""


class _ViewPastItsStorage:
    """Pickles as a 1,000,000-element view of a 4-byte storage (``torch._utils._rebuild_tensor_v2``, which a
    weights-only load admits)."""

    def __reduce__(self):
        import collections

        storage = torch.zeros(4, dtype=torch.uint8).untyped_storage()
        return torch._utils._rebuild_tensor_v2, (storage, 0, (10**6,), (1,), False, collections.OrderedDict())


def write_malformed_trainer_state(file: str | Path, kind: str) -> None:
    """Replace the trainer state ``file`` (a ``torch.save`` zip) by the ``kind`` of
    :data:`MALFORMED_TRAINER_STATES`, keeping everything else of it."""
    import zipfile

    file = Path(file)
    if kind == "int_as_state":
        torch.save(7, file)
        return
    state = torch.load(file, weights_only=False)  # the caller's own file
    if kind == "view_out_of_bounds":
        state["rng"]["torch"] = _ViewPastItsStorage()
        torch.save(state, file)
        return
    if kind != "nested_200000_deep":
        raise ValueError(f"kind: one of {', '.join(MALFORMED_TRAINER_STATES)}, got {kind!r}")
    placeholder = "rlite-nested-placeholder"
    state["sampler"] = placeholder
    torch.save(state, file)
    depth = 200_000
    # the placeholder's opcode (BINUNICODE: 'X', 4-byte length, text) becomes `depth` EMPTY_LISTs, each
    # appended into the one before: pickle's own writer would recurse that deep
    with zipfile.ZipFile(file) as archive:
        entries = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries:
            if name.endswith("/data.pkl"):
                at = data.index(placeholder.encode()) - 5
                data = data[:at] + b"]" * depth + b"a" * (depth - 1) + data[at + 5 + len(placeholder):]
            archive.writestr(name, data)


def rewrite_manifest(checkpoint: str | Path) -> None:
    """What whoever changes a checkpoint's files and then recomputes its manifest does: every file's checksum
    made to match its bytes as they now are, in the manifest's own scheme (``format`` 2: bound to the step and
    the name, :func:`rlite.run.checkpoint.manifest_digest`; without a format: the bytes alone)."""
    import hashlib

    checkpoint = Path(checkpoint)
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        prefix = f"rlite checkpoint step_{manifest['step']:08d}/{name}\n".encode() if manifest.get("format") == 2 else b""
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(prefix + data).hexdigest()}
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))
