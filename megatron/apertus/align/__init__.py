"""Post-training alignment: preference and reward objectives over stored reference log-probs."""
