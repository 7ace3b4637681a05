"""The launchers without a cluster: every script parses and passes the planner, refusals come
before sbatch, and the batch step's decisions on real save directories. The same code runs on
a real Slurm cluster in tests/slurm."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron.apertus.checkpoint_files import TRACKER, unfinished_checkpoints
from megatron.apertus.errors import ConfigError
from megatron.apertus.launch import slurm
from megatron.apertus.launch.submit import check, resources, sbatch_directives, submit
from tests.conftest import REPO

SLURM_DIR = REPO / "examples" / "slurm"
SCRIPTS = sorted(SLURM_DIR.glob("*.sbatch"))
SETTINGS = {  # what a user exports before submitting the real runs
    "APERTUS_DATA": "0.7 /data/web_text_document 0.3 /data/code_text_document",
    "APERTUS_TEACHER_CHECKPOINT": "/checkpoints/apertus-8b",
    "APERTUS_LOGITS_DIR": "/data/teacher-logits",
    "APERTUS_PRETRAINED_CHECKPOINT": "/checkpoints/apertus-8b",
    "APERTUS_LONG_CONTEXT_DATA_8K": "0.7 /data/stage5_8k 0.2 /data/fineweb_long_8k 0.1 /data/books_8k",
}


@pytest.mark.parametrize("path", SCRIPTS + sorted(SLURM_DIR.glob("*.sh")), ids=lambda p: p.name)
def test_scripts_are_valid_bash(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_launcher_passes_the_planner(script, tmp_path):
    env = dict(
        SETTINGS, APERTUS_REPO=str(REPO), APERTUS_RUN_DIR=str(tmp_path), PATH="/usr/bin:/bin"
    )
    result, shape, recorded = check(script, [], env, gpu_memory_gib=None, usable_fraction=0.9)
    assert result.ok, result.problems
    stage = "8k" if script.stem.startswith("long_context") else ""  # one run directory per stage
    assert recorded["run_dir"] == str(tmp_path / stage if stage else tmp_path)
    assert shape.tasks == {
        "pretrain_apertus_8b": 1024,
        "pretrain_apertus_70b": 4096,
        "long_context_apertus_8b": 2048,
        "long_context_apertus_70b": 2048,
    }.get(script.stem, shape.tasks)


PRETRAINING = [s for s in SCRIPTS if s.stem.startswith(("pretrain_", "long_context_"))]


@pytest.mark.parametrize("script", PRETRAINING, ids=lambda p: p.name)
def test_fp8_launches_are_guarded_and_pass_the_planner(script, tmp_path):
    """APERTUS_FP8=1: FP8 with the guard switching alarmed layers to bf16; without it, neither."""
    env = dict(
        SETTINGS, APERTUS_REPO=str(REPO), APERTUS_RUN_DIR=str(tmp_path), PATH="/usr/bin:/bin"
    )
    for fp8 in ("1", "0"):
        result, _, recorded = check(
            script, [], dict(env, APERTUS_FP8=fp8), gpu_memory_gib=None, usable_fraction=0.9
        )
        assert result.ok, result.problems
        command = recorded["command"]
        guarded = "--fp8-guard" in command and "--fp8-format" in command
        assert guarded == (fp8 == "1"), command
        if guarded:
            action = command[command.index("--fp8-guard-action") + 1]
            assert action == "bf16-layers"


RECOMPUTE_FLAGS = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers")


def without_recomputation(command: list[str]) -> list[str]:
    """``command`` with its recomputation flags (each with its value) left out."""
    kept, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg in RECOMPUTE_FLAGS:
            skip = True
        else:
            kept.append(arg)
    return kept


@pytest.mark.parametrize("stage", ["8k", "16k", "32k", "64k"])
@pytest.mark.parametrize("model", ["8b", "70b"])
def test_long_context_stages_recompute_only_what_the_planner_needs(model, stage, tmp_path):
    """Each stage fits as launched, and recomputes activations only where the same layout
    without recomputation would not fit (recomputation costs a forward pass)."""
    from megatron.apertus.launch.planner import Cluster, plan, run_from_command

    for done in ("8k", "16k", "32k"):  # the stages before this one are finished
        tracker = tmp_path / done / "checkpoints" / TRACKER
        tracker.parent.mkdir(parents=True)
        tracker.write_text("1000000\n")
    env = dict(
        SETTINGS,
        APERTUS_REPO=str(REPO),
        APERTUS_RUN_DIR=str(tmp_path),
        PATH="/usr/bin:/bin",
        APERTUS_LONG_CONTEXT_STAGE=stage,
        **{f"APERTUS_LONG_CONTEXT_DATA_{stage.upper()}": "1 /data/long"},
    )
    script = SLURM_DIR / f"long_context_apertus_{model}.sbatch"
    launched, shape, recorded = check(script, [], env, gpu_memory_gib=None, usable_fraction=0.9)
    assert launched.ok, launched.problems
    bare = without_recomputation(recorded["command"])
    cluster = Cluster(
        gpus=shape.tasks,
        gpus_per_node=shape.tasks_per_node,
        gpu_memory_gib=recorded["gpu_memory_gib"],
        usable_fraction=0.9,
    )
    fits_without = plan(run_from_command(bare), cluster).ok
    recomputes = bare != recorded["command"]
    assert recomputes != fits_without, (
        f"{script.name} {stage}: recomputes={recomputes}, fits without recomputation="
        f"{fits_without}"
    )


def test_invalid_layout_is_refused_before_sbatch(monkeypatch, capsys, tmp_path):
    """300 nodes give DP 600, which does not divide the global batch. PATH holds no sbatch: a
    refusal that reached it would fail differently."""
    for key, value in SETTINGS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("APERTUS_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert submit(SLURM_DIR / "pretrain_apertus_8b.sbatch", ["--nodes=300"]) == 1
    out, err = capsys.readouterr()
    assert "--global-batch-size (2048) is not divisible by --micro-batch-size (4) x " in out
    assert "refused, nothing was queued" in err


def test_a_script_that_cannot_describe_its_run_is_refused(monkeypatch, capsys):
    monkeypatch.delenv("APERTUS_DATA", raising=False)
    assert submit(SLURM_DIR / "pretrain_apertus_70b.sbatch", [], plan_only=True) == 1
    assert "set APERTUS_DATA to a Megatron data blend" in capsys.readouterr().err


def test_job_shape_from_sbatch_lines_and_overrides():
    options = sbatch_directives(SLURM_DIR / "pretrain_apertus_70b.sbatch")
    assert "--nodes=1024" in options and "--signal=USR2@1800" in options
    shape = resources(options + ["--nodes=2", "-J", "short"])  # the command line wins
    assert (shape.tasks, shape.tasks_per_node, shape.job_name) == (8, 4, "short")
    with pytest.raises(ConfigError, match="one process per GPU"):
        resources(["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=4"])
    with pytest.raises(ConfigError, match="fixed number of nodes"):
        resources(["--nodes=2-4"])


def _save_dir(
    tmp_path: Path, tracker: int | None, dirs: list[str], name: str = "checkpoints"
) -> Path:
    save = tmp_path / name
    for name in dirs:
        (save / name).mkdir(parents=True)
    if tracker is not None:
        (save / TRACKER).write_text(f"{tracker}\n")
    return save


def test_unfinished_checkpoints_are_the_tmp_ones_and_those_newer_than_the_tracker(tmp_path):
    save = _save_dir(
        tmp_path,
        5,
        ["iter_0000002", "iter_0000005", "iter_0000006.tmp", "iter_0000007", "unrelated"],
    )
    assert [p.name for p in unfinished_checkpoints(save)] == ["iter_0000006.tmp", "iter_0000007"]
    run = slurm.Run(
        run_dir=tmp_path, command=["pretrain_gpt.py", "--save", str(save), "--train-iters", "10"]
    )
    assert slurm._prepare(run) is None
    assert sorted(p.name for p in save.iterdir()) == [
        "iter_0000002",
        "iter_0000005",
        TRACKER,
        "unrelated",
    ]


def test_non_persistent_checkpoints_count_as_progress_and_are_kept(tmp_path):
    """Under --non-persistent-ckpt-type global a restart resumes the newest of both trackers,
    so that is the run's progress; the start of a job removes what each tracker does not vouch
    for in its own directory and leaves the other's checkpoints alone. Without the flag the
    non-persistent folder is none of the launcher's business."""
    save = _save_dir(tmp_path, 4, ["iter_0000004", "iter_0000005"])
    frequent = _save_dir(
        save, 6, ["iter_0000006", "iter_0000007.tmp", "iter_0000008"], name="non_persistent"
    )
    command = ["pretrain_gpt.py", "--save", str(save), "--train-iters", "10"]
    plain = slurm.Run(run_dir=tmp_path, command=command)
    assert plain.latest() == 4 and plain.non_persistent_dir is None
    run = slurm.Run(run_dir=tmp_path, command=command + ["--non-persistent-ckpt-type", "global"])
    assert run.non_persistent_dir == frequent and run.latest() == 6
    assert slurm._prepare(run) is None
    assert sorted(p.name for p in save.iterdir()) == sorted(
        ["iter_0000004", "non_persistent", TRACKER]
    )
    assert sorted(p.name for p in frequent.iterdir()) == ["iter_0000006", TRACKER]
    assert slurm.flag_value(run.training_command(), "--load") == str(save)
    elsewhere = tmp_path / "elsewhere"
    moved = slurm.Run(
        run_dir=tmp_path,
        command=run.command + ["--non-persistent-global-ckpt-dir", str(elsewhere)],
    )
    assert moved.non_persistent_dir == elsewhere and moved.latest() == 4
    assert "already finished (iteration 6)" in slurm._prepare(
        slurm.Run(run_dir=tmp_path, command=run.command + ["--train-iters", "6"])
    )


