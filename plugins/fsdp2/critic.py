"""The critic of PPO with GAE on FSDP2: the policy's architecture with a scalar value head.

``V(s_t)`` for response token ``t`` is read from the hidden state at the position that predicts the
token (``response_start - 1 + t``), i.e. the state before the token is emitted. The critic is trained by
the loop that trains the policy (:func:`rlite.stages.update.update_critic`, where the clipped value loss
is), and steps like it (:class:`~rlite.training.backend.BackendBase`: clipping, the non-finite skip).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlite.api import (
    BackendBase,
    CriticConfig,
    ForwardSpec,
    ModelConfig,
    ModelInputs,
    PackedRows,
    ParallelismConfig,
    RolloutBatch,
    causal_lm_of,
    model_inputs,
    pad_to_width,
    to_device,
)
from rlite.plugins.fsdp2.sharding import load_sharded


class ValueModel(nn.Module):
    """A decoder with a zero-initialised linear value head (so V starts at 0 everywhere)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        hidden = causal_lm_of(lm).config.hidden_size
        self.value_head = nn.Linear(hidden, 1, bias=False)
        nn.init.zeros_(self.value_head.weight)

    # FSDP2 shards decoder blocks through this path, like the policy
    @property
    def causal_lm(self) -> nn.Module:
        return causal_lm_of(self.lm)

    def forward(self, inputs: ModelInputs, packed: PackedRows | bool = False) -> torch.Tensor:
        """``[B, T]`` values of the response tokens of ``inputs`` (:func:`rlite.rollout.model_inputs`), 0 past
        each response. ``packed``: a :class:`PackedRows` of the attention mask (built on the host, moved with
        the inputs) or ``True`` (built here from it); the forward then runs padding-free."""
        decoder = self.causal_lm.get_decoder()
        response_start = inputs.response_start
        width = inputs.input_ids.shape[1] - response_start
        columns = slice(response_start - 1, response_start - 1 + width)
        if packed:  # padding-free: the real tokens end to end (rlite.training.packing)
            rows = packed if isinstance(packed, PackedRows) else PackedRows.of(inputs.attention_mask)
            flat = decoder(input_ids=rows.pack(inputs.input_ids), position_ids=rows.positions(inputs.position_ids),
                           use_cache=False).last_hidden_state.flatten(0, 1)
            states = rows.unpack(flat, columns)
        else:
            hidden = decoder(
                input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids,
                use_cache=False,
            ).last_hidden_state
            states = hidden[:, columns]
        values = self.value_head(states).squeeze(-1).float()
        return values * inputs.response_mask.to(values.dtype)


@dataclass
class Critic(BackendBase):
    """The value model with its own AdamW (constant learning rate, ``algorithm.critic.lr``); the step,
    clipping to ``algorithm.critic.grad_clip`` and the checkpoint's state are :class:`BackendBase`'s."""

    model: ValueModel
    optimizer: torch.optim.Optimizer
    cfg: CriticConfig
    device: torch.device = torch.device("cpu")
    """Where the critic computes (its values are returned there by :meth:`values`)."""
    scheduler: None = None
    """No LR schedule: the critic's learning rate stays ``algorithm.critic.lr``."""

    checkpoint_keys = ("critic", "critic_optim")  # beside the policy's model and optim

    @property
    def grad_clip(self) -> float:
        return self.cfg.grad_clip

    @classmethod
    def build(cls, model_cfg: ModelConfig, par_cfg: ParallelismConfig, cfg: CriticConfig, device) -> Critic:
        backbone_cfg = type(model_cfg)(**{**model_cfg.__dict__, "path": cfg.path or model_cfg.path})

        def wrap(lm: nn.Module) -> ValueModel:
            lm.config.use_cache = False
            head = lm.get_output_embeddings()
            if head is not None and head.weight is not lm.get_input_embeddings().weight:
                head.weight.requires_grad_(False)  # the critic never uses the LM head: keep it out of the optimizer
            return ValueModel(lm)

        model = load_sharded(backbone_cfg, par_cfg, device, wrap)  # the backbone read once, on rank 0
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, fused=True)
        return cls(model, optimizer, cfg, device)

    def values(self, batch: RolloutBatch, spec: ForwardSpec) -> torch.Tensor:
        """``[B, T]`` values on the critic's device; the inputs (and the packing) built from the batch's host
        tensors and moved there asynchronously, as the policy's (:func:`rlite.plugins.fsdp2.backend.policy_logprobs`)."""
        inputs = model_inputs(batch, exact_layout=spec.exact_layout)
        rows = PackedRows.of(inputs.attention_mask) if spec.pack_sequences and not spec.exact_layout else False
        inputs, rows = to_device((inputs, rows), self.device)
        return pad_to_width(self.model(inputs, packed=rows), batch.response_ids.shape[1])
