"""Sparse top-k logit distillation: the teacher logit store (``logit_store``) and its codec
(``logit_codec``), the student's per-step teacher targets (``targets``) and their config.

Teacher-logit generation, which drives a whole model, is a runner of the layer above:
:mod:`megatron.apertus.training.teacher_logits`.
"""