def test_batch_step_skips_finished_runs_and_honours_the_exit_trigger(tmp_path):
    save = _save_dir(tmp_path, 10, ["iter_0000010"])
    run = slurm.Run(
        run_dir=tmp_path, command=["pretrain_gpt.py", "--save", str(save), "--train-iters", "10"]
    )
    assert "already finished (iteration 10)" in slurm._prepare(run)
    longer = slurm.Run(run_dir=tmp_path, command=run.command + ["--train-iters=20"])
    assert longer.target_iteration == 20 and slurm._prepare(longer) is None
    (tmp_path / "triggers" / "exit").touch()  # _prepare made the directory
    assert "exit exists: not starting" in slurm._prepare(longer)


def test_training_command_gets_the_launchers_contract(tmp_path):
    save = tmp_path / "checkpoints"
    command = ["pretrain_gpt.py", "--save", str(save), "--load", "/initial", "--train-iters", "9"]
    fresh = slurm.Run(run_dir=tmp_path, command=command).training_command()
    assert slurm.flag_value(fresh, "--load") == "/initial", "no checkpoint yet: the initial one"
    assert "--exit-signal-handler" in fresh
    assert slurm.flag_value(fresh, "--trigger-path") == str(tmp_path / "triggers")
    _save_dir(tmp_path, 4, ["iter_0000004"])
    resumed = slurm.Run(run_dir=tmp_path, command=command).training_command()
    assert slurm.flag_value(resumed, "--load") == str(save) and resumed.count("--load") == 1
    teacher = ["tools/generate_teacher_logits.py", "--load", "/teacher", "--topk", "256"]
    assert slurm.Run(run_dir=tmp_path, command=teacher).training_command() == teacher


