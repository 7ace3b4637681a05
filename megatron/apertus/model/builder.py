"""Build Apertus model chunks (one per virtual pipeline stage) on megatron-core's GPTModel."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_attr_wrapped_model

from megatron.apertus import cpu_compat
from megatron.apertus.model.config import ApertusConfig, ParallelConfig
from megatron.apertus.model.cuda_graphs import CudaGraphConfig
from megatron.apertus.model.engine import EngineConfig, transformer_config_fields
from megatron.apertus.model.fused_loss import FusedLossGPTModel
from megatron.apertus.model.precision import set_bf16_layers
from megatron.apertus.model.spec import apertus_block_spec
from megatron.apertus.model.topk import TopKGPTModel
from megatron.apertus.quant.config import QuantConfig


def transformer_config(
    model: ApertusConfig,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool = False,
    transformer_impl: str = "local",
    engine: EngineConfig | None = None,
    graphs: CudaGraphConfig | None = None,
    **overrides,
) -> TransformerConfig:
    """megatron-core's TransformerConfig for ``model`` split as ``parallel``, its layers built
    by ``transformer_impl`` in the precision ``engine`` asks for (FP8, deterministic kernels),
    captured in CUDA graphs as ``graphs`` says (default: none).

    ``overrides`` carries training-side fields (recomputation, overlap flags, the loss's
    normalisation ``calculate_per_token_loss``, which DDP reads when it is built: with it DDP
    leaves out its 1/DP gradient scaling and the schedule scales by the global batch's tokens).
    ``use_te_activation_func=True`` is megatron-core's switch for "build the MLP activation from
    the spec's ``activation_func`` slot"; despite its name it needs no Transformer Engine here.
    """
    low_precision = params_dtype != torch.float32
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        add_bias_linear=False,
        add_qkv_bias=False,
        gated_linear_unit=False,
        use_te_activation_func=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        autocast_dtype=params_dtype if low_precision else None,
        use_cpu_initialization=use_cpu_initialization,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        # gloo matches point-to-point messages between two ranks in posting order; with PP=2 and
        # virtual stages the batched path posts activations and gradients to the same peer in
        # orders that cross over. The unbatched path separates the directions by group.
        # Overlapped p2p (megatron-core's overlap_p2p_comm) is unbatched by definition.
        batch_p2p_comm=not (cpu_compat.is_enabled() or overrides.get("overlap_p2p_comm", False)),
        context_parallel_size=parallel.context_parallel_size,
        # A per-layer list goes to the block spec instead (apertus_block_spec says why).
        cp_comm_type=None if isinstance(parallel.cp_comm_type, list) else parallel.cp_comm_type,
        hierarchical_context_parallel_sizes=parallel.hierarchical_context_parallel_sizes,
        # An explicit empty scope: megatron-core's default "full" only warns that it is deprecated.
        **(graphs or CudaGraphConfig()).transformer_config_fields(),
        **transformer_config_fields(engine or EngineConfig(), transformer_impl),
        **overrides,
    )


def build_model_chunk(
    model: ApertusConfig,
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    *,
    xielu_impl: str = "auto",
    fused_loss: bool = False,
    quant: QuantConfig | None = None,
    topk: int | None = None,
    topk_chunk_rows: int | None = None,
    cp_comm_types: list[str] | None = None,
    pg_collection: ProcessGroupCollection | None = None,
) -> GPTModel:
    """The part of the model that this rank holds for virtual stage ``vp_stage``, communicating
    over ``pg_collection`` (None: megatron-core's default, all of parallel_state's groups).

    ``fused_loss``: the last stage returns the summed loss of a fused output layer + loss
    (:mod:`megatron.apertus.model.fused_loss`) instead of per-token losses. ``quant``: the
    decoder's linears fake-quantize (:mod:`megatron.apertus.quant.layers`). ``topk``: the last
    stage returns the top-``topk`` ids and log-probabilities instead of logits, computed
    ``topk_chunk_rows`` tokens at a time (:mod:`megatron.apertus.model.topk`; the teacher).
    ``cp_comm_types``: a per-layer ``--cp-comm-type`` list (:func:`apertus_block_spec`).
    """
    groups = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    vp_size = config.virtual_pipeline_model_parallel_size
    model_class, head = FusedLossGPTModel if fused_loss else GPTModel, {}
    if topk is not None:
        model_class, head = TopKGPTModel, {"topk": topk, "chunk_rows": topk_chunk_rows}
    spec = apertus_block_spec(
        model, config, vp_stage, xielu_impl=xielu_impl, quant=quant, cp_comm_types=cp_comm_types
    )
    return model_class(
        **head,
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=is_pp_first_stage(groups.pp) and is_vp_first_stage(vp_stage, vp_size),
        post_process=is_pp_last_stage(groups.pp) and is_vp_last_stage(vp_stage, vp_size),
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=model.rotary_base,
        rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        vp_stage=vp_stage,
        pg_collection=groups,
    )


def chunk_groups(chunk: torch.nn.Module) -> ProcessGroupCollection:
    """The process groups a model chunk was built with, through its wrappers (DDP,
    Float16Module): what the code that drives the chunk communicates over."""
    return get_attr_wrapped_model(chunk, "pg_collection", allow_none=False)


def build_model(
    model: ApertusConfig,
    parallel: ParallelConfig,
    *,
    xielu_impl: str = "auto",
    fused_loss: bool = False,
    quant: QuantConfig | None = None,
    topk: int | None = None,
    topk_chunk_rows: int | None = None,
    engine: EngineConfig | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    **config,
) -> list[GPTModel]:
    """All model chunks of this rank (more than one with interleaved pipeline stages), built
    from the :func:`transformer_config` that ``engine`` and ``config`` complete; each chunk keeps
    it as ``.config``, and the layers ``engine.bf16_layers`` names stay out of FP8. The one place
    where training, the teacher-logit runner, conversions and tests build a model.
    ``pg_collection``: the runtime's process groups (None: megatron-core's default, the same
    groups read from parallel_state), kept by each chunk (:func:`chunk_groups`)."""
    tconfig = transformer_config(model, parallel, engine=engine, **config)
    chunks = tconfig.virtual_pipeline_model_parallel_size or 1
    vp = [None] if chunks == 1 else list(range(chunks))
    head = dict(fused_loss=fused_loss, quant=quant, topk=topk, topk_chunk_rows=topk_chunk_rows)
    head["pg_collection"] = pg_collection
    if isinstance(parallel.cp_comm_type, list):
        head["cp_comm_types"] = parallel.cp_comm_type
    built = [
        build_model_chunk(model, tconfig, vp_stage=v, xielu_impl=xielu_impl, **head) for v in vp
    ]
    set_bf16_layers(built, (engine.bf16_layers or ()) if engine is not None else ())
    return built
