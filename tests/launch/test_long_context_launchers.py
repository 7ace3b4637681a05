"""The long-context launchers (``examples/slurm/long_context_apertus_{8b,70b}.sbatch``): every
stage's dry-run record passes the planner on 512 GH200 nodes with the Apertus tech report's
layout (Table 5), its flags mean what the recipe says in ``pretrain_gpt.py``'s own parser, the
stages run in order, and a stage that has saved resumes itself instead of starting over."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pretrain_gpt
from megatron.apertus.checkpoint_files import TRACKER
from megatron.apertus.errors import ConfigError
from megatron.apertus.launch import slurm
from megatron.apertus.launch.submit import check
from tests.conftest import REPO

SLURM_DIR = REPO / "examples" / "slurm"
STAGES = ["8k", "16k", "32k", "64k"]
SEQ = {"8k": 8192, "16k": 16384, "32k": 32768, "64k": 65536}
ROTARY_BASE = {"8k": 1_000_000, "16k": 2_000_000, "32k": 4_000_000, "64k": 12_000_000}
# Table 5: (TP, PP, DP, CP) per stage; 2048 GPUs throughout.
TABLE_5 = {
    "8b": {
        "8k": (2, 1, 1024, 1),
        "16k": (4, 1, 512, 1),
        "32k": (4, 1, 256, 2),
        "64k": (4, 1, 128, 4),
    },
    "70b": {"8k": (4, 8, 64, 1), "16k": (4, 8, 32, 2), "32k": (4, 8, 16, 4), "64k": (4, 8, 8, 8)},
}
TOKENS_PER_STEP = {"8b": 8 * 2**20, "70b": 16 * 2**20}
LR = {"8b": 1.1e-5, "70b": 1e-6}


def script(model: str) -> Path:
    return SLURM_DIR / f"long_context_apertus_{model}.sbatch"


def finish(run_dir: Path, stage: str, iteration: int = 10**7) -> None:
    """A stage's checkpoint directory whose tracker says it reached ``iteration``."""
    checkpoints = run_dir / stage / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / TRACKER).write_text(f"{iteration}\n")


def environment(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        "APERTUS_REPO": str(REPO),
        "APERTUS_RUN_DIR": str(run_dir),
        "PATH": "/usr/bin:/bin",
        "APERTUS_PRETRAINED_CHECKPOINT": "/checkpoints/apertus-pretrained",
    }
    env.update(
        {
            f"APERTUS_LONG_CONTEXT_DATA_{s.upper()}": f"0.7 /data/stage5_{s} 0.2 "
            f"/data/fineweb_long_{s} 0.1 /data/books_{s}"
            for s in STAGES
        }
    )
    return env | extra


def plan_stage(model: str, stage: str, run_dir: Path):
    """The stage's plan and dry-run record, the stages before it finished."""
    for before in STAGES[: STAGES.index(stage)]:
        finish(run_dir, before)
    result, shape, recorded = check(
        script(model), [], environment(run_dir), gpu_memory_gib=None, usable_fraction=0.9
    )
    return result, shape, recorded


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("model", ["8b", "70b"])
def test_each_stage_passes_the_planner_with_the_published_layout(model, stage, tmp_path):
    result, shape, recorded = plan_stage(model, stage, tmp_path)
    assert result.ok, result.problems
    assert recorded["run_dir"] == str(tmp_path / stage), "the first unfinished stage runs"
    par = result.run.parallel
    layout = (
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        result.data_parallel,
        par.context_parallel_size,
    )
    assert (shape.tasks, layout) == (2048, TABLE_5[model][stage])
    t, m = result.run.training, result.run.model
    assert t.global_batch_size * m.seq_length == TOKENS_PER_STEP[model]
    assert (m.seq_length, m.max_position_embeddings, m.rotary_base) == (
        SEQ[stage],
        SEQ[stage],
        ROTARY_BASE[stage],
    )
    assert m.rope_scaling and m.rope_scaling_factor == 8, "llama3 scaling kept from pretraining"
    assert par.sequence_parallel and t.micro_batch_size == 1


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("model", ["8b", "70b"])
def test_stage_flags_mean_the_recipe_in_pretrain_gpt(model, stage, tmp_path):
    """Parsed by pretrain_gpt.py itself (CPU, local layers): the stage starts from the previous
    stage's checkpoint with weights only, a constant lr after 1.2B tokens of warmup (WSD
    without cooldown, Megatron-LM's meaning of --lr-wsd-decay-iters 0), the stage's own mixture,
    Goldfish and document masking as in pretraining."""
    _, _, recorded = plan_stage(model, stage, tmp_path)
    argv = recorded["command"][1:] + ["--device", "cpu", "--transformer-impl", "local"]
    cfg = pretrain_gpt.parse_args(argv)
    previous = STAGES[STAGES.index(stage) - 1] if stage != "8k" else None
    initial = (
        str(tmp_path / previous / "checkpoints") if previous else "/checkpoints/apertus-pretrained"
    )
    assert (cfg.checkpoint.load, cfg.checkpoint.finetune, cfg.checkpoint.no_load_rng) == (
        initial,
        True,
        True,
    )
    assert cfg.checkpoint.save == str(tmp_path / stage / "checkpoints")
    assert cfg.optimizer.lr == cfg.optimizer.min_lr == LR[model]
    assert (cfg.schedule.lr_decay_style, cfg.schedule.lr_wsd_decay_iters) == ("WSD", 0)
    warmup_tokens = cfg.schedule.lr_warmup_iters * cfg.training.global_batch_size * SEQ[stage]
    assert warmup_tokens == pytest.approx(1.2e9, rel=0.01)
    assert cfg.optimizer.optimizer == "ademamix" and cfg.data.goldfish_loss
    assert cfg.dataset.reset_attention_mask and cfg.dataset.reset_position_ids
    assert f"/data/fineweb_long_{stage}" in recorded["command"]


