"""Quantization: fake-quant formats, their use in megatron-core layers, PTQ baselines (RTN,
GPTQ) and the checkpoint transforms of seed 003's recipe (norm fusion, weight averaging)."""
