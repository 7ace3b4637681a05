"""Offline data preparation: JSON lines to megatron-core indexed datasets (``preprocess``, the
datatrove pipeline ``tokenize_pipeline``, the numpy ``indexed_writer``), chat and preference
datasets, merges and mixtures of tokenized folders, and the embedded default corpus.

The tools in ``tools/`` and their library halves call it; of training, only
:mod:`megatron.apertus.training.runtime` does, to tokenize the embedded corpus on first use.
What training reads stays in :mod:`megatron.apertus.data` and :mod:`megatron.apertus.align`,
below this package: the preparation writes the formats they define.
"""