def test_a_phase_started_with_finetune_resumes_its_own_state(tmp_path):
    """``--finetune --no-load-rng --load PREVIOUS`` takes the weights of another run once; after
    the first checkpoint of this run, restarts load everything of their own."""
    save = tmp_path / "checkpoints"
    command = [
        "pretrain_gpt.py",
        "--save",
        str(save),
        "--load",
        "/stage-8k",
        "--finetune",
        "--no-load-rng",
        "--no-load-optim",
        "--train-iters",
        "9",
    ]
    first = slurm.Run(run_dir=tmp_path, command=command).training_command()
    assert slurm.flag_value(first, "--load") == "/stage-8k"
    assert {"--finetune", "--no-load-rng", "--no-load-optim"} <= set(first)
    _save_dir(tmp_path, 4, ["iter_0000004"])
    resumed = slurm.Run(run_dir=tmp_path, command=command).training_command()
    assert slurm.flag_value(resumed, "--load") == str(save)
    assert not {"--finetune", "--no-load-rng", "--no-load-optim"} & set(resumed)
    assert slurm.flag_value(resumed, "--train-iters") == "9"


def test_container_runtimes(monkeypatch, tmp_path):
    repo, run_dir = Path("/repo"), tmp_path
    monkeypatch.delenv("APERTUS_CONTAINER_IMAGE", raising=False)
    assert slurm.container_prefix(repo, run_dir) == ([], [])
    monkeypatch.setenv("APERTUS_CONTAINER_IMAGE", "/images/apertus.sqsh")
    monkeypatch.setenv("APERTUS_CONTAINER_MOUNTS", "/data,/scratch:/scratch")
    options, prefix = slurm.container_prefix(repo, run_dir)
    assert (
        options[:2]
        == [
            "--container-image=/images/apertus.sqsh",
            f"--container-mounts=/repo:/repo,{run_dir}:{run_dir},/data:/data," "/scratch:/scratch",
        ]
        and prefix == []
    )
    monkeypatch.setenv("APERTUS_CONTAINER_RUNTIME", "apptainer")
    assert slurm.container_prefix(repo, run_dir) == (
        [],
        [
            "apptainer",
            "exec",
            "--nv",
            "--bind",
            f"/repo,{run_dir},/data,/scratch:/scratch",
            "/images/apertus.sqsh",
        ],
    )


