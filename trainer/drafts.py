"""Speculative-decoding drafts on the trainer's side: the contract a draft plugin implements
(:class:`SpeculativeDraft`), and the online training of a small causal-LM draft (:class:`ModelDraft`).

A draft plugin's factory (``register_speculative_drafts``) gets a :class:`DraftContext` and returns a
:class:`SpeculativeDraft`: what the engine runs (its :class:`~rlite.engines.base.DraftSpec`), and, for
a draft that learns during the run, one update per step from that step's rollouts and its weights for
the weight sync. The loop calls, every step::

    metrics = draft.update(batch)       # after the policy's update, from the step's rollouts
    sync: policy weights, then draft.named_weights() under "draft." names   # one version, one checksum

The draft's loss never reaches the policy: the draft is a model of its own, trained from the
rollout's tokens (and, for distillation, the policy's top log-probs the engine reported while
sampling them), which carry no gradient. Exact speculative sampling keeps the rollouts' distribution
the policy's whatever the draft is, so a stale draft costs speed, never correctness
(``docs/speculative.md``).

:class:`ModelDraft` trains by one of two losses, per response token ``t`` of the batch, with the
draft's temperature-scaled distribution ``q_t = softmax(draft_logits_t / T)`` (what it proposes from):

* ``tokens``: ``-log q_t(x_t)`` of the sampled token ``x_t``: cross-entropy on the policy's samples,
  a one-sample estimate of the forward KL from the policy to the draft (up to a constant);
* ``distill``: ``-sum_j p_j log q_t(j)`` over the policy's ``k`` most likely tokens at ``t``, with
  ``p`` their probabilities renormalised over the ``k`` (``SamplingParams.top_logprobs``).

Both are averaged over every response token of the global batch (all data-parallel ranks; the
draft's gradients are summed over ranks, so every rank keeps the same draft).

A draft worth running is made before the run (``examples/drafts/make_draft.py``): :func:`shallow_copy`
cuts the policy to its first layers and :func:`fit_on_completions` fits that to the policy's own samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from rlite.config import ConfigError, ModelConfig, RolloutConfig
from rlite.distributed import DataLayout, all_reduce_sum
from rlite.engines.base import DraftSpec
from rlite.rollout import RolloutBatch, model_inputs

DRAFT_LOSSES = ("tokens", "distill")


@dataclass
class DraftContext:
    """What a draft factory receives."""

    model: ModelConfig
    """The policy's ``model`` section (its path, for comparing vocabularies)."""
    tokenizer: Any
    """The policy's tokenizer: a draft must map text to the same ids."""
    rollout: RolloutConfig
    """The ``rollout`` section (temperature, max_new_tokens, the engine)."""
    device: torch.device
    """Where this rank trains."""
    layout: DataLayout
    """This rank's data-parallel shard: a trained draft sums its gradients over ``layout.group``."""
    key: str = "rollout.draft"
    """The config key of the draft, for error messages."""


@runtime_checkable
class SpeculativeDraft(Protocol):
    """What the trainer needs from a draft plugin."""

    spec: DraftSpec
    """What the engine runs; ``spec.trained`` drafts also send :meth:`named_weights` with every sync."""
    rollout_top_logprobs: int
    """How many of the policy's top log-probs per generated token the draft's update needs from the
    engine (``RolloutBatch.policy_top_logprobs``); 0 for none."""

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Learn from this step's rollouts (called every step on every rank, after the policy's update,
        before the weight sync); returns metrics (``draft/...``), ``{}`` for a draft that does not learn.
        Must not touch the policy."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The draft's weights by (Hugging Face) name, sent after the policy's under ``draft.`` names;
        only called when ``spec.trained``. Detached views are fine: the sync copies or binds them."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the draft (weights, optimizer); ``{}`` for none. Tensors and plain Python
        values only: a checkpoint is read back with ``torch.load(weights_only=True)`` (:mod:`rlite.run.safe_pickle`),
        and a save whose state holds anything else fails, naming it."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` when a run resumes."""

    def export(self, out_dir: Path) -> Path | None:
        """Save the trained draft as a Hugging Face folder (an SGLang ``speculative_draft_model_path``);
        ``None`` when there is nothing to save."""


class FixedDraft:
    """A draft that does not learn (prompt lookup, or a model kept as it was loaded): only a spec."""

    rollout_top_logprobs = 0

    def __init__(self, spec: DraftSpec) -> None:
        if spec.trained:
            raise ValueError("a FixedDraft does not train; make spec.trained False")
        self.spec = spec

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        return {}

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def export(self, out_dir: Path) -> Path | None:
        return None


