"""megatron-core's local core attention through torch's ``scaled_dot_product_attention``.

megatron-core 0.16.1 without Transformer Engine computes attention as ``DotProductAttention``: grouped keys
and values copied out to every query head (``repeat_interleave``), scores ``alpha Q K^T`` into a buffer
(``baddbmm``), the mask filled with -10000, a float32 softmax, then ``P V`` (``bmm``): each step a
separate tensor kept for backward. :class:`SDPAttention` is that module (same config, no parameters) with
the same formula in one call, ``softmax(alpha Q K^T + M) V`` with grouped-query heads shared rather than
copied (``enable_gqa``), as Hugging Face's ``sdpa`` attention computes it. The mask arrives as megatron's
(True where masked, ``[1 or b, 1, sq, sk]``) and enters as -10000 added to the scores: a row whose keys are
all masked (a padding position, never read) then stays finite, as megatron's fill keeps it, where -inf
would make it NaN.

The numbers are the same formula in another summation order: not bitwise megatron's, equal to float
rounding (``tests/megatron/test_megatron_attention.py``).

Imports megatron-core: import it only after :func:`rlite.plugins.megatron.shims.apply_cpu_shims`
(``build_gpt_model`` does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

MASKED = -10000.0  # megatron's attention_mask_func fill


class SDPAttention(DotProductAttention):
    """``DotProductAttention`` computed by ``scaled_dot_product_attention`` (module docstring)."""

    def supported(self) -> bool:
        config = self.config
        return (
            self.softmax_offset is None and self.scale_mask_softmax.window_size is None
            and not config.apply_query_key_layer_scaling and (config.attention_dropout == 0.0 or not self.training)
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self.supported() or attention_mask is None or attention_bias is not None or packed_seq_params is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        sq, batch = query.shape[:2]
        # [s, b, heads, d] -> [b, heads, s, d]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(attention_mask, MASKED)
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=bias, scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
        )
        return context.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)
