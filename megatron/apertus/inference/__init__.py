"""Text generation from a checkpoint: the sampling flags and prompts (``config``) and the
decoding loop over megatron-core's KV cache (``generate``); ``tools/generate_text.py`` is the
entry point."""
