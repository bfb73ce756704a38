"""Built-in speculative-decoding drafts, selected by ``rollout.draft``.

* ``draft_model``: a small causal LM that shares the policy's tokenizer proposes tokens; by default it
  is trained online from every step's rollouts (cross-entropy on the sampled tokens, or distillation
  from the policy's top log-probs) and its weights reach the engine with every weight sync.
  Transformers engine (in-process or spawned) and SGLang (``STANDALONE``).
* ``ngram``: prompt lookup, proposals copied from what followed an earlier occurrence of the last
  tokens; no weights, no training. Transformers engine and SGLang (``NGRAM``).

Both keep the rollouts' distribution exactly the policy's (exact speculative sampling); they change
only how many forwards of the policy a rollout takes. See ``docs/speculative.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlite.api import DraftSpec, FixedDraft, ModelDraft, hookimpl


@dataclass
class DraftModelConfig:
    path: str = "???"
    """Hugging Face folder of the draft: a small causal LM made with the policy's tokenizer (same
    vocabulary and token ids). Required."""
    num_speculative_tokens: int = 4
    """Tokens the draft proposes per verification (k); the policy checks them in one forward."""
    train: bool = True
    """Train the draft online from every step's rollouts (its weights then go to the engine with every
    weight sync and into checkpoints); false keeps the draft as loaded (a frozen draft)."""
    loss: str = "tokens"
    """``tokens``: cross-entropy on the sampled tokens; ``distill``: cross-entropy against the policy's
    ``distill_top_k`` most likely tokens at each position, as the engine reported them."""
    distill_top_k: int = 16
    """``loss=distill``: how many of the policy's top log-probs per token the engine reports."""
    lr: float = 1e-4
    """AdamW learning rate of the draft (its own optimizer)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the draft."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the draft (0 = none)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward of the draft's update."""
    updates_per_step: int = 1
    """Optimizer steps per training step (the step's rollouts split into this many parts)."""

    def __post_init__(self) -> None:
        if self.loss not in ("tokens", "distill"):
            raise ValueError(f"loss: {self.loss!r}; valid: tokens, distill")
        for key in ("num_speculative_tokens", "distill_top_k", "micro_batch_size", "updates_per_step"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")


def make_model_draft(context, cfg: DraftModelConfig):
    return ModelDraft(
        cfg.path,
        context,
        num_speculative_tokens=cfg.num_speculative_tokens,
        train=cfg.train,
        loss=cfg.loss,
        distill_top_k=cfg.distill_top_k,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        micro_batch_size=cfg.micro_batch_size,
        updates_per_step=cfg.updates_per_step,
    )


@dataclass
class NgramDraftConfig:
    num_speculative_tokens: int = 4
    """Most tokens proposed per verification (k); fewer, or none, when the lookup finds less."""
    min_match: int = 1
    """The shortest run of last tokens that is looked up earlier in the prompt and completion."""
    max_match: int = 3
    """The longest run looked up (longer runs are tried first)."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match} and {self.max_match}")


def make_ngram_draft(context, cfg: NgramDraftConfig):
    return FixedDraft(DraftSpec("ngram", cfg.num_speculative_tokens, ngram_min=cfg.min_match, ngram_max=cfg.max_match))


@hookimpl
def register_speculative_drafts(register):
    register("draft_model", make_model_draft, DraftModelConfig, method="model")
    register("ngram", make_ngram_draft, NgramDraftConfig, method="ngram")
