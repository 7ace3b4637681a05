"""Model FLOPs per token, the usual count: 6 x (non-embedding parameters + output layer) for
the matmuls, plus 6 x layers x seq x hidden for attention scores and values (causal halves the
12 of full attention). Training's throughput and MFU and the launch planner both read it.
"""

from __future__ import annotations

from megatron.apertus.model.config import ApertusConfig


def flops_per_token(model: ApertusConfig) -> float:
    """Training FLOPs (forward + backward) per token."""
    dense = model.num_parameters() - model.vocab_size * model.hidden_size  # output layer stays
    if not model.untie_embeddings_and_output_weights:
        dense += model.vocab_size * model.hidden_size
    attention = 6 * model.num_layers * model.seq_length * model.hidden_size
    return 6 * dense + attention