def check_draft_vocabulary(draft_path: str, context: DraftContext) -> None:
    """A draft must use the policy's tokenizer: the same number of token ids (the draft's output
    layer and the policy's compare position by position) and, where the draft's folder has a
    tokenizer, the same token -> id map. Raises :class:`ConfigError` naming ``<key>.args.path``."""
    from transformers import AutoConfig

    key = f"{context.key}.args.path"
    folder = Path(draft_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key}: {draft_path!r} is not a Hugging Face model folder (no config.json)")
    draft_vocab = AutoConfig.from_pretrained(draft_path).get_text_config().vocab_size
    policy_vocab = AutoConfig.from_pretrained(context.model.path).get_text_config().vocab_size
    if draft_vocab != policy_vocab:
        raise ConfigError(
            f"{key}: the draft's vocabulary has {draft_vocab} tokens, the policy's {policy_vocab}; a draft must "
            "use the policy's tokenizer and vocabulary size (make the draft with it, e.g. a smaller model of the "
            "same family)"
        )
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        from transformers import AutoTokenizer

        draft_ids = AutoTokenizer.from_pretrained(draft_path).get_vocab()
        policy_ids = context.tokenizer.get_vocab()
        differ = sorted(t for t in set(draft_ids) | set(policy_ids) if draft_ids.get(t) != policy_ids.get(t))
        if differ:
            raise ConfigError(
                f"{key}: the draft's tokenizer differs from the policy's in {len(differ)} tokens (e.g. "
                f"{differ[:3]}); a draft must map text to the policy's token ids: make it with the policy's tokenizer"
            )


