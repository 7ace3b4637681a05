"""The FP8 guard on an injected outlier: the alarm, the ``bf16-layers`` switch, and its cost.

    python bench/bench_fp8_guard.py --plot docs/fp8_guard_injected_outlier.png   # tiny, CPU
    python bench/bench_fp8_guard.py --device cuda --out DIR    # 0.5B, TE FP8 delayed scaling

From a chosen step on, one hidden channel of one layer's fc2 input carries 100x the input's RMS
(a forward pre-hook on that GEMM, ahead of the statistics' hooks; added, so training cannot
shrink it). Runs, each in its own process (``--child``):

* ``guard-off``: the injected run with the statistics logged and no guard (it goes on);
* ``bf16-layers``: the same run with ``--fp8-guard --fp8-guard-action bf16-layers``: the alarm,
  the layer switched out of FP8, the go-back to the last checkpoint before the alarm;
* ``from-checkpoint``: a run started from that checkpoint with ``--bf16-layers L`` (the outlier
  from the same step), whose losses the switched run must repeat;
* on a GPU, ``clean`` and ``clean-guard``: the model without outlier, without and with the guard
  measuring on every step (``--log-intermediate-metrics-interval 1``): the cost of one measured
  step, of which the default interval (10 steps) pays a tenth.

``--plot`` draws the first two (CPU, fp32: a layer's precision changes nothing there, so the
curves coincide and show the detection and the go-back, not FP8 numerics). ``--device cuda`` writes
``fp8_guard.json`` (alarm, decision, loss comparison, cost) under ``--out``: the GPU suite's
``fp8-guard`` stage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

OUTLIER_SIZE, OUTLIER_CHANNEL = 100.0, 7
RESULT_PREFIX = "GUARD_RESULT "
SMALL_TOKENIZER = REPO / "tests" / "fixtures" / "bpe4096" / "tokenizer.json"
TRUSTED_FP8_STATE = {"NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1"}
"""A new process loads a delayed-scaling checkpoint only with TE's switch (the run's own)."""
DEFAULT_INTERVAL = 10
"""``--log-intermediate-metrics-interval``'s default (``--log-interval``'s default)."""


@dataclass(frozen=True)
class Scenario:
    """One injected run: the model's flags, where and when the outlier appears, how often the
    run saves and measures, and the guard's kurtosis bound for the fc2 input's width."""

    flags: list[str]
    layer: int
    after: int
    """The last step without the outlier."""
    iterations: int
    save_interval: int
    interval: int
    kurtosis: float


def cpu_scenario() -> Scenario:
    """The tiny model on CPU (fc2 input 192 wide: kurtosis at most ~190): the outlier from
    step 5, measured at step 6, checkpoints every 3 steps."""
    flags = [
        *("--model-preset", "tiny", "--device", "cpu", "--lr", "3e-3", "--eval-iters", "1"),
        *("--global-batch-size", "4", "--micro-batch-size", "2", "--log-interval", "2"),
        *("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(SMALL_TOKENIZER)),
        *("--make-vocab-size-divisible-by", "128"),
    ]
    return Scenario(
        flags, layer=2, after=4, iterations=12, save_interval=3, interval=2, kurtosis=60
    )


def gpu_scenario() -> Scenario:
    """The 0.5B under TE, FP8 hybrid with delayed scaling, packed 4096-token samples: the outlier
    from step 11, measured at step 12, checkpoints every 8 steps; the default kurtosis bound."""
    import bench_train_step as bench

    model = "apertus-v1.1-0.5b"
    flags = bench.run_args(
        model,
        "te-fp8-delayed-packed",
        seq=4096,
        steps=24,
        micro=bench.MICRO_BATCH[model],
        global_batch=8,
        extra=["--lr", "6e-4", "--eval-iters", "1"],
    )
    flags = flags[: flags.index("--train-iters")] + flags[flags.index("--train-iters") + 2 :]
    return Scenario(
        flags, layer=3, after=10, iterations=24, save_interval=8, interval=4, kurtosis=500
    )


# -- the runs ------------------------------------------------------------------------------------


def injected_argv(s: Scenario, run: str, work: Path, decision: dict | None = None) -> list[str]:
    """``pretrain_gpt.py``'s flags of run ``run`` (``guard-off``, ``bf16-layers``,
    ``from-checkpoint``: from the checkpoint ``decision`` names, default the one the second
    run took)."""
    common = [*s.flags, "--log-intermediate-metrics-interval", str(s.interval)]
    common += ["--log-json", str(work / f"{run}.json"), "--train-iters", str(s.iterations)]
    if run == "guard-off":
        return [*common, "--log-intermediate-metrics", "kurtosis", "underflow", "overflow"]
    if run == "bf16-layers":
        guard = ["--fp8-guard", "--fp8-guard-action", "bf16-layers", "--fp8-guard-intervals", "1"]
        guard += ["--fp8-guard-kurtosis", str(s.kurtosis), "--save", str(work / "ckpt")]
        return [*common, *guard, "--save-interval", str(s.save_interval)]
    decision = decision or read_decision(work)
    load = work / "ckpt" / f"iter_{decision['resumed_from']:07d}"
    layers = [str(n) for n in decision["layers"]]
    return [*common, "--load", str(load), "--bf16-layers", *layers]


def expected_decision(s: Scenario) -> dict:
    """What the scenario is built for: the alarm at the first measurement that sees the
    outlier, the layer switched, back to the last checkpoint saved before it."""
    alarm = -(-(s.after + 1) // s.interval) * s.interval
    resumed = (alarm - 1) // s.save_interval * s.save_interval
    return {"iteration": alarm, "layers": [s.layer], "resumed_from": resumed}


def planned_trainer_argvs(s: Scenario, work: Path) -> list[list[str]]:
    """Every trainer command line a call starts (the from-checkpoint run's with the decision
    the scenario is built to take), for the GPU suite's dry run."""
    runs = ("guard-off", "bf16-layers", "from-checkpoint")
    argvs = [injected_argv(s, run, work, expected_decision(s)) for run in runs]
    return argvs + [timing_argv(s, guard) for guard in (False, True)]


