"""GPTModel whose output layer and loss are one fused op: the [tokens, vocabulary] logits of a
training step are never materialised.

With ``labels`` (training and validation) the last pipeline stage returns the *sum* of the
per-token losses over the kept tokens (a 0-dim tensor) instead of per-token losses; without
labels (generation, teacher logits, export checks) it returns logits as megatron-core's GPTModel
does. The op (:func:`megatron.apertus.ops.sparse_kl.fused_linear_sparse_kd`) splits the
vocabulary over the tensor-parallel group like megatron-core's output layer does.

The loss is cross-entropy (``alpha=0``) unless ``forward`` is given ``teacher`` targets (a
teacher's top-k ids and probabilities per token, :class:`TeacherTargets`): then each kept token
adds ``alpha * KL(teacher || student) + (1 - alpha) * CE`` (distillation, docs/distillation.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron.apertus.ops.sparse_kl import DEFAULT_TAIL, fused_linear_sparse_kd


class TeacherTargets(NamedTuple):
    """A teacher's top-k distribution for every token of a micro-batch, and how to use it."""

    ids: torch.Tensor
    """[b, s, k] int64 vocabulary ids (the batch's [b, s] layout; packed: [1, b*s, k])."""
    probs: torch.Tensor
    """[b, s, k] float32 teacher probabilities of those ids."""
    alpha: float
    """Weight of the KL term; 1 - alpha weighs the cross-entropy with the labels."""
    tail: str = DEFAULT_TAIL
    """Treatment of the teacher mass outside the top-k (ops/sparse_kl.py)."""


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """[b, s, ...] -> [s * b, ...]: the token order of megatron-core's [s, b, h] hidden states."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _run_forward_pre_hooks(module: torch.nn.Module) -> None:
    """What calling ``module`` would run before its forward. The fused loss reads the output
    layer's weight without calling the layer, yet hooks must see it used: megatron-core's DDP
    waits there for the weight's all-gather under --overlap-param-gather."""
    for hook in module._forward_pre_hooks.values():
        hook(module, ())


class FusedLossGPTModel(GPTModel):
    """megatron-core GPTModel with the fused linear cross-entropy (or distillation) loss on the
    last stage."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        teacher: TeacherTargets | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """GPTModel.forward; on the last stage with ``labels`` and ``loss_mask``, the loss sum
        of the final hidden states, distillation when ``teacher`` is given."""
        output = super().forward(
            input_ids, position_ids, attention_mask, labels=labels, loss_mask=loss_mask, **kwargs
        )
        if not self._fuses_loss(labels, loss_mask):
            return output
        return self._fused_loss(output, labels, loss_mask, teacher)

    def _fuses_loss(self, labels: torch.Tensor | None, loss_mask: torch.Tensor | None) -> bool:
        """Whether this call ends in the fused loss: the last stage of a call with targets."""
        return self.post_process and labels is not None and loss_mask is not None

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """The final hidden states, untouched, when :meth:`forward` computes the fused loss from
        them (the output layer never runs); megatron-core's logits or losses otherwise."""
        if self._fuses_loss(labels, kwargs.get("loss_mask")):
            return hidden_states
        return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)

    def _fused_loss(
        self,
        hidden_states: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        teacher: TeacherTargets | None,
    ) -> torch.Tensor:
        """The sum of the kept tokens' losses (0-dim), computed from the final hidden states
        [s, b, h] and the output layer's weight without materialising the logits."""
        # Every TP rank needs all tokens, and the hidden-state gradient is the sum of the ranks'
        # vocabulary-shard contributions: the two regions below do exactly that in backward.
        tp_group = self.pg_collection.tp
        if self.config.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=tp_group)
        else:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        if weight is self.output_layer.weight:
            _run_forward_pre_hooks(self.output_layer)
        if teacher is not None and teacher.alpha == 0.0:
            teacher = None  # cross-entropy only: exactly the path of a run without a teacher
        # hidden [s, b, h] vs labels/mask/teacher [b, s, ...]: flatten all in [s, b] order.
        loss_sum, _ = fused_linear_sparse_kd(
            hidden_states.reshape(-1, hidden_states.shape[-1]),
            weight,
            None if teacher is None else _token_major(teacher.ids),
            None if teacher is None else _token_major(teacher.probs),
            _token_major(labels),
            _token_major(loss_mask),
            alpha=0.0 if teacher is None else teacher.alpha,
            tail=DEFAULT_TAIL if teacher is None else teacher.tail,
            tp_group=tp_group if tp_group.size() > 1 else None,
            vocab_start=tp_group.rank() * weight.shape[0],
            validate=False,
        )
        return loss_sum
