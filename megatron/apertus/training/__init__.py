"""Training: model/optimizer setup, the step, checkpoints, the loop."""
