"""Tokenizers: text <-> ids, below both the data training reads and the offline preparation.

:mod:`.tokenizers` holds the three families behind one interface (tekken, Hugging Face,
sentencepiece) and the ids training needs; :mod:`.tekken_vocab` the cached vocabulary the tekken
tokenizer encodes with. Neither imports torch: the preprocessing tools tokenize without it.
"""
