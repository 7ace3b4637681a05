"""Tokenizers, documents and batches."""
