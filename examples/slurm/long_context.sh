# The long-context phase of an Apertus model (Apertus tech report, arXiv 2509.14233, section 2.5,
# Table 5): from a pretraining checkpoint, four stages of 8k, 16k, 32k and 64k tokens, each one a
# run of its own that starts from the previous stage's last checkpoint with fresh optimizer state
# (--finetune --no-load-rng --load PREVIOUS; the launcher drops those flags once the stage has
# a checkpoint of its own), the global batch kept in tokens, the RoPE base raised per stage, a
# constant learning rate after a warmup of 1.2B tokens (WSD without cooldown:
# --lr-wsd-decay-iters 0), and a long-document mixture per stage.
#
# Sourced by long_context_apertus_{8b,70b}.sbatch, which set MODEL (preset), LR, WARMUP_ITERS,
# LAYOUT (flags of every stage), STAGES (names in order) and, per stage name, SEQ, ROTARY_BASE,
# TP, CP, GLOBAL_BATCH, ITERS and SAVE_INTERVAL (associative arrays).
#
# Which stage runs: APERTUS_LONG_CONTEXT_STAGE (8k, 16k, 32k or 64k), else the first stage whose
# checkpoints have not reached its --train-iters. A stage starts only once the one before it is
# finished. Its data: APERTUS_LONG_CONTEXT_DATA_8K (_16K, _32K, _64K), a Megatron blend of that
# stage's mixture (Table 8: ~70% pretraining stage 5, ~20% FineWeb-Long documents of the stage's
# length bucket, ~10% Institutional Books; the stages never share a file). The first stage loads
# APERTUS_PRETRAINED_CHECKPOINT.

BASE_DIR="${APERTUS_RUN_DIR:-${APERTUS_REPO:-$SLURM_SUBMIT_DIR}/runs/$MODEL-long-context}"

stage_finished() {  # STAGE: its checkpoints reached its --train-iters
    local tracker="$BASE_DIR/$1/checkpoints/latest_checkpointed_iteration.txt"
    [[ -f "$tracker" ]] && (($(<"$tracker") >= ${ITERS[$1]}))
}

STAGE="${APERTUS_LONG_CONTEXT_STAGE:-}"
if [[ -z "$STAGE" ]]; then
    for name in "${STAGES[@]}"; do
        stage_finished "$name" || { STAGE="$name"; break; }
    done
    : "${STAGE:?every long-context stage of $BASE_DIR is finished}"
fi
[[ -v "SEQ[$STAGE]" ]] || { echo "APERTUS_LONG_CONTEXT_STAGE=$STAGE: choose one of ${STAGES[*]}" >&2; exit 2; }

PREVIOUS=""
for name in "${STAGES[@]}"; do
    [[ "$name" == "$STAGE" ]] && break
    PREVIOUS="$name"
done
if [[ -z "$PREVIOUS" ]]; then
    INITIAL="${APERTUS_PRETRAINED_CHECKPOINT:?set APERTUS_PRETRAINED_CHECKPOINT to the pretraining checkpoint the long-context phase starts from}"
elif stage_finished "$PREVIOUS"; then
    INITIAL="$BASE_DIR/$PREVIOUS/checkpoints"
else
    echo "stage $STAGE starts from stage $PREVIOUS, which has not reached its ${ITERS[$PREVIOUS]} iterations in $BASE_DIR/$PREVIOUS/checkpoints" >&2
    exit 2
fi

DATA_VARIABLE="APERTUS_LONG_CONTEXT_DATA_${STAGE^^}"
APERTUS_DATA="${!DATA_VARIABLE:?set $DATA_VARIABLE to the Megatron data blend of the $STAGE stage}"
APERTUS_SEQ_LENGTH="${SEQ[$STAGE]}"
RUN_DIR="$BASE_DIR/$STAGE"

source "${APERTUS_REPO:-$SLURM_SUBMIT_DIR}/examples/slurm/launch.sh"
source "$APERTUS_REPO/examples/slurm/recipe.sh"
apertus_launch --run-dir "$RUN_DIR" --gpu-memory-gib 96 -- pretrain_gpt.py \
    "${APERTUS_RECIPE[@]}" "${APERTUS_GOLDFISH[@]}" "${APERTUS_FP8_FLAGS[@]}" \
    --model-preset "$MODEL" --rotary-base "${ROTARY_BASE[$STAGE]}" \
    --tensor-model-parallel-size "${TP[$STAGE]}" --context-parallel-size "${CP[$STAGE]}" \
    "${LAYOUT[@]}" \
    --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH[$STAGE]}" \
    --train-iters "${ITERS[$STAGE]}" \
    --lr "$LR" --min-lr "$LR" --lr-warmup-iters "$WARMUP_ITERS" --lr-wsd-decay-iters 0 \
    --load "$INITIAL" --finetune --no-load-rng \
    --save "$RUN_DIR/checkpoints" --save-interval "${SAVE_INTERVAL[$STAGE]}" \
    --data-cache-path "$RUN_DIR/cache" --tensorboard-dir "$RUN_DIR/tensorboard"
