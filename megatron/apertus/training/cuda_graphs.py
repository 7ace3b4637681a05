"""What the training loop does for ``--cuda-graph-impl`` (:mod:`megatron.apertus.model.cuda_graphs`
decides and checks the choice; megatron-core captures and replays).

* ``local``: nothing. megatron-core's schedules end every forward-backward pass with
  ``create_cudagraphs()``: the first step of the job records each layer's calls eagerly and
  captures them at its end, later steps replay.
* ``transformer_engine``: megatron-core's ``TECudaGraphHelper`` (built with the model, the
  optimizer, the sequence length and micro-batch size) captures every layer's graphs once this
  job has run ``--cuda-graph-warmup-steps`` eager steps, before the next one, as Megatron-LM's
  loop does. Under ``--overlap-param-gather`` DDP's forward pre-hooks (the parameter all-gathers)
  are off during the capture, and afterwards the graphed layers call them by hand
  (``cuda_graph_set_manual_hooks``): a replay runs no Python hook. The helper zeroes the
  gradient buffers after capturing, so the warm-up runs of the capture add nothing to a step.

megatron-core is imported only when graphs are on (they need a GPU and Transformer Engine).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from megatron.apertus.errors import ConfigError
from megatron.apertus.model.cuda_graphs import (
    CudaGraphConfig,
    GraphedRun,
    captured_graphs,
    cuda_graph_problems,
)
from megatron.apertus.model.engine import EngineConfig, transformer_engine_error

log = logging.getLogger("apertus")


class GraphCapture:
    """The capture of one job's CUDA graphs, driven from the loop (:meth:`before_step`)."""

    def __init__(
        self,
        config: CudaGraphConfig,
        model: list,
        optimizer,
        *,
        seq_length: int,
        micro_batch_size: int,
        start_iteration: int,
        reporting: bool,
    ) -> None:
        """``start_iteration``: the iteration this job starts from (warm-up steps count from
        it); ``reporting``: this rank logs the number of graphs once they exist."""
        self.config, self.model = config, model
        self.start, self.reporting = start_iteration, reporting
        self.count = 0
        """Graphs this rank's layers hold (0 until captured)."""
        self.helper = None
        if config.cuda_graph_impl == "transformer_engine":
            from megatron.core.utils import get_model_config

            from megatron.apertus.mcore_compat import te_cuda_graph_helper
            from megatron.apertus.model.builder import chunk_groups

            self.helper = te_cuda_graph_helper(
                model,
                get_model_config(model[0]),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                optimizers=[optimizer],
                groups=chunk_groups(model[0]),
            )

    def before_step(self, iteration: int) -> None:
        """Before step ``iteration`` (1-based): Transformer Engine's capture, once the job has
        run its warm-up steps."""
        if self.helper is None or iteration - 1 - self.start != self.config.cuda_graph_warmup_steps:
            return
        hooked = [chunk for chunk in self.model if chunk.use_forward_hook]
        for chunk in hooked:
            chunk.disable_forward_pre_hook(param_sync=False)
        self.helper.create_cudagraphs()
        for chunk in hooked:
            chunk.enable_forward_pre_hook()
        if hooked:
            self.helper.cuda_graph_set_manual_hooks()

    def after_step(self) -> None:
        """Count the graphs once after they appear, and say so."""
        if self.count or not self.config.enabled:
            return
        self.count = captured_graphs(self.model)
        if self.count and self.reporting:
            log.info(
                "CUDA graphs (%s): %d captured on this rank; later steps replay them",
                self.config.cuda_graph_impl,
                self.count,
            )


def graphed_run(config: Any, *, device: str, impl: str, engine: EngineConfig) -> GraphedRun:
    """What CUDA graphs depend on in the rest of the run: ``config`` holds the groups (a
    :class:`RunConfig`, or any object with its group attributes); ``impl`` and ``engine`` as the
    run resolves them (a deterministic run may switch the core attention)."""
    training, guard = config.training, config.fp8_guard
    return GraphedRun(
        device=device,
        precision=training.precision,
        transformer_impl=impl,
        attention_backend=engine.attention_backend,
        packed_documents=config.dataset.reset_attention_mask,
        pipeline_parallel=config.parallel.pipeline_model_parallel_size,
        context_parallel=config.parallel.context_parallel_size,
        rampup=training.rampup_batch_size is not None,
        recompute_granularity=training.recompute_granularity,
        fp8=engine.fp8,
        bf16_layers=bool(engine.bf16_layers),
        fp8_guard_switches=guard.switches,
        intermediate_metrics=bool(config.logging.log_intermediate_metrics),
        gradient_accumulation_fusion=engine.gradient_accumulation_fusion,
    )


def check_cuda_graphs(
    config: Any,
    *,
    device: str,
    impl: str,
    engine: EngineConfig,
    te_error: Callable[[], str | None] = transformer_engine_error,
) -> None:
    """Refuse, in one line, CUDA graphs the rest of the run cannot replay (the first reason)."""
    run = graphed_run(config, device=device, impl=impl, engine=engine)
    problems = cuda_graph_problems(config.cuda_graphs, run, te_error)
    if problems:
        raise ConfigError(problems[0])
