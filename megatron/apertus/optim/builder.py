"""The optimizer over DDP-wrapped model chunks: megatron-core's Adam, or AdEMAMix in its wrappers.

megatron-core 0.16.1's ``get_megatron_optimizer`` knows adam and sgd only and has no hook for
another inner optimizer, so for AdEMAMix we repeat its dense-model path with megatron-core's own
pieces: the same param groups (``_get_param_groups_and_buffers``: weight decay off for every 1-D
parameter and every bias, i.e. norms, QK-norms and xIELU's shape-[1] ``alpha_p``/``alpha_n``; with
``--apply-wd-to-qk-layernorm`` megatron-core's rule decays the QK-norms' weights),
the same process groups, and the same wrappers (``FP32Optimizer``,
``Float16OptimizerWithFloat16Params``, or the distributed optimizer, here
:class:`AdEMAMixDistributedOptimizer`), returned in a ``ChainedOptimizer`` as megatron-core does.

In both cases each group's ``weight_decay`` is set to ``weight_decay * wd_mult`` at once:
megatron-core leaves that to the first step of ``OptimizerParamScheduler``, so without a scheduler
its Adam decays norms too.

``--decoupled-lr`` (Megatron-LM's): the parameters megatron-core marks
``is_embedding_or_output_parameter`` (the input embedding on the first pipeline stage, the output
layer on the last) form a param group of their own whose ``max_lr``/``min_lr`` the scheduler
follows instead of ``--lr``/``--min-lr``; megatron-core's ``get_standard_config_overrides`` makes
that group for Adam and for AdEMAMix alike. The group is then marked ``is_decoupled_lr``
(:func:`_mark_decoupled_groups`).

megatron-core and torch are imported by the functions that build: :class:`OptimizerSettings`
and :class:`AdEMAMixSettings` serve ``--help``, which must not pay for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, require, switch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.apertus.optim.ademamix import AdEMAMix


@dataclass(kw_only=True, frozen=True)
class OptimizerSettings:
    """The optimizer; its schedule is ``optim.ScheduleConfig``, AdEMAMix's own knobs
    ``optim.AdEMAMixSettings`` (flags ``--ademamix-*``)."""

    optimizer: str = flag_help("adam or ademamix", "adam")
    lr: float = flag_help("peak learning rate", 1e-3)
    min_lr: float = flag_help("learning rate at the end of the decay", 0.0)
    weight_decay: float = flag_help(
        "decoupled weight decay, throughout with --weight-decay-incr-style constant (never on "
        "norms, biases, xIELU alphas; the QK-norm weights with --apply-wd-to-qk-layernorm)",
        0.1,
    )
    apply_wd_to_qk_layernorm: bool = switch(
        "decay the query and key RMSNorm weights too (Qwen3-Next's rule; every other 1-D "
        "parameter and bias stays undecayed)"
    )
    no_weight_decay_cond_type: Optional[Literal["apply_wd_to_qk_layernorm"]] = flag_help(
        "Megatron-LM's deprecated spelling of --apply-wd-to-qk-layernorm", None
    )
    adam_beta1: float = flag_help("first-moment decay", 0.9)
    adam_beta2: float = flag_help("second-moment decay", 0.95)
    adam_eps: float = flag_help("denominator epsilon", 1e-8)
    clip_grad: float = flag_help("global gradient-norm clip (0: off)", 1.0)
    decoupled_lr: Optional[float] = flag_help(
        "peak learning rate of the input embedding and the output layer (default: --lr)", None
    )
    decoupled_min_lr: Optional[float] = flag_help(
        "with --decoupled-lr: their learning rate at the end of the decay (default: --min-lr)",
        None,
    )
    use_distributed_optimizer: bool = flag_help(
        "shard optimizer state over data-parallel ranks", False
    )
    loss_scale: Optional[float] = flag_help(
        "static loss scale of --fp16 and --bf16 runs (a power of 2 helps fp16 converge); "
        "default: dynamic scaling under --fp16, none under --bf16",
        None,
    )
    initial_loss_scale: float = flag_help("--fp16's dynamic loss scale to start from", 2.0**32)
    min_loss_scale: float = flag_help("--fp16's dynamic loss scale never drops below this", 1.0)
    loss_scale_window: float = flag_help(
        "--fp16's dynamic loss scale doubles after this many steps without an overflow", 1000
    )
    hysteresis: int = flag_help(
        "--fp16's dynamic loss scale halves after this many overflowing steps", 2
    )

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "ademamix"):
            raise ConfigError(f"--optimizer must be adam or ademamix, got {self.optimizer!r}")
        for flag, value in (
            ("--lr", self.lr),
            ("--min-lr", self.min_lr),
            ("--weight-decay", self.weight_decay),
            ("--clip-grad", self.clip_grad),
        ):
            require(math.isfinite(value) and value >= 0, flag, value, "a finite number >= 0")
        self._check_decoupled()
        self._check_loss_scale()
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            require(0 <= value < 1, flag, value, "in [0, 1)")
        require(
            math.isfinite(self.adam_eps) and self.adam_eps > 0,
            "--adam-eps",
            self.adam_eps,
            "a finite number > 0",
        )

    @property
    def decays_qk_layernorm(self) -> bool:
        """Whether the QK-norm weights are decayed (either spelling)."""
        return self.apply_wd_to_qk_layernorm or self.no_weight_decay_cond_type is not None

    def _check_loss_scale(self) -> None:
        """Scales are positive finite numbers (megatron-core divides the gradients by them)."""
        for flag, value in (
            ("--loss-scale", self.loss_scale),
            ("--initial-loss-scale", self.initial_loss_scale),
            ("--min-loss-scale", self.min_loss_scale),
            ("--loss-scale-window", self.loss_scale_window),
        ):
            ok = value is None or (math.isfinite(value) and value > 0)
            require(ok, flag, value, "a finite number > 0")
        require(self.hysteresis >= 1, "--hysteresis", self.hysteresis, ">= 1")
        require(
            self.min_loss_scale <= self.initial_loss_scale,
            "--min-loss-scale",
            self.min_loss_scale,
            f"<= --initial-loss-scale {self.initial_loss_scale}",
        )

    def _check_decoupled(self) -> None:
        """The decoupled rates are learning rates like --lr and --min-lr; a minimum without
        --decoupled-lr would change nothing (megatron-core ignores it), so it is refused."""
        lr, min_lr = self.decoupled_lr, self.decoupled_min_lr
        if lr is None:
            if min_lr is not None:
                raise ConfigError("--decoupled-min-lr needs --decoupled-lr")
            return
        for flag, value in (("--decoupled-lr", lr), ("--decoupled-min-lr", min_lr)):
            require(value is None or (math.isfinite(value) and value >= 0), flag, value, ">= 0")
        floor, named = (
            (self.min_lr, "--min-lr") if min_lr is None else (min_lr, "--decoupled-min-lr")
        )
        require(lr >= floor, "--decoupled-lr", lr, f">= {named} {floor}")


@dataclass(kw_only=True, frozen=True)
class AdEMAMixSettings:
    """AdEMAMix's own hyperparameters; lr, b1, b2, eps and weight decay come from OptimizerConfig
    (``lr``, ``adam_beta1``, ``adam_beta2``, ``adam_eps``, ``weight_decay``).

    Field names are those of the Apertus fork's flags without their ``ademamix_`` prefix
    (``--ademamix-alpha`` ...). Defaults are the Apertus recipe (docs/recipe.md).
    """

    alpha: float = flag_help("weight of the slow EMA in the update (Apertus: 8)", 8.0)
    beta3: float = flag_help("decay of the slow EMA (Apertus: 0.9999)", 0.9999)
    alpha_warmup: int = flag_help("steps over which alpha rises linearly from 0 (0: none)", 100_000)
    beta3_warmup: int = flag_help(
        "steps over which beta3's half-life grows from beta1's (0: none)", 100_000
    )

    def __post_init__(self) -> None:
        if self.alpha < 0:
            raise ValueError(f"--ademamix-alpha must be >= 0, got {self.alpha}")
        if not 0.0 <= self.beta3 < 1.0:
            raise ValueError(f"--ademamix-beta3 must be in [0, 1), got {self.beta3}")
        for name in ("alpha_warmup", "beta3_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"--ademamix-{name.replace('_', '-')} must be >= 0")


def get_apertus_optimizer(
    config: OptimizerConfig, model_chunks: list, ademamix: AdEMAMixSettings | None = None
) -> MegatronOptimizer:
    """megatron-core's optimizer for ``config.optimizer`` "adam" (or "sgd"); AdEMAMix, wrapped
    as megatron-core wraps Adam, for "ademamix" (``ademamix`` defaults to the Apertus recipe).

    ``model_chunks`` are megatron-core ``DistributedDataParallel`` modules. Collective: every rank
    calls it.
    """
    from megatron.core.optimizer import get_megatron_optimizer

    groups = _model_groups(model_chunks)
    if config.optimizer == "ademamix":
        optimizer = _ademamix_optimizer(
            config, model_chunks, ademamix or AdEMAMixSettings(), groups
        )
    elif ademamix is not None:
        raise ValueError(f"AdEMAMix settings were given but the optimizer is {config.optimizer!r}")
    else:
        optimizer = get_megatron_optimizer(
            config, model_chunks, use_gloo_process_groups=False, pg_collection=groups
        )
    for group in optimizer.param_groups:
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
    _mark_decoupled_groups(optimizer)
    return optimizer


def _mark_decoupled_groups(optimizer: MegatronOptimizer) -> None:
    """Set ``is_decoupled_lr`` on the groups of ``--decoupled-lr`` (those whose lr is not the
    default schedule's: megatron-core's ``default_config`` False).

    megatron-core 0.16.1 makes these groups but leaves ``is_decoupled_lr`` False, and a
    checkpoint load matches param groups by (``wd_mult``, ``lr_mult``, ``is_expert_parallel``,
    ``is_decoupled_lr``) only: the decoupled group and the main decayed group then share a key,
    and on load one group's settings (``max_lr``, ``min_lr``) overwrite the other's, so a resumed
    run would train the body at the decoupled rate. Later megatron-core releases add the
    overrides to that key."""
    for group in optimizer.param_groups:
        group["is_decoupled_lr"] = not group["default_config"]


def _model_groups(model_chunks: list) -> ProcessGroupCollection:
    """The process groups the model chunks were built with (megatron-core's
    ``ProcessGroupCollection``), for the optimizer's own reductions and parameter gathers.

    Given a collection, megatron-core's optimizer helpers take no gloo groups: those serve only
    the memory-efficient ``fully_reshardable`` and the ``dp_zero_gather_scatter`` checkpoint
    formats, which checkpoints here do not use."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model_chunks[0], "pg_collection", allow_none=False)


