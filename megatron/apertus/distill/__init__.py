"""Sparse top-k logit distillation: the teacher logit store (``logit_store``) and its codec."""
