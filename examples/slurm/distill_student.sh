# Distillation of one Apertus v1.1 student from the Apertus-8B teacher's top-256 probabilities
# (docs/recipe.md: 1.7T tokens, loss 0.9 KL + 0.1 CE), shared by distill_apertus_v1.1_*.sbatch,
# which set STUDENT (preset), LR, MIN_LR, GLOBAL_BATCH, MICRO_BATCH and TP before sourcing it.

RUN_DIR="${APERTUS_RUN_DIR:-${APERTUS_REPO:-$SLURM_SUBMIT_DIR}/runs/distill-$STUDENT}"
source "${APERTUS_REPO:-$SLURM_SUBMIT_DIR}/examples/slurm/launch.sh"
source "$APERTUS_REPO/examples/slurm/recipe.sh"
apertus_launch --run-dir "$RUN_DIR" --gpu-memory-gib 96 -- pretrain_gpt.py \
    "${APERTUS_RECIPE[@]}" \
    --model-preset "$STUDENT" --tensor-model-parallel-size "$TP" \
    --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
    --seed 1234 --train-samples "$APERTUS_DISTILL_SAMPLES" \
    --lr "$LR" --min-lr "$MIN_LR" --lr-warmup-samples $((2000 * GLOBAL_BATCH)) \
    --lr-wsd-decay-samples $((APERTUS_DISTILL_SAMPLES / 5)) \
    --distill-logits-path "${APERTUS_LOGITS_DIR:?set APERTUS_LOGITS_DIR to the teacher logits}" \
    --kd-alpha 0.9 --kd-tail label \
    --save "$RUN_DIR/checkpoints" --save-interval 1000 \
    --data-cache-path "$RUN_DIR/cache" --tensorboard-dir "$RUN_DIR/tensorboard"
