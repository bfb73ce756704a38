"""Per-token log-probs and entropy of a causal LM, without keeping [tokens, vocab] logits for backward.

:class:`PolicyModel` wraps a Hugging Face causal LM so that FSDP2's root unit owns the whole forward:
the decoder produces hidden states, then only the *response* positions go through the output layer,
in chunks of ``chunk_size`` tokens under activation checkpointing. Each chunk computes

    z = (h @ W^T) / temperature        (float32)
    log p(y) = z_y - logsumexp(z)
    H = logsumexp(z) - sum softmax(z) * z

so the backward pass re-computes one chunk's logits at a time instead of storing all of them. When a
micro-batch's response logits are small (``training.logprob_recompute_mb``) they are simply kept,
which saves the recomputation; the entropy is kept out of the autograd graph unless it is in the
loss (``algorithm.entropy_coef != 0``).
Temperature is the sampling temperature: the engine draws from softmax(z) with the same division.

``use_liger=True`` (CUDA only) gets the log-probs from liger-kernel's fused linear cross-entropy with
``reduction="none"`` on ``h / temperature`` (the same maths, in Triton kernels that never materialise
the logits); entropy is then computed without gradient by the chunked path, for metrics only.

``exact_layout=True`` instead calls the output layer on every position and ``log_softmax`` on the
full logits, exactly as the transformers engine's fixed-shape sampler does, so that the trainer's
numbers equal the engine's bit for bit (true on-policy mode).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_logprob_entropy(hidden, weight, bias, targets, temperature: float, with_entropy: bool, entropy_grad: bool):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits.float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        z = logits if entropy_grad else logits.detach()
        entropy = (lse if entropy_grad else lse.detach()) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logprobs, entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    recompute: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[N]`` of ``targets`` and entropies ``[N]`` from hidden states ``[N, H]``.

    ``recompute`` checkpoints each chunk (its logits are recomputed in backward instead of kept);
    ``entropy_grad=False`` computes the entropy outside the autograd graph (a metric only).
    """
    outputs_lp, outputs_ent = [], []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start : start + chunk_size], weight, bias, targets[start : start + chunk_size])
        if needs_grad and recompute:
            lp, ent = checkpoint(
                _chunk_logprob_entropy, *args, temperature, with_entropy, entropy_grad, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprob_entropy(*args, temperature, with_entropy, entropy_grad)
        outputs_lp.append(lp)
        outputs_ent.append(ent)
    if not outputs_lp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(outputs_lp), torch.cat(outputs_ent)


def liger_logprobs(hidden, weight, targets, *, bias=None, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets) through liger's fused linear cross-entropy: -CE(h / T @ W^T + b / T, y)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
    scaled_bias = None if bias is None else bias / temperature
    return -loss(weight, hidden / temperature, targets, scaled_bias).float()


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside a plain or peft-wrapped model."""
    if hasattr(model, "get_base_model"):  # peft
        return model.get_base_model()
    return model


class PolicyModel(nn.Module):
    """A causal LM whose forward returns response-token log-probs (and entropy) directly.

    ``forward(input_ids, attention_mask, position_ids, response_start, response_mask)`` scores the
    tokens ``input_ids[:, response_start:]``: position ``response_start - 1 + t`` predicts response
    token ``t``. Returns ``[B, T]`` log-probs and entropies, zero where ``response_mask`` is 0.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def causal_lm(self) -> nn.Module:
        return causal_lm_of(self.lm)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_start: int,
        response_mask: torch.Tensor,
        temperature: float = 1.0,
        chunk_size: int = 1024,
        with_entropy: bool = False,
        exact_layout: bool = False,
        use_liger: bool = False,
        entropy_grad: bool = True,
        recompute_above_bytes: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lm = self.causal_lm
        hidden = lm.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        head = lm.get_output_embeddings()
        targets = input_ids[:, response_start:]
        batch, width = targets.shape
        if exact_layout:
            logits = head(hidden).float()
            logprobs_all = torch.log_softmax(logits[:, response_start - 1 : -1] / temperature, dim=-1)
            logprobs = logprobs_all.gather(-1, targets[..., None]).squeeze(-1)
            entropy = torch.zeros_like(logprobs)
            if with_entropy:
                entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
            mask = response_mask.to(logprobs.dtype)
            return logprobs * mask, entropy * mask
        h = hidden[:, response_start - 1 : response_start - 1 + width]
        selected = response_mask.bool()
        args = (h[selected], head.weight, targets[selected])
        bias = getattr(head, "bias", None)
        # keep a micro-batch's response logits for backward when they are small; recompute otherwise
        recompute = args[0].shape[0] * head.weight.shape[0] * 4 > recompute_above_bytes
        options = dict(entropy_grad=entropy_grad, recompute=recompute)
        if use_liger:
            lp_flat = liger_logprobs(*args, bias=bias, temperature=temperature)
            with torch.no_grad():
                _, ent_flat = chunked_logprobs(
                    *args, bias=bias, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
                )
        else:
            lp_flat, ent_flat = chunked_logprobs(
                *args, bias=bias, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                **options,
            )
        logprobs = hidden.new_zeros(batch, width, dtype=torch.float32)
        entropy = hidden.new_zeros(batch, width, dtype=torch.float32)
        logprobs = logprobs.masked_scatter(selected, lp_flat)
        entropy = entropy.masked_scatter(selected, ent_flat)
        return logprobs, entropy
