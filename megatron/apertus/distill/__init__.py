"""Sparse top-k logit distillation: the teacher logit store (``logit_store``) and its codec,
teacher-logit generation over a student's data (``generate``), and the student's per-step
teacher targets (``targets``)."""