class ModelDraft:
    """A small causal LM as the draft (``DraftSpec.method = "model"``), optionally trained online from
    every step's rollouts (see the module docstring for the losses)."""

    def __init__(
        self,
        path: str,
        context: DraftContext,
        *,
        num_speculative_tokens: int = 4,
        train: bool = True,
        loss: str = "tokens",
        distill_top_k: int = 16,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        micro_batch_size: int = 32,
        updates_per_step: int = 1,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if loss not in DRAFT_LOSSES:
            raise ConfigError(f"{context.key}.args.loss: {loss!r}; valid: {', '.join(DRAFT_LOSSES)}")
        check_draft_vocabulary(path, context)
        self.context = context
        self.temperature = float(context.rollout.temperature)
        self.spec = DraftSpec("model", num_speculative_tokens, model_path=str(path), trained=train)
        self.loss, self.top_k = loss, distill_top_k
        self.rollout_top_logprobs = distill_top_k if (train and loss == "distill") else 0
        self.grad_clip, self.micro_batch_size, self.updates_per_step = grad_clip, micro_batch_size, updates_per_step
        self.model, self.optimizer = None, None  # a frozen draft lives in the engine only
        if train:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(context.device).eval()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)

    # -- learning ---------------------------------------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        if self.optimizer is None:
            return {}
        if self.loss == "distill" and batch.policy_top_logprobs is None:
            raise RuntimeError(
                f"{self.context.key}: loss=distill needs the policy's top log-probs with every rollout token, "
                "which this engine did not report (SamplingParams.top_logprobs)"
            )
        self.model.train()
        group = self.context.layout.group
        rows = len(batch)
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, argmax agreements, tokens
        norms = []
        splits = [list(range(rows))[i :: self.updates_per_step] for i in range(self.updates_per_step)]
        for part in splits:
            if not part:
                continue
            # the global number of response tokens normalises every rank's sum: the mean over the global batch
            tokens = all_reduce_sum(torch.tensor([float(batch.response_mask[part].sum())]), group)[0].clamp(min=1)
            for start in range(0, len(part), self.micro_batch_size):
                micro = batch.select(part[start : start + self.micro_batch_size])
                loss_sum, agree, count = self._loss_sum(micro)
                (loss_sum / tokens).backward()
                totals += torch.tensor([float(loss_sum.detach()), float(agree), float(count)], dtype=torch.float64)
            norms.append(self._step(group))
        self.model.eval()
        totals = all_reduce_sum(totals, group)
        count = max(float(totals[2]), 1.0)
        return {
            "draft/loss": float(totals[0]) / count,
            "draft/top1_agreement": float(totals[1]) / count,
            "draft/grad_norm": sum(norms) / max(len(norms), 1),
        }

    def _loss_sum(self, micro: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed loss over the micro-batch's response tokens, how many of them are the draft's argmax,
        and how many there are."""
        device = self.context.device
        inputs = model_inputs(micro)
        start, width = inputs.response_start, inputs.response_mask.shape[1]
        logits = self.model(
            input_ids=inputs.input_ids.to(device),
            attention_mask=inputs.attention_mask.to(device),
            position_ids=inputs.position_ids.to(device),
        ).logits[:, start - 1 : start - 1 + width].float() / self.temperature
        mask = inputs.response_mask.to(device)
        targets = micro.response_ids[:, :width].to(device)
        log_q = torch.log_softmax(logits, -1)
        if self.loss == "tokens":
            per_token = -log_q.gather(-1, targets[..., None]).squeeze(-1)
        else:
            top_ids = micro.policy_top_ids[:, :width, : self.top_k].to(device)
            teacher = torch.softmax(micro.policy_top_logprobs[:, :width, : self.top_k].to(device).float(), -1)
            per_token = -(teacher * log_q.gather(-1, top_ids)).sum(-1)
        agree = ((logits.argmax(-1) == targets).float() * mask).sum().detach()
        return (per_token * mask).sum(), agree, mask.sum()

    def _step(self, group) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.context.layout.size > 1:
            for p in params:  # every rank ends the step with the same draft
                torch.distributed.all_reduce(p.grad, group=group)
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # -- weights, checkpoints, export -------------------------------------------------------------
    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, p.detach()) for name, p in self.model.named_parameters())

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is None or not state:
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def export(self, out_dir: Path) -> Path | None:
        if self.optimizer is None:
            return None
        self.model.save_pretrained(out_dir)
        self.context.tokenizer.save_pretrained(out_dir)
        return Path(out_dir)


# --------------------------------------------------------------------------------------------------
# a draft made before the run: a shallow copy of the policy, fitted to the policy's own samples
# --------------------------------------------------------------------------------------------------


def shallow_copy(policy: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A draft for ``policy``: its architecture cut to its first ``layers`` layers, with those layers',
    the embedding's, the final norm's and the output layer's weights copied. It shares the policy's
    vocabulary and already reads tokens as the policy does, so fitting it to the policy's samples
    (:func:`fit_on_completions`) starts far closer than a random model would."""
    from transformers import AutoModelForCausalLM

    config = policy.config.__class__.from_dict(policy.config.to_dict())
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"layers must be within 1..{config.num_hidden_layers} (the policy's), got {layers}")
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = draft.load_state_dict(policy.state_dict(), strict=False)  # the deeper layers are left out
    if [name for name in missing if not name.endswith("rotary_emb.inv_freq")]:
        raise ValueError(f"the draft has weights the policy lacks: {missing[:5]}")
    draft.generation_config = policy.generation_config
    return draft


def completion_batches(examples: list[tuple[list[int], list[int]]], batch: int, steps: int, pad_id: int, seed: int):
    """``steps`` random batches of (prompt, completion) token pairs: ids, labels (the completion's
    tokens only; -100 elsewhere) and the attention mask, right-padded."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        chosen = [examples[i] for i in torch.randint(len(examples), (batch,), generator=generator).tolist()]
        width = max(len(p) + len(a) for p, a in chosen)
        ids = torch.full((batch, width), pad_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, (prompt, answer) in enumerate(chosen):
            seq = prompt + answer
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, len(prompt) : len(seq)] = torch.tensor(answer)
            mask[row, : len(seq)] = 1
        yield ids, labels, mask


def fit_on_completions(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]], steps: int, pad_id: int,
                       lr: float, seed: int, stop=None, every: int = 20, report=print) -> int:  # fmt: skip
    """Supervised AdamW on the completions of (prompt, completion) pairs, batches of 64 (a 20-step
    warm-up, then a constant rate, gradient norm clipped at 1), for ``steps`` batches or until
    ``stop(step)`` (asked every ``every`` steps) says enough; returns the steps taken. ``report``
    gets a line with the loss every ``every`` steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    step = 0
    for step, (ids, labels, mask) in enumerate(completion_batches(examples, 64, steps, pad_id, seed), start=1):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % every == 0:
            report(f"  step {step}: loss {loss.item():.3f}")
            if stop is not None:
                model.eval()
                if stop(step):
                    break
                model.train()
    model.eval()
    return step