def timing_argv(s: Scenario, guard: bool) -> list[str]:
    """The clean model, with the guard measuring on every step or without it."""
    measuring = ["--fp8-guard", "--log-intermediate-metrics-interval", "1"] if guard else []
    return [*s.flags, "--train-iters", "100", *measuring]


@contextlib.contextmanager
def injected(layer: int, after: int) -> Iterator[None]:
    """The outlier in layer ``layer``'s fc2 input in every step after step ``after`` (and the
    validation passes that follow them), the same in a timeline the guard went back on: the
    steps are told apart by the iteration the trainer measures them as."""
    from megatron.apertus.training.reporter import Reporter

    original, hooked, current = Reporter.gemm_inputs, False, [0]

    def add_outlier(module, args):
        if current[0] <= after:
            return None
        x = args[0].clone()
        x[..., OUTLIER_CHANNEL] += OUTLIER_SIZE * x.detach().float().pow(2).mean().sqrt()
        return (x, *args[1:])

    def tracking(reporter, iteration: int):
        nonlocal hooked
        current[0] = iteration
        if not hooked:  # ahead of the statistics' hooks, which attach per measured step
            for chunk in reporter.model:
                for module in chunk.modules():
                    if getattr(module, "layer_number", None) == layer and hasattr(module, "mlp"):
                        module.mlp.linear_fc2.register_forward_pre_hook(add_outlier)
            hooked = True
        return original(reporter, iteration)

    Reporter.gemm_inputs = tracking
    try:
        yield
    finally:
        Reporter.gemm_inputs = original


def child(spec: dict) -> dict:
    """One run in this process: trained to its end with the outlier, or timed step by step."""
    from pretrain_gpt import parse_args

    cfg = parse_args(spec["argv"])
    if spec.get("timed"):
        return timed_steps(cfg, *spec["timed"])
    from megatron.apertus.training.loop import train

    outlier = injected(*spec["outlier"]) if spec.get("outlier") else contextlib.nullcontext()
    start = time.perf_counter()
    with outlier:
        history = train(cfg)
    return {"completed": history.get("completed"), "wall_s": time.perf_counter() - start}


def timed_steps(cfg, warmup: int, steps: int) -> dict:
    """Median step time of a real Trainer, the guard's judgement of each step included."""
    import torch

    from megatron.apertus.training.loop import Trainer

    trainer = Trainer(cfg)
    seconds = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = trainer.step()
        trainer.fp8_guard.after_step(trainer.state.iteration, result, trainer.gemm_inputs)
        torch.cuda.synchronize()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return {"step_s_median": statistics.median(seconds), "step_s_min": min(seconds)}


