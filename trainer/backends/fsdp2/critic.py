"""The critic of PPO with GAE: the policy's architecture with a scalar value head, on FSDP2.

``V(s_t)`` for response token ``t`` is read from the hidden state at the position that predicts the
token (``response_start - 1 + t``), i.e. the state before the token is emitted. The value loss is
verl's clipped form, aggregated with the run's loss-aggregation mode:

    l_t = 1/2 * max((v_t - G_t)^2, (clip(v_t, v_old - c, v_old + c) - G_t)^2)

(slime omits the 1/2; it only rescales the critic's learning rate). ``vf_clipfrac`` is the fraction
of response tokens where the clipped branch is strictly larger.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from rlite.algorithms import aggregate_loss
from rlite.backends.fsdp2.sharding import load_sharded
from rlite.config import CriticConfig, ModelConfig, ParallelismConfig
from rlite.distributed import all_reduce_sum
from rlite.rollout import RolloutBatch, model_inputs, pad_to_width
from rlite.training.device import to_device
from rlite.training.logprobs import causal_lm_of
from rlite.training.micro_batching import MicroBatching
from rlite.training.packing import PackedRows


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

    def forward(self, input_ids, attention_mask, position_ids, response_start: int, response_mask, packed=False):
        """``packed``: a :class:`PackedRows` of ``attention_mask`` (built on the host, moved with the inputs) or
        ``True`` (built here from ``attention_mask``); the forward then runs padding-free."""
        decoder = self.causal_lm.get_decoder()
        width = input_ids.shape[1] - response_start
        columns = slice(response_start - 1, response_start - 1 + width)
        if packed:  # padding-free: the real tokens end to end (rlite.training.packing)
            rows = packed if isinstance(packed, PackedRows) else PackedRows.of(attention_mask)
            flat = decoder(input_ids=rows.pack(input_ids), position_ids=rows.positions(position_ids),
                           use_cache=False).last_hidden_state.flatten(0, 1)
            states = rows.unpack(flat, columns)
        else:
            hidden = decoder(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
            states = hidden[:, columns]
        values = self.value_head(states).squeeze(-1).float()
        return values * response_mask.to(values.dtype)


def value_loss(values, old_values, returns, mask, value_clip: float):
    """Per-token clipped value loss and the clip indicator (see the module docstring)."""
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped) * mask
    return loss, (clipped > unclipped).float() * mask


@dataclass
class Critic:
    model: ValueModel
    optimizer: torch.optim.Optimizer
    cfg: CriticConfig
    device: torch.device = torch.device("cpu")
    """Where the critic computes (its values are returned there by :meth:`_forward`)."""

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

    def checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"critic": model_sd, "critic_optim": optim_sd}

    def load_checkpoint_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["critic"], optim_state_dict=state["critic_optim"]
        )

    def _forward(self, batch: RolloutBatch, exact_layout: bool, packed: bool = False) -> torch.Tensor:
        """``[B, T]`` values on the critic's device; the inputs (and the packing) built from the batch's host
        tensors and moved there asynchronously, as the policy's (:func:`rlite.backends.fsdp2.backend.policy_logprobs`)."""
        inputs = model_inputs(batch, exact_layout=exact_layout)
        rows = PackedRows.of(inputs.attention_mask) if packed and not exact_layout else False
        inputs, rows = to_device((inputs, rows), self.device)
        values = self.model(
            inputs.input_ids, inputs.attention_mask, inputs.position_ids, inputs.response_start, inputs.response_mask,
            packed=rows,
        )
        return pad_to_width(values, batch.response_ids.shape[1])

    @torch.no_grad()
    def values(self, batch: RolloutBatch, micro_batching: MicroBatching, exact_layout: bool, minibatches: int = 1, *,
               packed: bool = False) -> torch.Tensor:
        """V_old on the same mini/micro-batch partition as :meth:`update` (same shapes, same rounding), on the
        batch's device (the micro-batches' values copied over once, at the end)."""
        out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
        size = len(batch) // minibatches
        rows_done: list[int] = []
        computed: list[torch.Tensor] = []
        for index in range(minibatches):
            mini = batch.select(slice(index * size, (index + 1) * size))
            for rows in micro_batching.split(mini):
                computed.append(self._forward(mini.select(rows), exact_layout, packed).to(out.dtype))
                rows_done.extend(index * size + r for r in rows)
        if computed:
            out[rows_done] = torch.cat(computed).to(out.device)
        return out * batch.response_mask

    def update(
        self, batch: RolloutBatch, *, micro_batching: MicroBatching, minibatches: int, agg_mode: str, horizon: float,
        dp_size: int, exact_layout: bool, packed: bool = False,
    ) -> dict[str, float]:
        """One pass of the clipped value loss over the batch (``batch.targets``: old_values, returns, loss_mask)."""
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        size = len(batch) // minibatches
        for index in range(minibatches):
            mini = batch.select(slice(index * size, (index + 1) * size))
            totals = all_reduce_sum(torch.tensor([mini.targets.loss_mask.sum().item(), float(len(mini))]))
            n_tok, n_seq = float(totals[0]), float(totals[1])
            step: dict[str, torch.Tensor] = {}  # device tensors: no wait for the device inside the loop
            for rows in micro_batching.split(mini):
                mb = mini.select(rows)
                values = self._forward(mb, exact_layout, packed)
                targets = to_device(mb.targets, values.device)
                mask = targets.loss_mask
                per_token, clipped = value_loss(values, targets.old_values, targets.returns, mask, self.cfg.value_clip)
                loss = aggregate_loss(per_token, mask, agg_mode, global_tokens=n_tok, global_sequences=n_seq,
                                      dp_size=dp_size, horizon=horizon)
                loss.backward()
                share = dp_size / max(n_tok, 1.0)
                for name, value in (("critic/vf_loss", loss.detach().double()),
                                    ("critic/vf_clipfrac", clipped.sum().double() * share),
                                    ("critic/values_mean", (values.detach() * mask).sum().double() * share)):
                    step[name] = step[name] + value if name in step else value
            max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
            params = [p for p in self.model.parameters() if p.requires_grad]
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            reduced = all_reduce_sum(torch.stack(list(step.values())).cpu()) / dp_size
            for name, value in zip(step, reduced.tolist()):
                sums[name] += value / minibatches
            sums["critic/grad_norm"] += float(norm) / minibatches
        return dict(sums)
