"""Preprocessing, datasets, chat and SFT data, Goldfish masks and batches."""
