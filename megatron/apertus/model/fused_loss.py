"""GPTModel whose output layer and loss are one fused op: the [tokens, vocabulary] logits of a
training step are never materialised.

With ``labels`` (training and validation) the last pipeline stage returns the *sum* of the
per-token losses over the kept tokens (a 0-dim tensor) instead of per-token losses; without
labels (generation, export checks) it returns logits as megatron-core's GPTModel does.
The op (:func:`megatron.apertus.ops.sparse_kl.fused_linear_sparse_kd` with ``alpha=0``) splits the
vocabulary over the tensor-parallel group like megatron-core's output layer does.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron.apertus.ops.sparse_kl import fused_linear_sparse_kd


class FusedLossGPTModel(GPTModel):
    """megatron-core GPTModel with the fused linear cross-entropy on the last stage."""

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        loss_mask = kwargs.get("loss_mask")
        if not self.post_process or labels is None or loss_mask is None:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, *args, **kwargs
            )
        # Every TP rank needs all tokens, and the hidden-state gradient is the sum of the ranks'
        # vocabulary-shard contributions: the two regions below do exactly that in backward.
        if self.config.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states)
        else:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states)
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # hidden [s, b, h] vs labels/mask [b, s]: flatten both in [s, b] order.
        loss_sum, _ = fused_linear_sparse_kd(
            hidden_states.reshape(-1, hidden_states.shape[-1]),
            weight,
            None,
            None,
            labels.transpose(0, 1).reshape(-1),
            loss_mask.transpose(0, 1).reshape(-1),
            alpha=0.0,
            tp_group=tp_group if tp_group.size() > 1 else None,
            vocab_start=tp_rank * weight.shape[0],
            validate=False,
        )
        return loss_sum