def _check_supported(config: OptimizerConfig, model_chunks: list) -> None:
    """Refuse the megatron-core features the AdEMAMix path does not reproduce."""
    unsupported = {
        "optimizer_cpu_offload": config.optimizer_cpu_offload,
        "use_precision_aware_optimizer": config.use_precision_aware_optimizer,
        "overlap_param_gather_with_optimizer_step": config.overlap_param_gather_with_optimizer_step,
        "use_megatron_fsdp": model_chunks[0].ddp_config.use_megatron_fsdp,
        "expert-parallel parameters": any(
            not getattr(p, "allreduce", True) for chunk in model_chunks for p in chunk.parameters()
        ),
    }
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise ValueError(f"--optimizer ademamix does not support {', '.join(used)}")


def _grad_scaler(config: OptimizerConfig):
    """megatron-core's choice: a constant scale if given, dynamic for fp16, none otherwise."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def _init_state(optimizer: AdEMAMix, config: OptimizerConfig | None = None) -> None:
    """megatron-core's ``init_state_fn`` hook: allocate state before a checkpoint is loaded."""
    optimizer.initialize_state()


def _ademamix_optimizer(
    config: OptimizerConfig,
    model_chunks: list,
    settings: AdEMAMixSettings,
    model_groups: ProcessGroupCollection,
) -> MegatronOptimizer:
    from megatron.core.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
        _get_param_groups_and_buffers,
        get_standard_config_overrides,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_pg_rank, get_pg_size

    from megatron.apertus.optim.ademamix import AdEMAMix
    from megatron.apertus.optim.distrib_optimizer import AdEMAMixDistributedOptimizer

    _check_supported(config, model_chunks)
    groups = ProcessGroupCollection.setup_process_groups_for_optimizer(
        model_groups, model_chunks, use_gloo_process_groups=False
    )
    param_groups, buffers = _get_param_groups_and_buffers(
        model_chunks,
        model_chunk_offset=0,
        config=config,
        # megatron-core's defaults (no decay on norms, biases, xIELU's scalars), which 0.16.1
        # applies in the helper itself and 0.19 only in get_megatron_optimizer.
        config_overrides=get_standard_config_overrides(config),
        filter_fn=lambda g: not g["is_expert_parallel"],
        buffer_name="buffers",
    )
    inner = AdEMAMix(
        param_groups,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2, settings.beta3),
        alpha=settings.alpha,
        alpha_warmup=settings.alpha_warmup,
        beta3_warmup=settings.beta3_warmup,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    if config.use_distributed_optimizer:
        multiple_instances = get_pg_size(groups["dp_cp_group"]) > get_pg_size(
            groups["intra_dp_cp_group"]
        )
        optimizer = AdEMAMixDistributedOptimizer(
            inner,
            config,
            _grad_scaler(config),
            _init_state,
            model_chunks=model_chunks,
            per_model_buffers=buffers,
            data_parallel_group=groups["intra_dp_cp_group"],
            data_parallel_group_gloo=groups["intra_dp_cp_group_gloo"],
            data_parallel_group_idx=get_pg_rank(groups["mp_group"]),
            distributed_optimizer_instance_id=(
                get_pg_rank(groups["inter_dist_opt_group"]) if multiple_instances else 0
            ),
        )
        optimizer.grad_stats_parallel_group = groups["intra_dist_opt_group"]
    elif config.fp16 or config.bf16:
        optimizer = Float16OptimizerWithFloat16Params(
            inner, config, _grad_scaler(config), _init_state
        )
        optimizer.grad_stats_parallel_group = groups["mp_group"]
    else:
        optimizer = FP32Optimizer(inner, config, _init_state)
        optimizer.grad_stats_parallel_group = groups["mp_group"]
    optimizer.tp_group = model_groups.tp
    return ChainedOptimizer([optimizer])