def test_environment_snapshot_withholds_secrets():
    text = slurm.environment_text({"WANDB_API_KEY": "abc", "HF_TOKEN": "x", "NCCL_DEBUG": "WARN"})
    assert text == "HF_TOKEN=<withheld>\nNCCL_DEBUG=WARN\nWANDB_API_KEY=<withheld>\n"


def test_the_rendezvous_port_is_one_no_one_holds(monkeypatch):
    """The batch step runs on the rendezvous host and takes a port the operating system finds
    free there: a port another program holds (here: one this test holds) is never chosen, as a
    port derived from the job id could be. An exported ``MASTER_PORT`` is kept as given."""
    import socket

    job = slurm.Job(id="12624", name="x", nodelist="localhost")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    derived = 10000 + int(job.id) % 20000
    with socket.socket() as held:
        held.bind(("", derived))
        held.listen()
        ports = {job.master_port(socket.gethostname()) for _ in range(20)}
        assert derived not in ports
        for port in ports:
            with socket.socket() as probe:
                probe.bind(("", port))
    assert job.master_port("another-host") == derived
    monkeypatch.setenv("MASTER_PORT", "29123")
    assert job.master_port(socket.gethostname()) == 29123


def test_slurm_queries_outlast_a_dropped_connection(tmp_path):
    """A query whose client dies of SIGPIPE twice (slurmctld dropped the connection) answers on
    the third try; one that keeps failing raises with its exit status after the last try."""
    calls = tmp_path / "calls"
    flaky = tmp_path / "scontrol"
    flaky.write_text(
        "#!/bin/bash\n"
        f"echo x >> {calls}\n"
        f'[ "$(wc -l < {calls})" -ge 3 ] || kill -PIPE $$\n'
        "echo JobId=7 Command=/jobs/run.sbatch\n"
    )
    flaky.chmod(0o755)
    assert slurm.slurm_query([str(flaky), "show", "job", "7"]) == (
        "JobId=7 Command=/jobs/run.sbatch\n"
    )
    assert calls.read_text().count("x") == 3
    with pytest.raises(subprocess.CalledProcessError) as refused:
        slurm.slurm_query(["false"], attempts=2)
    assert refused.value.returncode == 1
