"""Training: model/optimizer setup, the step, checkpoints, the loop, and the teacher-logit runner
(``teacher_logits``), which drives a teacher model over the student's data as the loop does."""
