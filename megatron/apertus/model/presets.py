"""Published Apertus shapes (docs/recipe.md) and a tiny model for tests and the demo."""

from __future__ import annotations

import dataclasses

from megatron.apertus.errors import ConfigError
from megatron.apertus.model.config import ApertusConfig

PRESETS: dict[str, ApertusConfig] = {
    "apertus-8b": ApertusConfig(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=21504,
        num_attention_heads=32,
        num_query_groups=8,
    ),
    "apertus-70b": ApertusConfig(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=43008,
        num_attention_heads=64,
        num_query_groups=8,
    ),
    "apertus-v1.1-0.5b": ApertusConfig(
        num_layers=20,
        hidden_size=1024,
        ffn_hidden_size=6144,
        num_attention_heads=16,
        num_query_groups=4,
        untie_embeddings_and_output_weights=False,
    ),
    "apertus-v1.1-1.5b": ApertusConfig(
        num_layers=16,
        hidden_size=2048,
        ffn_hidden_size=12288,
        num_attention_heads=32,
        num_query_groups=8,
    ),
    "apertus-v1.1-4b": ApertusConfig(
        num_layers=24,
        hidden_size=3072,
        ffn_hidden_size=16384,
        num_attention_heads=24,
        num_query_groups=8,
    ),
    # Same architecture, CPU-sized: 4 layers so that PP=2 and PP=2 x 2 virtual stages split evenly,
    # 4 query heads over 2 kv heads so that TP=2 keeps GQA.
    "tiny": ApertusConfig(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=192,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=128,
        max_position_embeddings=4096,
    ),
}


def preset(name: str, **overrides) -> ApertusConfig:
    """A preset by name, with fields overridden (e.g. ``seq_length=256``)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --model-preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
