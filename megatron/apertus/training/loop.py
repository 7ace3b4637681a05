"""The training loop: build, (load), step, log, evaluate, save. Reads like torchtitan's train()."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron.apertus import parallel
from megatron.apertus.data.batches import BatchConfig, micro_batches
from megatron.apertus.data.datasets import DatasetConfig, build_datasets
from megatron.apertus.data.goldfish import GoldfishConfig
from megatron.apertus.data.tokenizer import Tokenizer, build_tokenizer
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
from megatron.apertus.training.step import (
    StepShape,
    build_optimizer,
    forward_step,
    train_step,
    wrap_ddp,
)

log = logging.getLogger("apertus")


@dataclass(kw_only=True)
class RunConfig:
    model: ApertusConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerSettings
    checkpoint: CheckpointConfig
    data: DataConfig
    dataset: DatasetConfig
    goldfish: GoldfishConfig
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


def _tokenizer(cfg: RunConfig) -> Tokenizer:
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"--vocab-size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})"
        )
    return tokenizer


def _num_evaluations(training: TrainingConfig) -> int:
    if not training.eval_interval:
        return 1
    return training.train_iters // training.eval_interval + 2  # + step 0 and the end


def _datasets(cfg: RunConfig, tokenizer: Tokenizer):
    t = cfg.training
    num_samples = (
        t.train_iters * t.global_batch_size,
        _num_evaluations(t) * t.eval_iters * t.global_batch_size,
        0,
    )
    train, valid, _ = build_datasets(
        cfg.dataset,
        tokenizer,
        seq_length=cfg.model.seq_length,
        seed=t.seed,
        num_samples=num_samples,
    )
    return train, valid


def _iterators(dataset, cfg: RunConfig, batch: BatchConfig, n_chunks: int) -> list:
    """One micro-batch iterator per model chunk (interleaved schedules consume them apart)."""
    kwargs = dict(
        global_batch_size=cfg.training.global_batch_size,
        micro_batch_size=cfg.training.micro_batch_size,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )
    return [micro_batches(dataset, batch, **kwargs) for _ in range(n_chunks)]


def evaluate(model, dataset, cfg: RunConfig, batch: BatchConfig, shape: StepShape) -> float | None:
    """Mean validation loss per token over ``eval_iters`` global batches (last stage only)."""
    if cfg.training.eval_iters == 0 or dataset is None:
        return None
    for chunk in model:
        chunk.eval()
    iterators = _iterators(dataset, cfg, batch, len(model))
    sums = []
    with torch.no_grad():
        for _ in range(cfg.training.eval_iters):
            losses = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators[0] if len(model) == 1 else iterators,
                model=model,
                num_microbatches=shape.num_microbatches,
                seq_length=shape.seq_length,
                micro_batch_size=shape.micro_batch_size,
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


def _is_reporting_rank() -> bool:
    """The one rank that holds the loss and writes reports: last stage, first TP and DP rank."""
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def _log_step(iteration: int, cfg: RunConfig, result, lr: float, tokens_per_s: float) -> None:
    norm = "n/a" if result.grad_norm is None else f"{result.grad_norm:.4f}"
    line = (
        f"iteration {iteration:6d}/{cfg.training.train_iters} | "
        f"consumed samples {iteration * cfg.training.global_batch_size} | lr {lr:.3e} | "
        f"lm loss {result.loss:.5f} | grad norm {norm} | tokens/s/device {tokens_per_s:.0f}"
    )
    if result.goldfish_fraction is not None:
        line += f" | goldfish dropped {100 * result.goldfish_fraction:.2f}%"
    log.info(line)


def _validate(model, dataset, cfg, batch, shape, iteration: int, history: dict) -> None:
    loss = evaluate(model, dataset, cfg, batch, shape)
    if loss is None:
        return
    history.setdefault("validation", []).append({"iteration": iteration, "loss": loss})
    if _is_reporting_rank():
        log.info(
            f"validation at iteration {iteration} | lm loss {loss:.5f} | ppl {math.exp(min(loss, 50)):.2f}"
        )


def _build(cfg: RunConfig, device: str):
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
    return model, optimizer


def _save(cfg: RunConfig, iteration: int, model) -> None:
    checkpoint.save_model(cfg.checkpoint.save, iteration, [m.module for m in model], cfg.model)


def train(cfg: RunConfig) -> dict:
    """Run training as configured; returns the logged history (losses on the last stage)."""
    device = parallel.resolve_device(cfg.training.device)
    dp = parallel.initialize(cfg.parallel, device=device, seed=cfg.training.seed, model=cfg.model)
    tokenizer = _tokenizer(cfg)
    train_data, valid_data = _datasets(cfg, tokenizer)
    batch = BatchConfig(
        eod=tokenizer.eod,
        pack_documents=cfg.dataset.reset_attention_mask,
        goldfish=cfg.goldfish if cfg.data.goldfish_loss else None,
    )
    shape = StepShape.of(cfg.training, cfg.model.seq_length, dp, packed=batch.pack_documents)
    model, optimizer = _build(cfg, device)
    iterators = _iterators(train_data, cfg, batch, len(model))

    history: dict = {"iteration": [], "loss": [], "grad_norm": []}
    tokens_per_step = cfg.training.global_batch_size * cfg.model.seq_length
    world = torch.distributed.get_world_size()
    t = cfg.training
    if t.eval_interval:
        _validate(model, valid_data, cfg, batch, shape, 0, history)
    for iteration in range(1, t.train_iters + 1):
        start = time.perf_counter()
        result = train_step(model, optimizer, iterators, shape)
        elapsed = time.perf_counter() - start
        if result.loss is not None:
            if not math.isfinite(result.loss):
                raise FloatingPointError(f"iteration {iteration}: loss is {result.loss}")
            history["iteration"].append(iteration)
            history["loss"].append(result.loss)
            history["grad_norm"].append(result.grad_norm)
            if result.goldfish_fraction is not None:
                history.setdefault("goldfish_fraction", []).append(result.goldfish_fraction)
            if _is_reporting_rank() and (iteration % t.log_interval == 0 or iteration == 1):
                lr = optimizer.param_groups[0]["lr"]
                _log_step(iteration, cfg, result, lr, tokens_per_step / elapsed / world)
        if cfg.checkpoint.save and cfg.checkpoint.save_interval:
            if iteration % cfg.checkpoint.save_interval == 0:
                _save(cfg, iteration, model)
        if t.eval_interval and iteration % t.eval_interval == 0:
            _validate(model, valid_data, cfg, batch, shape, iteration, history)

    if not (t.eval_interval and t.train_iters % t.eval_interval == 0 and t.train_iters > 0):
        _validate(model, valid_data, cfg, batch, shape, t.train_iters, history)
    if cfg.checkpoint.save:
        _save(cfg, t.train_iters, model)
    if cfg.logging.log_json and _is_reporting_rank():
        Path(cfg.logging.log_json).write_text(json.dumps(history, indent=1))
    parallel.shutdown()
    return history
