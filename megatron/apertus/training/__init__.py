"""Training: model/optimizer setup, the step, the loop's components (objectives, checkpoints,
reporting, validation) and the loop that drives them, and the teacher-logit runner
(``teacher_logits``), which drives a teacher model over the student's data as the loop does."""
