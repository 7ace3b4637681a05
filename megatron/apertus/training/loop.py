"""The training loop: build, (load), step, log, evaluate, save. Reads like torchtitan's train()."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron.apertus import parallel
from megatron.apertus.data.batches import micro_batches
from megatron.apertus.data.corpus import train_valid_streams
from megatron.apertus.data.tokenizer import load_tokenizer
from megatron.apertus.model.builder import build_model, transformer_config
from megatron.apertus.model.config import (
    ApertusConfig,
    ConfigError,
    ParallelConfig,
    dtype_from_name,
)
from megatron.apertus.training import checkpoint
from megatron.apertus.training.config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimizerSettings,
    TrainingConfig,
)
from megatron.apertus.training.step import build_optimizer, forward_step, train_step, wrap_ddp

log = logging.getLogger("apertus")


@dataclass(kw_only=True)
class RunConfig:
    model: ApertusConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerSettings
    checkpoint: CheckpointConfig
    data: DataConfig
    logging: LoggingConfig


def _optimizer_config(settings: OptimizerSettings, precision: str) -> OptimizerConfig:
    if settings.optimizer != "adam":
        raise ConfigError(f"--optimizer {settings.optimizer!r} is not supported; use adam")
    return OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=dtype_from_name(precision),
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )


def _iterators(stream: np.ndarray, cfg: RunConfig, n_chunks: int, start_step: int = 0) -> list:
    t = cfg.training
    kwargs = dict(
        seq_length=cfg.model.seq_length,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        start_step=start_step,
    )
    return [micro_batches(stream, **kwargs) for _ in range(n_chunks)]


def evaluate(model, stream: np.ndarray, cfg: RunConfig) -> float | None:
    """Mean validation loss per token over ``eval_iters`` global batches (last stage only)."""
    if cfg.training.eval_iters == 0:
        return None
    for chunk in model:
        chunk.eval()
    dp = parallel_state.get_data_parallel_world_size()
    iterators = _iterators(stream, cfg, len(model))
    sums = []
    with torch.no_grad():
        for _ in range(cfg.training.eval_iters):
            losses = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators[0] if len(model) == 1 else iterators,
                model=model,
                num_microbatches=cfg.training.num_microbatches(dp),
                seq_length=cfg.model.seq_length,
                micro_batch_size=cfg.training.micro_batch_size,
                forward_only=True,
            )
            sums.extend(entry["lm loss"] for entry in losses)
    for chunk in model:
        chunk.train()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    total = torch.stack(sums).double().sum(0)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1]).item()


def _log_line(
    iteration: int, cfg: RunConfig, loss: float, grad_norm, lr: float, tok_s: float
) -> str:
    consumed = iteration * cfg.training.global_batch_size
    norm = "n/a" if grad_norm is None else f"{grad_norm:.4f}"
    return (
        f"iteration {iteration:6d}/{cfg.training.train_iters} | consumed samples {consumed} | "
        f"lr {lr:.3e} | lm loss {loss:.5f} | grad norm {norm} | tokens/s/device {tok_s:.0f}"
    )


def train(cfg: RunConfig) -> dict:
    """Run training as configured; returns the logged history (losses on the last stage)."""
    device = parallel.resolve_device(cfg.training.device)
    dp = parallel.initialize(cfg.parallel, device=device, seed=cfg.training.seed, model=cfg.model)
    num_micro = cfg.training.num_microbatches(dp)
    tokenizer = load_tokenizer(cfg.data.tokenizer_model)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"--vocab-size ({cfg.model.vocab_size}) differs from the tokenizer's ({tokenizer.vocab_size})"
        )
    train_stream, valid_stream = train_valid_streams(tokenizer)

    tconfig = transformer_config(
        cfg.model,
        cfg.parallel,
        params_dtype=dtype_from_name(cfg.training.precision),
        use_cpu_initialization=device == "cpu",
    )
    chunks = build_model(cfg.model, tconfig)
    if cfg.checkpoint.load:
        checkpoint.load_model(cfg.checkpoint.load, chunks)
    if tconfig.bf16 or tconfig.fp16:
        # Low-precision compute, fp32 loss: megatron-core's standard wrapper.
        chunks = [Float16Module(tconfig, chunk) for chunk in chunks]
    model = wrap_ddp(
        chunks, tconfig, use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer
    )
    optimizer = build_optimizer(model, _optimizer_config(cfg.optimizer, cfg.training.precision))
    iterators = _iterators(train_stream, cfg, len(model))

    history: dict = {"iteration": [], "loss": [], "grad_norm": []}
    tokens_per_step = cfg.training.global_batch_size * cfg.model.seq_length
    world = torch.distributed.get_world_size()
    if cfg.training.eval_interval:
        _report_validation(model, valid_stream, cfg, 0, history)
    for iteration in range(1, cfg.training.train_iters + 1):
        start = time.perf_counter()
        result = train_step(
            model,
            optimizer,
            iterators,
            num_microbatches=num_micro,
            seq_length=cfg.model.seq_length,
            micro_batch_size=cfg.training.micro_batch_size,
        )
        elapsed = time.perf_counter() - start
        if result.loss is not None:
            if not math.isfinite(result.loss):
                raise FloatingPointError(f"iteration {iteration}: loss is {result.loss}")
            history["iteration"].append(iteration)
            history["loss"].append(result.loss)
            history["grad_norm"].append(result.grad_norm)
            if _is_reporting_rank() and (
                iteration % cfg.training.log_interval == 0 or iteration == 1
            ):
                lr = optimizer.param_groups[0]["lr"]
                log.info(
                    _log_line(
                        iteration,
                        cfg,
                        result.loss,
                        result.grad_norm,
                        lr,
                        tokens_per_step / elapsed / world,
                    )
                )
        if (
            cfg.checkpoint.save
            and cfg.checkpoint.save_interval
            and iteration % cfg.checkpoint.save_interval == 0
        ):
            checkpoint.save_model(
                cfg.checkpoint.save, iteration, [m.module for m in model], cfg.model
            )
        if cfg.training.eval_interval and iteration % cfg.training.eval_interval == 0:
            _report_validation(model, valid_stream, cfg, iteration, history)

    last = cfg.training.train_iters
    if not (cfg.training.eval_interval and last % cfg.training.eval_interval == 0 and last > 0):
        _report_validation(model, valid_stream, cfg, last, history)
    if cfg.checkpoint.save:
        checkpoint.save_model(
            cfg.checkpoint.save, cfg.training.train_iters, [m.module for m in model], cfg.model
        )
    if cfg.logging.log_json and _is_reporting_rank():
        Path(cfg.logging.log_json).write_text(json.dumps(history, indent=1))
    parallel.shutdown()
    return history


def _is_reporting_rank() -> bool:
    """The one rank that holds the loss and writes reports: last stage, first TP and DP rank."""
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def _report_validation(model, stream, cfg: RunConfig, iteration: int, history: dict) -> None:
    loss = evaluate(model, stream, cfg)
    if loss is not None:
        history.setdefault("validation", []).append({"iteration": iteration, "loss": loss})
    if loss is not None and _is_reporting_rank():
        log.info(
            f"validation at iteration {iteration} | lm loss {loss:.5f} | ppl {math.exp(min(loss, 50)):.2f}"
        )
