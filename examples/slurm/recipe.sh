# The Apertus recipe (docs/recipe.md) as pretrain_gpt.py flags, shared by the pretraining and
# distillation launchers; each launcher adds its model, layout, batch, learning rate and length.
# Sourced after launch.sh. APERTUS_DATA is the Megatron blend: "[WEIGHT] PREFIX [WEIGHT] PREFIX ...";
# APERTUS_SEQ_LENGTH the sequence length and RoPE's maximum position (the recipe's 4096 unless a
# long-context stage sets it).

APERTUS_SEQ_LENGTH="${APERTUS_SEQ_LENGTH:-4096}"
read -r -a APERTUS_DATA_PATH <<<"${APERTUS_DATA:?set APERTUS_DATA to a Megatron data blend, e.g. '0.7 /data/web_text_document 0.3 /data/code_text_document'}"

# The data as the run sees it (blend, split, sequence length, document packing): teacher logits
# are generated over exactly the samples a student built from these flags consumes.
APERTUS_DATA_FLAGS=(
    --data-path "${APERTUS_DATA_PATH[@]}" --split 969,30,1 --seq-length "$APERTUS_SEQ_LENGTH"
    --reset-position-ids --reset-attention-mask --eod-mask-loss
)
# The v1.1 students' length (docs/recipe.md: 1.7T tokens of 4096), shared with their logits.
APERTUS_DISTILL_SAMPLES=415039062

APERTUS_RECIPE=(
    --device cuda --precision bf16 --transformer-impl transformer_engine
    --max-position-embeddings "$APERTUS_SEQ_LENGTH"
    --optimizer ademamix --adam-beta1 0.9 --adam-beta2 0.999 --ademamix-beta3 0.9999
    --ademamix-alpha 8 --ademamix-alpha-warmup 100000 --ademamix-beta3-warmup 100000
    --weight-decay 0.1 --clip-grad 0.1 --use-distributed-optimizer
    --overlap-grad-reduce --overlap-param-gather
    --lr-decay-style WSD --lr-wsd-decay-style 1-sqrt
    "${APERTUS_DATA_FLAGS[@]}"
    --log-interval 10 --eval-interval 2000 --eval-iters 10
)

# FP8 (APERTUS_FP8=1): Transformer Engine's hybrid format with delayed scaling (the fastest on
# Hopper in docs/gpu.md), watched by the FP8 guard: a layer whose GEMM inputs grow heavy tails or
# underflow continues in bf16 from the last checkpoint saved before the alarm (docs/gpu.md).
APERTUS_FP8_FLAGS=()
if [[ "${APERTUS_FP8:-0}" == 1 ]]; then
    APERTUS_FP8_FLAGS=(
        --fp8-format hybrid --fp8-recipe delayed
        --fp8-guard --fp8-guard-action bf16-layers
    )
fi

# Memorisation-safe pretraining: Goldfish drops a deterministic 1/50 of the loss positions.
APERTUS_GOLDFISH=(--goldfish-loss --goldfish-k 50 --goldfish-h 50)
