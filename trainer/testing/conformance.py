"""The conformance kit: the invariants rlite's built-in plugins pass, runnable on any plugin.

A plugin author calls these from their own tests (``docs/plugins.md``, "Checking your plugin")::

    from rlite.testing.conformance import check_backend, check_engine, check_estimator, check_policy_loss

    check_backend("my_backend")        # a name registered through the rlite entry points, or
    check_engine(make_my_engine)       # the factory itself, as register() receives it

Each check builds what it needs here (a tiny random Qwen2 and its byte tokenizer, ~0.1M parameters;
nothing is downloaded), takes seconds on one CPU thread, and either returns a
:class:`ConformanceReport` listing the invariants that held with what was measured, or raises a
:class:`ConformanceError` (an ``AssertionError``) naming the invariant, the plugin and the numbers.

* :func:`check_backend` (a ``training_backend``): log-probs equal a plain transformers forward of the
  same weights (|diff| <= ``logprob_atol``); scoring the same weights twice, and the first training
  forward, are bitwise equal to pi_old (the first PPO ratio is exactly 1); a finite step changes the
  weights; a step with a non-finite loss (``skip=True``) and one with a non-finite gradient are
  skipped, counted in ``skipped_steps``, and leave weights and learning rate as they were;
  ``full_weights()`` gives the Hugging Face model's names and shapes, and before any step its values;
  ``checkpoint_state`` saved with ``torch.distributed.checkpoint`` and loaded into a fresh backend
  (with the LR scheduler's state) gives a bitwise equal next step.
* :func:`check_engine` (a ``rollout_engine``): ``update_weights`` drains the stream it is given (the
  SHA-256 of what it consumed equals that of what was sent) and sets ``weight_version``; ``generate``
  returns ``n`` completions per prompt grouped in order, obeys ``max_new_tokens`` and the stop tokens
  (a completion ends at its first stop token, with ``finish_reason`` saying which way it ended), and
  reports log-probs equal to a teacher-forced forward of the synced weights (|diff| <= ``logprob_atol``);
  after a second sync of different weights it samples with them, under the new version.
* :func:`check_estimator` (an ``advantage_estimator``) and :func:`check_policy_loss` (a ``policy_loss``):
  outputs of the documented shapes, finite and 0 outside the response mask, and equal (|diff| <= 1e-9)
  to the float64 reference the plugin registered with the implementation (``register(name, fn, cfg_cls,
  reference=fn64)``), on a batch with a singleton group, a constant group, an empty row, masked tokens
  inside responses, per-token rewards, critic values and log-ratios of +-30. ``rlite audit`` runs the
  same comparison (:func:`estimator_reference_error`, :func:`loss_reference_error`).

The checks run on CPU in float32 (the backend's and engine's own defaults otherwise).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlite.metrics import drained, reported_values

LOGPROB_ATOL = 1e-4
"""Default tolerance of log-probs against a plain float32 transformers forward (reordered float32 sums of
a tiny model stay below 1e-5; a bf16 or fused-kernel plugin may pass its own)."""
FORMULA_ATOL = 1e-9
"""Tolerance of an estimator or loss against its float64 reference."""


class ConformanceError(AssertionError):
    """An invariant that a plugin does not hold: ``invariant``, ``plugin`` and the ``measured`` numbers."""

    def __init__(self, invariant: str, plugin: str, measured: str) -> None:
        self.invariant, self.plugin, self.measured = invariant, plugin, measured
        super().__init__(f"{plugin}: {invariant}: {measured}")


@dataclass
class ConformanceReport:
    """What held: ``passed`` is a list of ``(invariant, measured)``."""

    plugin: str
    kind: str
    passed: list[tuple[str, str]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """What the plugin reported through its :class:`~rlite.metrics.MetricsSink` during the check (an engine's
    ``EngineContext.metrics``, a backend's ``metrics``), reduced as a step's row would show it."""

    def invariants(self) -> list[str]:
        return [name for name, _ in self.passed]

    def __str__(self) -> str:
        lines = [f"{self.kind} {self.plugin}: {len(self.passed)} invariants hold"]
        lines += [f"  {name}: {measured}" for name, measured in self.passed]
        return "\n".join(lines)


class _Checker:
    def __init__(self, plugin: str, kind: str) -> None:
        self.report = ConformanceReport(plugin, kind)

    @contextlib.contextmanager
    def raising(self, invariant: str) -> Iterator[None]:
        """An exception from the plugin inside this block fails ``invariant``, with the exception as measured."""
        try:
            yield
        except ConformanceError:
            raise
        except Exception as exc:
            text = str(exc).splitlines()[0] if str(exc) else ""
            raise ConformanceError(invariant, self.report.plugin, f"raised {type(exc).__name__}: {text}") from exc

    def require(self, ok: bool, invariant: str, measured: str) -> None:
        if not ok:
            raise ConformanceError(invariant, self.report.plugin, measured)
        self.report.passed.append((invariant, measured))


@dataclass
class _Plugin:
    name: str
    implementation: Any
    config_cls: type | None
    metadata: dict[str, Any]


def _resolve(kind: str, plugin: Any) -> _Plugin:
    """A name (through :func:`rlite.api.registered`: the running rlite's plugins, ``plugins.enable``
    respected), a registry entry, or the implementation itself."""
    from rlite.plugin_manager import Registered, registered

    if isinstance(plugin, str):
        plugin = registered(kind, plugin)
    if isinstance(plugin, Registered):
        return _Plugin(f"{plugin.name!r} (plugin {plugin.plugin})", plugin.implementation, plugin.config_cls,
                       plugin.metadata)
    name = getattr(plugin, "__qualname__", None) or type(plugin).__name__
    return _Plugin(f"{name!r} (unregistered)", plugin, None, {})


def _options(found: _Plugin, options: Any, kind: str) -> Any:
    """``options``, or the plugin's defaults built as a run builds them (nested choices' options included)."""
    if options is not None or found.config_cls is None:
        return options
    from rlite.config.options import build_options
    from rlite.plugin_manager import get_plugin_manager

    return build_options(found, {}, kind=kind, key=f"{found.name} options", registries=get_plugin_manager().registries)


# --------------------------------------------------------------------------------------------------
# estimators and losses against their registered float64 references
# --------------------------------------------------------------------------------------------------


def edge_case_batch(seed: int = 0):
    """12 responses of up to 6 tokens, float64: groups of 4, 3, a constant group of 3, a singleton and
    another singleton; one fully masked row, two rows with a masked token inside the response (a tool span);
    log-ratios up to +-30. Returns ``(group_ids, scores, mask, old_logprobs, log_ratio, baseline_scores)``."""
    g = torch.Generator().manual_seed(seed)
    groups = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4]
    scores = torch.randint(0, 3, (12,), generator=g).double() / 2
    scores[7:10] = 0.5  # constant group
    lengths = torch.randint(1, 7, (12,), generator=g)
    lengths[5] = 0  # fully masked row
    lengths[0], lengths[3] = 6, 5
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    mask[0, 2] = mask[3, 1] = 0.0  # interior masked tokens: transparent to returns and values
    old = -torch.rand(12, 6, generator=g, dtype=torch.float64) * 4
    log_ratio = torch.randn(12, 6, generator=g, dtype=torch.float64) * 0.3
    log_ratio[0, 0], log_ratio[1, 1] = 30.0, -30.0  # extreme ratios
    log_ratio[0, 1] = -29.5  # with the 30 before it, a sequence sum only a per-token +-20 clamp gets right (vespo)
    return torch.tensor(groups), scores, mask, old, log_ratio, torch.rand(12, generator=g, dtype=torch.float64)


def edge_case_advantage_input():
    """The :func:`edge_case_batch` as an estimator's ``AdvantageInput``, with every optional field filled
    (per-token rewards, critic values, greedy baselines, one reward component)."""
    from rlite.algorithms import AdvantageInput

    groups, scores, mask, _, _, baseline = edge_case_batch()
    g = torch.Generator().manual_seed(5)
    token_rewards = torch.randn(12, 6, generator=g, dtype=torch.float64) * 0.1
    values = torch.randn(12, 6, generator=g, dtype=torch.float64)
    return AdvantageInput(scores, groups, mask, token_rewards=token_rewards, values=values, baseline_scores=baseline,
                          reward_components=scores[:, None], reward_weights=torch.ones(1, dtype=torch.float64))


def edge_case_loss_inputs():
    """``(logprobs, old_logprobs, advantages, response_mask)`` of the :func:`edge_case_batch`, float64."""
    _, _, mask, old, log_ratio, _ = edge_case_batch()
    advantages = torch.randn(12, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * mask
    return old + log_ratio, old, advantages, mask


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.detach().double() - want.double()).abs()
    return math.inf if diff.isnan().any() else float(diff.max())


def estimator_reference_error(implementation: Callable, reference: Callable, cfg: Any) -> float:
    """max |implementation - reference| over the advantages and returns of :func:`edge_case_advantage_input`."""
    batch = edge_case_advantage_input()
    advantages, returns = implementation(batch, cfg)
    want_advantages, want_returns = reference(batch, cfg)
    return max(_max_error(advantages, want_advantages), _max_error(returns, want_returns))


def loss_reference_error(implementation: Callable, reference: Callable, cfg: Any) -> float:
    """max |implementation - reference| of the per-token loss on :func:`edge_case_loss_inputs`."""
    logprobs, old, advantages, mask = edge_case_loss_inputs()
    loss, _ = implementation(logprobs.clone().requires_grad_(True), old, advantages, mask, cfg)
    return _max_error(loss, reference(logprobs, old, advantages, mask, cfg))


def _reference_of(found: _Plugin, reference: Callable | None, check: _Checker) -> Callable:
    reference = reference or found.metadata.get("reference")
    check.require(reference is not None, "a float64 reference is registered",
                  "registered" if reference is not None else "no reference registered: register(name, fn, "
                  "config_cls, reference=fn64), fn64 taking the same arguments and computing in float64")
    return reference


def check_estimator(estimator: Any, options: Any = None, *, reference: Callable | None = None,
                    atol: float = FORMULA_ATOL) -> ConformanceReport:
    """Check an advantage estimator (a name, a registry entry, or ``fn(batch, cfg)``) with ``options`` (its
    config instance; default: its config class's defaults) against its registered float64 ``reference``
    (or the one given), within ``atol`` (an estimator that computes in float32 on float64 input needs ~1e-6)."""
    found = _resolve("advantage_estimator", estimator)
    cfg = _options(found, options, "advantage_estimator")
    check = _Checker(found.name, "advantage_estimator")
    reference = _reference_of(found, reference, check)
    batch = edge_case_advantage_input()
    advantages, returns = found.implementation(batch, cfg)
    shape = tuple(batch.response_mask.shape)
    check.require(tuple(advantages.shape) == shape and tuple(returns.shape) == shape, "advantages and returns are [B, T]",
                  f"shapes {tuple(advantages.shape)}, {tuple(returns.shape)} for a mask of {shape}")
    finite = bool(torch.isfinite(advantages).all() and torch.isfinite(returns).all())
    outside = float((advantages.double().abs() * (1 - batch.response_mask)).max())
    check.require(finite and outside == 0.0, "finite, and 0 outside the response mask",
                  f"finite {finite}; max |advantage| outside the mask {outside:.3g}")
    error = estimator_reference_error(found.implementation, reference, cfg)
    check.require(error <= atol, "equals its float64 reference",
                  f"max |plugin - reference| = {error:.2e} (tolerance {atol:.0e}) over advantages and returns "
                  "of 12 responses (singleton groups, a constant group, an empty row, masked tokens inside responses, "
                  "per-token rewards, critic values)")
    return check.report


def check_policy_loss(loss: Any, options: Any = None, *, reference: Callable | None = None,
                      atol: float = FORMULA_ATOL) -> ConformanceReport:
    """Check a policy loss (a name, a registry entry, or ``fn(logprobs, old_logprobs, advantages,
    response_mask, cfg)``) with ``options`` against its registered float64 ``reference`` (or the one given),
    within ``atol``."""
    found = _resolve("policy_loss", loss)
    cfg = _options(found, options, "policy_loss")
    check = _Checker(found.name, "policy_loss")
    reference = _reference_of(found, reference, check)
    logprobs, old, advantages, mask = edge_case_loss_inputs()
    trainable = logprobs.clone().requires_grad_(True)
    per_token, metrics = found.implementation(trainable, old, advantages, mask, cfg)
    bad_metrics = [k for k, v in metrics.items() if tuple(torch.as_tensor(v).shape) != tuple(mask.shape)]
    check.require(tuple(per_token.shape) == tuple(mask.shape) and not bad_metrics,
                  "per-token loss and metrics are [B, T]",
                  f"loss {tuple(per_token.shape)}, metrics not [B, T]: {bad_metrics} (mask {tuple(mask.shape)})")
    (per_token * mask).sum().backward()
    finite = bool(torch.isfinite(per_token).all()) and bool(torch.isfinite(trainable.grad).all())
    outside = float((per_token.detach().double().abs() * (1 - mask)).max())
    check.require(finite and outside == 0.0, "finite loss and gradient at log-ratios of +-30, 0 outside the mask",
                  f"finite {finite}; max |loss| outside the mask {outside:.3g}")
    error = loss_reference_error(found.implementation, reference, cfg)
    check.require(error <= atol, "equals its float64 reference",
                  f"max |plugin - reference| = {error:.2e} (tolerance {atol:.0e}) on 72 tokens "
                  "(log-ratios up to +-30, an empty row, masked tokens inside responses)")
    return check.report


# --------------------------------------------------------------------------------------------------
# tiny models, built here
# --------------------------------------------------------------------------------------------------


def tiny_model_dir(out: str | Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen2 (hidden 32, 2 layers) with rlite's byte tokenizer, saved in ``out``."""
    from rlite.tokenizer import build_tiny_model_dir

    return build_tiny_model_dir(out, hidden=32, layers=2, seed=seed)


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


@torch.no_grad()
def _teacher_forced(model, sequences: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> list[torch.Tensor]:
    """Per sequence ``(prompt, response)``: log-probs of the response tokens, one unpadded forward each."""
    out = []
    for prompt, response in sequences:
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        out.append(logp.gather(-1, torch.tensor(response)[:, None])[:, 0])
    return out


def _digest(named: list[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in named:
        data = tensor.detach().contiguous().cpu()
        digest.update(name.encode())
        digest.update(str(data.dtype).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """A world of one (gloo) for backends that need a process group (FSDP2's mesh), unless one exists."""
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _workdir(workdir: str | Path | None) -> Iterator[Path]:
    """The check's folder (``workdir``, else a temporary one); transformers draws no load/save bars in it
    (they would come between the lines of the author's test output)."""
    from rlite.hf_models import quiet_transformers_progress

    with quiet_transformers_progress():
        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
            yield Path(workdir)
            return
        with tempfile.TemporaryDirectory(prefix="rlite-conformance-") as tmp:
            yield Path(tmp)


def _run_config(model_dir: Path, run_dir: Path, overrides: list[str]):
    from rlite.plugin_manager import get_plugin_manager
    from rlite.testing import tiny_config

    return tiny_config(model_dir, run_dir, "training.lr=1e-2", "training.grad_clip=1.0", *overrides,
                       pm=get_plugin_manager())


@dataclass
class _Bench:
    """What a backend or engine check runs on: its folder, a tiny model (on disk and loaded) and a run config."""

    root: Path
    model_dir: Path
    config: Any
    hf: Any


@contextlib.contextmanager
def _setting_up(kind: str, plugin: Any, options: Any, overrides: tuple[str, ...],
                workdir: str | Path | None) -> Iterator[tuple[_Plugin, Any, _Checker, _Bench]]:
    """The plugin resolved, its options, a checker, and the bench, inside the check's folder and a process group."""
    found = _resolve(kind, plugin)
    cfg = _options(found, options, kind)
    check = _Checker(found.name, kind)
    torch.manual_seed(0)
    with _workdir(workdir) as root, _process_group():
        model_dir = tiny_model_dir(root / "model")
        config = _run_config(model_dir, root / "run", list(overrides))
        yield found, cfg, check, _Bench(root, model_dir, config, _hf_model(model_dir))


# --------------------------------------------------------------------------------------------------
# training backends
# --------------------------------------------------------------------------------------------------


def _backend_weights(backend) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in backend.full_weights()}


def _objective(batch, logprobs: torch.Tensor, kind: str = "finite") -> torch.Tensor:
    """A simple objective: the mean response log-prob weighted by the batch's centred scores. ``nan_loss``
    makes it NaN; ``nan_gradient`` keeps the loss finite (0) with a NaN gradient (d sqrt(0 x) / dx)."""
    mask = batch.response_mask.to(logprobs.dtype)
    weight = (batch.scores - batch.scores.mean()).to(logprobs.dtype)[:, None] + 0.5
    loss = -(logprobs * weight * mask).sum() / mask.sum()
    if kind == "nan_loss":
        return loss * float("nan")
    if kind == "nan_gradient":
        return torch.sqrt(loss * 0.0)
    return loss


def _train_step(backend, batch, spec, before_step: Callable[[], None] | None = None, kind: str = "finite",
                logprobs: torch.Tensor | None = None) -> float:
    """One optimizer step as the loop runs it: ``skip=True`` when the loss is not finite."""
    if logprobs is None:
        backend.train_mode()
        logprobs, _ = backend.logprobs(batch, spec, with_entropy=True)
    loss = _objective(batch, logprobs, kind)
    backend.backward(loss)
    return backend.step(before_step, skip=not math.isfinite(float(loss.detach())))


def check_backend(backend: Any, options: Any = None, *, overrides: tuple[str, ...] = (),
                  logprob_atol: float = LOGPROB_ATOL, workdir: str | Path | None = None) -> ConformanceReport:
    """Check a training backend: a name registered as a ``training_backend``, its registry entry, or its
    factory ``factory(config, cfg, device, total_optimizer_steps)``; ``options`` is its config instance
    (default: the config class's defaults), ``overrides`` extra ``key=value`` of the tiny run config the
    factory receives. Invariants: the module docstring."""
    from rlite.testing import fixed_batch
    from rlite.training.backend import ForwardSpec

    with _setting_up("training_backend", backend, options, overrides, workdir) as (found, cfg, check, bench):
        root, config, hf = bench.root, bench.config, bench.hf

        def build():
            return found.implementation(config, cfg, torch.device("cpu"), 4)

        batch = fixed_batch(num_prompts=2, samples=3, prompt_len=6, max_len=7, vocab=hf.config.vocab_size)
        spec = ForwardSpec(micro_batch_size=len(batch), temperature=1.0, chunk_size=16, exact_layout=False)
        first = build()
        try:
            _check_backend_weights(check, first, hf)
            trained = _check_backend_logprobs(check, first, hf, batch, spec, logprob_atol)
            _check_backend_steps(check, first, batch, spec, trained)
            next_batch = fixed_batch(num_prompts=2, samples=3, prompt_len=6, max_len=7, vocab=hf.config.vocab_size, seed=1)
            _check_backend_resume(check, first, build, next_batch, spec, root / "checkpoint")
        finally:
            check.report.metrics = reported_values(drained(first))
            first.close()
    return check.report


def _check_backend_weights(check: _Checker, backend, hf) -> None:
    sent = _backend_weights(backend)
    want = dict(hf.named_parameters())
    names_ok = sorted(sent) == sorted(want)
    shapes = [n for n in want if n in sent and tuple(sent[n].shape) != tuple(want[n].shape)]
    check.require(names_ok and not shapes, "full_weights(): the Hugging Face model's names and shapes",
                  f"missing {sorted(set(want) - set(sent))[:4]}, unexpected {sorted(set(sent) - set(want))[:4]}, "
                  f"shapes differ for {shapes[:4]}")
    worst = max(float((sent[n].float() - want[n].detach().float()).abs().max()) for n in want)
    check.require(worst == 0.0, "full_weights() before any step: the checkpoint's values",
                  f"max |streamed - checkpoint| = {worst:.3g} over {len(want)} tensors")


def _check_backend_logprobs(check: _Checker, backend, hf, batch, spec, atol: float) -> torch.Tensor:
    """The log-prob invariants; returns the first training forward (its graph is the next step's)."""
    with torch.no_grad():
        old, _ = backend.logprobs(batch, spec)
        again, _ = backend.logprobs(batch, spec)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(batch.prompt_ids, batch.prompt_mask)]
    responses = [row[: int(n)].tolist() for row, n in zip(batch.response_ids, batch.response_lengths.tolist())]
    plain = _teacher_forced(hf, list(zip(prompts, responses)))
    worst = max(float((old[i, : len(r)].double() - lp.double()).abs().max()) for i, (r, lp) in enumerate(zip(responses, plain)))
    outside = float((old * (1 - batch.response_mask)).abs().max())
    check.require(worst <= atol and outside == 0.0, "log-probs equal a plain transformers forward",
                  f"max |backend - transformers| = {worst:.2e} (tolerance {atol:.0e}) over {int(batch.response_mask.sum())} "
                  f"response tokens of {len(batch)} ragged sequences; max |log-prob| past the responses {outside:.3g}")
    check.require(torch.equal(old, again), "scoring the same weights twice is bitwise equal",
                  f"max |first - second| = {float((old - again).abs().max()):.3g}")
    backend.train_mode()
    trained, _ = backend.logprobs(batch, spec, with_entropy=True)
    gap = float((trained.detach() - old).abs().max())
    check.require(gap == 0.0, "first PPO ratio exactly 1 (training forward == pi_old)",
                  f"max |lp - old| = {gap:.3g} between the no-grad scoring and the training forward")
    return trained


def _check_backend_steps(check: _Checker, backend, batch, spec, trained: torch.Tensor) -> None:
    before, lr = _backend_weights(backend), backend.current_lr()
    skipped = getattr(backend, "skipped_steps", None)
    check.require(skipped is not None, "counts skipped steps (skipped_steps)",
                  f"skipped_steps = {skipped}" if skipped is not None
                  else "the backend has no skipped_steps attribute (BackendBase provides it)")
    calls: list[str] = []
    norms = [_train_step(backend, batch, spec, lambda: calls.append("nan_loss"), "nan_loss", logprobs=trained),
             _train_step(backend, batch, spec, lambda: calls.append("nan_gradient"), "nan_gradient")]
    after = _backend_weights(backend)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    counted = backend.skipped_steps - skipped
    check.require(not changed and counted == 2 and not calls and backend.current_lr() == lr,
                  "a non-finite loss or gradient skips the step, counted, weights and LR unchanged",
                  f"grad norms {norms}; skipped_steps +{counted} (want +2); before_step called {calls}; "
                  f"changed weights {changed[:4]}; lr {lr} -> {backend.current_lr()}")
    norm = _train_step(backend, batch, spec)
    moved = _backend_weights(backend)
    changed = [n for n in before if not torch.equal(before[n], moved[n])]
    check.require(math.isfinite(norm) and norm > 0 and changed, "a finite step changes the weights",
                  f"grad norm {norm:.3g}; {len(changed)} of {len(before)} tensors changed")


def _check_backend_resume(check: _Checker, backend, build: Callable, next_batch, spec, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = backend.checkpoint_state()
    dcp.save(state, checkpoint_id=str(path))
    scheduler = copy.deepcopy(backend.lr_scheduler_state())
    backend.after_checkpoint()
    _train_step(backend, next_batch, spec)
    straight = _backend_weights(backend)
    resumed = build()
    try:
        with check.raising("resume: the step after a checkpoint load is bitwise equal"):
            fresh = resumed.checkpoint_state()
            dcp.load(fresh, checkpoint_id=str(path))
            resumed.load_checkpoint_state(fresh)
            resumed.load_lr_scheduler_state(scheduler)
            _train_step(resumed, next_batch, spec)
            after = _backend_weights(resumed)
    finally:
        resumed.close()
    differ = [n for n in straight if not torch.equal(straight[n], after[n])]
    worst = max((float((straight[n] - after[n]).abs().max()) for n in differ), default=0.0)
    check.require(not differ, "resume: the step after a checkpoint load is bitwise equal",
                  f"{len(differ)} of {len(straight)} tensors differ after the next step (max {worst:.3g})")


# --------------------------------------------------------------------------------------------------
# rollout engines
# --------------------------------------------------------------------------------------------------


class _RecordedStream:
    """The tensors of a sync, hashing what the engine consumes as it consumes it."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.named, self.consumed = named, []

    def __iter__(self):
        for name, tensor in self.named:
            self.consumed.append((name, tensor.detach().clone()))
            yield name, tensor


def _sync(engine, named: list[tuple[str, torch.Tensor]], version: int) -> tuple[str, str]:
    """A weight sync as the loop runs it; the digests of what was sent and of what the engine consumed."""
    dtype = engine.capabilities.weight_dtype
    named = [(n, t.to(dtype) if dtype is not None and t.is_floating_point() else t) for n, t in named]
    stream = _RecordedStream(named)
    engine.release_memory()
    engine.update_weights(iter(stream), version)
    engine.resume_memory()
    return _digest(named), _digest(stream.consumed)


def _served(hf) -> list[tuple[str, torch.Tensor]]:
    """The weights as a backend streams them: Hugging Face names, tied weights once, fresh tensors."""
    return [(name, param.detach().clone()) for name, param in hf.named_parameters()]


def check_engine(engine: Any, options: Any = None, *, overrides: tuple[str, ...] = (),
                 logprob_atol: float = LOGPROB_ATOL, workdir: str | Path | None = None) -> ConformanceReport:
    """Check a rollout engine: a name registered as a ``rollout_engine``, its registry entry, or its factory
    ``factory(model_config, tokenizer, rollout_config, cfg, context)``; ``options`` is its config instance
    (default: the config class's defaults), ``overrides`` extra ``key=value`` of the tiny run config whose
    ``model`` and ``rollout`` sections the factory receives. Invariants: the module docstring."""
    from transformers import AutoTokenizer

    from rlite.engines.base import SamplingParams
    from rlite.engines.placement import EngineContext

    with _setting_up("rollout_engine", engine, options, overrides, workdir) as (found, cfg, check, bench):
        config, hf = bench.config, bench.hf
        tokenizer = AutoTokenizer.from_pretrained(bench.model_dir)
        context = EngineContext.single_process()
        built = found.implementation(config.model, tokenizer, config.rollout, cfg, context)
        try:
            with check.raising("update_weights drains the stream and sets weight_version"):
                sent, consumed = _sync(built, _served(hf), 1)
            check.require(sent == consumed and built.weight_version == 1,
                          "update_weights drains the stream and sets weight_version",
                          f"sha256 of consumed == sent: {sent == consumed}; weight_version {built.weight_version} (want 1)")
            prompts = [[5, 17, 42, 9], [100, 3, 7]]
            eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
            params = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=0)
            with check.raising("generate: n completions per prompt, grouped in order"):
                completions = built.generate(prompts, params)
            _check_layout(check, completions, prompts, params, eos, version=1)
            _check_logprobs(check, completions, hf, prompts, params, logprob_atol, "")
            stop = list(range(0, hf.config.vocab_size, 2))  # half the vocabulary: completions stop early
            stopping = SamplingParams(n=3, max_new_tokens=6, temperature=0.7, seed=1, stop_token_ids=stop)
            with check.raising("generate obeys stop tokens (half the vocabulary)"):
                completions = built.generate(prompts, stopping)
            _check_layout(check, completions, prompts, stopping, eos | set(stop), version=1, want_stop=True)
            _check_logprobs(check, completions, hf, prompts, stopping, logprob_atol, " (temperature 0.7)")
            old = copy.deepcopy(hf)
            with torch.no_grad():
                for param in hf.parameters():
                    param.add_(torch.randn_like(param) * 0.3)
            with check.raising("a second sync: drained, weight_version set"):
                sent, consumed = _sync(built, _served(hf), 2)
            check.require(sent == consumed and built.weight_version == 2, "a second sync: drained, weight_version set",
                          f"sha256 of consumed == sent: {sent == consumed}; weight_version {built.weight_version} (want 2)")
            with check.raising("completions after the second sync carry its version"):
                completions = built.generate(prompts, params)
            versions = sorted({c.weight_version for c in completions})
            check.require(versions == [2], "completions after the second sync carry its version", f"versions {versions}")
            _check_logprobs(check, completions, hf, prompts, params, logprob_atol, " after a sync of new weights")
            stale = _logprob_error(completions, old, prompts, params)
            check.require(stale > 100 * logprob_atol, "samples with the new weights, not the old",
                          f"max |engine - forward of the previous weights| = {stale:.2e} (must exceed {100 * logprob_atol:.0e})")
        finally:
            built.shutdown()
            check.report.metrics = reported_values(context.metrics.drain())
    return check.report


def _check_layout(check: _Checker, completions, prompts, params, stops: set[int], *, version: int,
                  want_stop: bool = False) -> None:
    order = [c.prompt_index for c in completions]
    check.require(order == [p for p in range(len(prompts)) for _ in range(params.n)],
                  "generate: n completions per prompt, grouped in order", f"prompt indices {order}")
    problems = []
    for c in completions:
        ids = list(c.token_ids)
        early = [t for t in ids[:-1] if t in stops]
        ended = bool(ids) and ids[-1] in stops
        if len(ids) > params.max_new_tokens or not ids or early or len(c.logprobs) != len(ids):
            problems.append(f"{len(ids)} tokens, stop tokens before the end {early}, {len(c.logprobs)} log-probs")
        elif c.finish_reason != ("stop" if ended else "length") or (not ended and len(ids) != params.max_new_tokens):
            problems.append(f"{len(ids)} tokens ending in {ids[-1]} reported {c.finish_reason!r}")
    stopped = sum(c.finish_reason == "stop" for c in completions)
    what = "stop tokens (half the vocabulary)" if want_stop else "max_new_tokens"
    check.require(not problems and (stopped > 0 or not want_stop), f"generate obeys {what}",
                  f"{len(completions)} completions of at most {params.max_new_tokens} tokens, {stopped} ended by a "
                  f"stop token; problems: {problems[:3]}")
    versions = sorted({c.weight_version for c in completions})
    if not want_stop:
        check.require(versions == [version], "completions carry the synced weight version",
                      f"versions {versions} (want {version})")


def _logprob_error(completions, hf, prompts, params) -> float:
    plain = _teacher_forced(hf, [(prompts[c.prompt_index], list(c.token_ids)) for c in completions], params.temperature)
    return max(float((torch.tensor(c.logprobs, dtype=torch.float64) - lp.double()).abs().max())
               for c, lp in zip(completions, plain))


def _check_logprobs(check: _Checker, completions, hf, prompts, params, atol: float, what: str) -> None:
    worst = _logprob_error(completions, hf, prompts, params)
    check.require(worst <= atol, f"log-probs equal a teacher-forced forward of the synced weights{what}",
                  f"max |engine - transformers| = {worst:.2e} (tolerance {atol:.0e}) over "
                  f"{sum(len(c.token_ids) for c in completions)} sampled tokens")