def run_child(spec: dict, env: dict | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        errors="replace",
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    return {"error": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"}


def read_decision(work: Path) -> dict:
    from megatron.apertus.training.fp8_guard import DECISIONS_FILE

    return json.loads((work / "ckpt" / DECISIONS_FILE).read_text())[0]


def history(work: Path, run: str) -> dict:
    from megatron.apertus.training.metrics import read_history

    return read_history(work / f"{run}.json")


# -- what a call reports -------------------------------------------------------------------------


def injected_runs(s: Scenario, work: Path, env: dict | None = None) -> dict:
    """The three injected runs and what they show: the alarm, the decision, and the switched
    run's losses against the run from its checkpoint (``env``: that run's environment)."""
    runs = {}
    for run in ("guard-off", "bf16-layers", "from-checkpoint"):
        spec = {"argv": injected_argv(s, run, work), "outlier": [s.layer, s.after]}
        runs[run] = run_child(spec, env if run == "from-checkpoint" else None)
        if "error" in runs[run]:
            return {"runs": runs}
    alarms = history(work, "bf16-layers").get(f"fp8_guard/layer{s.layer:03d}/fc2/kurtosis", [])
    decision = read_decision(work)
    switched = dict(history(work, "bf16-layers")["train/loss"])
    reference = dict(history(work, "from-checkpoint")["train/loss"])
    after = [it for it in sorted(reference) if it > decision["resumed_from"]]
    differences = [abs(switched[it] - reference[it]) for it in after]
    return {
        "runs": runs,
        "first_alarm": alarms[0] if alarms else None,
        "outlier_from_step": s.after + 1,
        "decision": decision,
        "decision_as_expected": all(decision[k] == v for k, v in expected_decision(s).items()),
        "losses_compared": len(after),
        "losses_bitwise_equal": sum(switched[it] == reference[it] for it in after),
        "loss_max_abs_difference": max(differences) if differences else None,
    }


def guard_cost(s: Scenario, warmup: int = 3, steps: int = 10) -> dict:
    """One measured step's cost (the guard on every step against no guard), and the cost at
    the default interval."""
    times = {
        name: run_child({"argv": timing_argv(s, guard), "timed": [warmup, steps]})
        for name, guard in (("clean", False), ("clean-guard", True))
    }
    if any("error" in t for t in times.values()):
        return {"timing": times}
    measured = times["clean-guard"]["step_s_median"] / times["clean"]["step_s_median"] - 1
    return {
        "timing": times,
        "measured_step_overhead": measured,
        f"overhead_at_interval_{DEFAULT_INTERVAL}": measured / DEFAULT_INTERVAL,
    }


# -- the plot ------------------------------------------------------------------------------------


def plot(work: Path, s: Scenario, path: Path) -> Path:
    """Kurtosis and e4m3 underflow share of the outlier layer's fc2 input (and the largest of
    the other GEMM inputs), and the loss, for the guarded and the unguarded run; the alarm and
    the go-back marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    off, on, decision = (
        history(work, "guard-off"),
        history(work, "bf16-layers"),
        read_decision(work),
    )
    key = f"intermediate/layer{s.layer:03d}/fc2"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("kurtosis", "GEMM-input kurtosis", "log"),
        ("underflow", "e4m3 underflow share", "linear"),
    )
    for ax, (statistic, title, scale) in zip(axes, panels):
        for h, label, style in ((off, "guard off", "--"), (on, "guard bf16-layers", "-")):
            ax.plot(
                *zip(*h[f"{key}/{statistic}"]),
                style,
                marker="o",
                label=f"layer {s.layer} fc2, {label}",
            )
        others = largest_of_others(on, s.layer, statistic)
        ax.plot(*zip(*others), ":", color="grey", label="largest other GEMM input, guard on")
        ax.set(xlabel="iteration", title=title, yscale=scale)
    axes[0].axhline(
        s.kurtosis, color="tab:red", lw=0.8, label=f"--fp8-guard-kurtosis {s.kurtosis:g}"
    )
    for h, label, style in ((off, "guard off", "--"), (on, "guard bf16-layers", "-")):
        axes[2].plot(*zip(*h["train/loss"]), style, label=label)
    axes[2].set(xlabel="iteration", title="training loss")
    for ax in axes:
        ax.axvline(s.after + 0.5, color="grey", lw=0.6)
        ax.axvline(decision["iteration"], color="tab:red", lw=1.2)
        ax.annotate(
            "",
            xy=(decision["resumed_from"], 0.12),
            xytext=(decision["iteration"], 0.12),
            xycoords=("data", "axes fraction"),
            arrowprops={"arrowstyle": "->", "color": "tab:red"},
        )
        ax.legend(fontsize=7)
    fig.suptitle(
        f"outlier injected from step {s.after + 1} (grey line); alarm at {decision['iteration']} "
        f"(red line); bf16-layers: layer {', '.join(map(str, decision['layers']))} in bf16, back "
        f"to the checkpoint of step {decision['resumed_from']} (arrow). Tiny model, CPU, fp32: "
        "precision changes nothing here, so the loss curves coincide",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def largest_of_others(h: dict, layer: int, statistic: str) -> list[tuple[int, float]]:
    """Per measured step, the largest ``statistic`` of every GEMM input but ``layer``'s fc2."""
    by_step: dict[int, float] = {}
    for name, points in h.items():
        parts = name.split("/")
        if len(parts) == 4 and parts[0] == "intermediate" and parts[3] == statistic:
            if (parts[1], parts[2]) != (f"layer{layer:03d}", "fc2"):
                for it, value in points:
                    by_step[it] = max(by_step.get(it, float("-inf")), value)
    return sorted(by_step.items())


# -- entry point ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=Path, help="the CPU runs, drawn to this PNG")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_fp8_guard"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        print(RESULT_PREFIX + json.dumps(child(json.loads(args.child))), flush=True)
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter's teardown of CUDA / process-group state
    import shutil

    from _common import device_tag, git_commit, machine

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    gpu = args.device == "cuda"
    s = gpu_scenario() if gpu else cpu_scenario()
    result = injected_runs(s, args.out, TRUSTED_FP8_STATE if gpu else None)
    if gpu and "decision" in result:
        result |= guard_cost(s)
    result |= {"device": device_tag(), "machine": machine(), "git_commit": git_commit()}
    (args.out / "fp8_guard.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    if args.plot and "decision" in result:
        print(f"wrote {plot(args.out, s, args.plot)}")
    return 0 if "decision" in result else 1


if __name__ == "__main__":
    sys.exit(main())
