"""Quantization: fake-quant formats, their use in megatron-core layers, PTQ baselines (RTN,
GPTQ) and the checkpoint transforms of the Apertus family-expansion recipe (norm fusion,
weight averaging)."""