def test_stages_run_in_order_and_each_waits_for_the_one_before(tmp_path):
    env = environment(tmp_path)
    finish(tmp_path, "8k")
    finish(tmp_path, "16k", iteration=12)  # saved, not finished
    _, _, recorded = check(script("8b"), [], env, gpu_memory_gib=None, usable_fraction=0.9)
    assert recorded["run_dir"] == str(tmp_path / "16k")
    with pytest.raises(
        ConfigError,
        match="stage 32k starts from stage 16k, which has not reached " "its 6948 iterations",
    ):
        check(
            script("8b"),
            [],
            environment(tmp_path, APERTUS_LONG_CONTEXT_STAGE="32k"),
            gpu_memory_gib=None,
            usable_fraction=0.9,
        )
    with pytest.raises(ConfigError, match="APERTUS_LONG_CONTEXT_STAGE=128k: choose one of 8k 16k"):
        check(
            script("8b"),
            [],
            environment(tmp_path, APERTUS_LONG_CONTEXT_STAGE="128k"),
            gpu_memory_gib=None,
            usable_fraction=0.9,
        )
    missing = {k: v for k, v in env.items() if k != "APERTUS_LONG_CONTEXT_DATA_16K"}
    with pytest.raises(ConfigError, match="set APERTUS_LONG_CONTEXT_DATA_16K to the Megatron data"):
        check(script("8b"), [], missing, gpu_memory_gib=None, usable_fraction=0.9)
    for stage in STAGES:
        finish(tmp_path, stage)
    with pytest.raises(ConfigError, match="every long-context stage of .* is finished"):
        check(script("8b"), [], env, gpu_memory_gib=None, usable_fraction=0.9)


def test_a_stage_that_saved_resumes_its_own_checkpoint(tmp_path):
    """The job's command as the batch step runs it: --finetune from the previous stage until the
    stage has a checkpoint, then a plain resume of its own save directory."""
    finish(tmp_path, "8k")
    _, _, recorded = check(
        script("70b"), [], environment(tmp_path), gpu_memory_gib=None, usable_fraction=0.9
    )
    run = slurm.Run(run_dir=Path(recorded["run_dir"]), command=recorded["command"])
    first = run.training_command()
    assert slurm.flag_value(first, "--load") == str(tmp_path / "8k" / "checkpoints")
    assert "--finetune" in first and "--no-load-rng" in first
    finish(tmp_path, "16k", iteration=250)
    (tmp_path / "16k" / "checkpoints" / "iter_0000250").mkdir()
    resumed = run.training_command()
    assert slurm.flag_value(resumed, "--load") == str(tmp_path / "16k" / "checkpoints")
    assert "--finetune" not in resumed and "--no-load-rng" not in resumed


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("model", ["8b", "70b"])
def test_dry_run_plans_each_stage_for_slurms_task_count(
    model, stage, tmp_path, capsys, monkeypatch
):
    """``srun ... pretrain_gpt.py STAGE_FLAGS --dry-run`` on 512 nodes of 4 tasks: the layout
    plan, nothing read."""
    tp, pp, dp, cp = TABLE_5[model][stage]
    _, _, recorded = plan_stage(model, stage, tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2048")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x512)")
    argv = recorded["command"][1:] + ["--device", "cpu", "--transformer-impl", "local", "--dry-run"]
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.parse_args(argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    context = f" x CP {cp} (p2p)" if cp > 1 else ""
    assert f"TP {tp} x PP {pp} (virtual stages {5 if pp > 1 else 1}){context} x DP {dp}" in out
    assert "OK: the layout is valid" in out
    assert not (tmp_path / stage).exists(), "a dry run writes nothing"


STATED_MEMORY = re.compile(
    r"No recomputation: with Transformer\s+# Engine's layers the planner finds ([\d.]+) GiB per GPU "
    r"at every stage, of ([\d.]+) usable"
)
"""The reason the 70B launcher's header gives for training without recomputation."""


def test_the_70b_launchers_stated_reason_agrees_with_the_planner(tmp_path):
    """Its header's figures are the planner's, stage by stage: each stage's plan has no
    recomputation and peaks at the stated GiB (to the stated decimal) within the usable share of
    the 96 GB the launch plans for (``long_context.sh``: ``--gpu-memory-gib 96``)."""
    stated = STATED_MEMORY.search(script("70b").read_text())
    assert stated, "the header no longer states why the 70B stages run without recomputation"
    peak_gib, usable_gib = float(stated[1]), float(stated[2])
    assert "--gpu-memory-gib 96" in (SLURM_DIR / "long_context.sh").read_text()
    assert usable_gib == pytest.approx(96 * 0.9)
    for stage in STAGES:
        result, _, _ = plan_stage("70b", stage, tmp_path / stage)
        assert result.run.recompute.granularity is None, stage
        assert round(result.peak.total / 2**30, 1) == peak_gib, stage
        assert peak_gib < usable_gib
