"""The GPU suite (``bench/gpu_suite.py``) without a GPU: its dry run end to end, the 8B layer
count from the memory model, and the parsers it reads device output with (on recorded output)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_train_step as bench  # noqa: E402
import gpu_suite as suite  # noqa: E402

from megatron.apertus.launch.memory import fp8_weight_cache_bytes  # noqa: E402
from megatron.apertus.launch.planner import Cluster, plan, run_from_args  # noqa: E402
from megatron.apertus.ops.xielu import xielu  # noqa: E402

DEVICE_LOG = (REPO / "docs" / "device_runs" / "2026-11-24_h100_gpu_path.log").read_text()
RECORDED_TE_ROWS = REPO / "bench" / "results" / "train_step_te_NVIDIA-H100-80GB-HBM3.json"


@pytest.fixture
def run_suite(monkeypatch) -> Callable[..., str]:
    """``bench/gpu_suite.py ARGS`` through its ``main`` in this process, which has imported the
    benchmark, torch and megatron-core already (a fresh interpreter spends 7 s on them); its
    standard output returned, its exit code 0. The suite's setup puts its wheel folders in front
    of ``sys.path``: put back afterwards, so later tests import what they did before."""
    monkeypatch.setattr(sys, "path", list(sys.path))

    def run(*args: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = suite.main(list(args))
        assert code == 0, out.getvalue()[-8000:]
        return out.getvalue()

    return run


@pytest.mark.process  # the dry run starts pytest and two training runs
def test_dry_run_selects_builds_writes_and_plots(tmp_path, run_suite):
    tree, out = tmp_path / "tree", tmp_path / "out"
    done = tree / "bench" / "results" / "gpu_suite_fp8-resume_NVIDIA-H100-80GB-HBM3.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"stage": "fp8-resume", "status": "ok"}))

    stdout = run_suite("--dry-run", "--out", str(out), "--tree", str(tree))

    assert "fp8-resume: has results in the tree" in stdout
    assert "cuda-graphs: runs only when named" in stdout
    written = {p.stem for p in out.glob("*.json")}
    on_request = {s.name for s in suite.STAGES if s.on_request}
    assert on_request == {"cuda-graphs"}
    assert written == {s.name for s in suite.STAGES} - {"fp8-resume"} - on_request
    results = {name: json.loads((out / f"{name}.json").read_text()) for name in written}
    assert {r["status"] for r in results.values()} == {"dry"}
    assert all((out / f"{name}.log").stat().st_size > 0 for name in written)
    assert ".tebundle" in (out / "setup.log").read_text()
    # pytest collected the GPU tests, without the resume test (a stage of its own)
    assert results["pytest-gpu"]["pytest"]["collected"] > 50
    assert "resumes_exactly" not in (out / "pytest-gpu.log").read_text().split("--collect-only")[1]
    # the recorded device log's TE choice drives the train-step stages to PyTorch attention
    assert results["attention"]["backends"] == {"unlabelled": "UnfusedDotProductAttention"}
    planned = results["train-step-8b"]["planned"]
    assert len(planned) == 6
    layers = bench.layers_that_fit(4096)
    for argv in planned:
        assert argv[argv.index("--num-layers") + 1] == str(layers)
        assert argv[argv.index("--attention-backend") + 1] == "local"
    recipes = [argv[argv.index("--fp8-recipe") + 1] for argv in planned if "--fp8-recipe" in argv]
    assert sorted(recipes) == sorted(
        ["tensorwise", "delayed", "blockwise", "tensorwise", "blockwise"]
    )
    assert sum("--first-last-layers-bf16" in argv for argv in planned) == 2
    # the FP8 guard stage: the injected run under TE FP8 delayed scaling switches layers to bf16,
    # the run from its checkpoint names them, the cost runs measure with the guard and without
    unguarded, guarded, from_checkpoint, clean, measured = results["fp8-guard"]["planned"]
    assert guarded[guarded.index("--fp8-recipe") + 1] == "delayed"
    assert guarded[guarded.index("--fp8-guard-action") + 1] == "bf16-layers"
    assert from_checkpoint[from_checkpoint.index("--bf16-layers") + 1] == "3"
    assert from_checkpoint[from_checkpoint.index("--load") + 1].endswith("iter_0000008")
    assert "--fp8-guard" in measured and "--fp8-guard" not in clean + unguarded
    # the distillation-step stage's command line parses with the benchmark's own parser
    assert results["distill-step"]["argv"][:2] == ["--device", "cuda"]
    assert "bench_distill_step.py --device cuda" in (out / "distill-step.log").read_text()
    # the loss stage recorded two real runs with their GEMM-input kurtosis
    runs = results["fp8-loss"]["bench"]["loss_comparison"]
    assert len(runs) == 2 and all(r["valid_loss"] > 0 for r in runs)
    assert any(re.fullmatch(r"intermediate/layer\d+/fc2/kurtosis", k) for k in runs[0]["history"])

    home = tmp_path / "home"
    suite.collect(out, home)
    plot = home / "docs" / "fp8_vs_bf16_loss_dry.png"
    assert plot.stat().st_size > 10_000
    assert (home / "bench" / "results" / "gpu_suite_train-step-8b_dry.json").exists()
    assert list((home / "docs" / "device_runs").glob("*_dry_attention.log"))
    # a dry result never counts as done; a named stage runs although the tree has its results
    by_default = [s.name for s in suite.STAGES if not s.on_request]
    assert [s.name for s in suite.select([], home)[0]] == by_default
    assert [s.name for s in suite.select(["fp8-resume"], tree)[0]] == ["fp8-resume"]


@pytest.mark.process  # the stage's dry run starts pytest
def test_cuda_graphs_stage_runs_when_named_and_its_command_lines_can_run(tmp_path, run_suite):
    """The stage's dry run: every trainer command line parses and its CUDA graphs pass the
    trainer's checks as on a Hopper GPU with TE; where TE's attention is unfused (the recorded
    verdict) only packed rows move to PyTorch's attention, which whole-layer graphs cannot use."""
    tree, out = tmp_path / "tree", tmp_path / "out"
    out.mkdir()
    unfused = {"backends": {"8b-thd": "UnfusedDotProductAttention"}}
    (out / "attention.json").write_text(json.dumps(unfused))

    run_suite("--dry-run", "--out", str(out), "--tree", str(tree), "cuda-graphs")

    result = json.loads((out / "cuda-graphs.json").read_text())
    assert result["status"] == "dry"
    assert result["pytest"]["collected"] == 5  # the GPU test's cases, run before the rows
    planned = result["planned"]
    assert len(planned) == 2 * len(bench.GRAPH_PAIRS) == 8
    graphed = [argv for argv in planned if "--cuda-graph-impl" in argv]
    assert len(graphed) == 4
    impls = [argv[argv.index("--cuda-graph-impl") + 1] for argv in graphed]
    assert sorted(impls) == [
        "local",
        "transformer_engine",
        "transformer_engine",
        "transformer_engine",
    ]
    for argv in planned:
        packed = "--reset-attention-mask" in argv
        assert ("--attention-backend" in argv) == packed
        if packed and "--cuda-graph-impl" in argv:
            assert argv[argv.index("--cuda-graph-scope") + 1] == "mlp"
    assert "8 trainer command lines parsed" in (out / "cuda-graphs.log").read_text()


def test_dry_run_refuses_a_graph_the_trainer_would_refuse():
    import pretrain_gpt

    parser = pretrain_gpt.build_parser()
    whole_layers = bench.run_args(
        "apertus-v1.1-0.5b", "te-bf16-graphs", seq=256, steps=2, micro=1, global_batch=2, extra=[]
    )
    assert suite.cuda_graph_refusals(parser.parse_args(whole_layers)) == []
    (line,) = suite.cuda_graph_refusals(
        parser.parse_args([*whole_layers, "--attention-backend", "local"])
    )
    assert "--attention-backend local reads the all-zero mask" in line
    (line,) = suite.cuda_graph_refusals(parser.parse_args([*whole_layers, *bench.PACKED]))
    assert "packed documents" in line


def test_unknown_stage_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--out", str(tmp_path), "fp8-speed"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "unknown stage 'fp8-speed'" in proc.stderr and "Traceback" not in proc.stderr


def test_too_many_stages_for_one_device_call(tmp_path):
    names = [s.name for s in suite.STAGES[:4]]
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--out", str(tmp_path), *names],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "8 files" in proc.stderr


def test_eight_b_layers_are_the_most_that_fit_an_80gb_gpu():
    layers = bench.layers_that_fit(4096)
    cluster = Cluster(gpus=1, gpus_per_node=1, gpu_memory_gib=bench.GPU_80GB_GIB)
    usable = bench.GPU_80GB_GIB * cluster.usable_fraction * 2**30

    def total(n: int) -> float:
        argv = bench.run_args(
            bench.EIGHT_B_LAYERS,
            "te-bf16-packed",
            seq=4096,
            steps=1,
            micro=1,
            global_batch=8,
            extra=[],
            layers=n,
        )
        result = plan(run_from_args(argv), cluster)
        model = result.run.model
        assert (model.hidden_size, model.ffn_hidden_size) == (4096, 21504)
        assert (model.num_attention_heads, model.num_query_groups) == (32, 8)
        return result.peak.total + fp8_weight_cache_bytes(model)

    assert 3 <= layers < 32
    assert total(layers) <= usable < total(layers + 1)
    # an FP8 copy and its transpose: two bytes per block weight
    assert fp8_weight_cache_bytes(
        run_from_args(
            ["--model-preset", "apertus-8b", "--num-layers", "1", "--train-iters", "1"]
        ).model
    ) == 2 * (4096 * 128 * 48 + 4096 * 4096 + 2 * 4096 * 21504)


def test_recorded_device_output_parses():
    assert suite.selected_backends(DEVICE_LOG) == {"unlabelled": "UnfusedDotProductAttention"}
    marked = "PROBE 8b-thd\n" + DEVICE_LOG
    assert suite.selected_backends(marked) == {"8b-thd": "UnfusedDotProductAttention"}
    summary = next(line for line in DEVICE_LOG.splitlines() if "79 passed" in line)
    assert suite.pytest_counts(summary) == {
        "failed": 2,
        "passed": 79,
        "deselected": 154,
        "warnings": 9,
    }
    collected = (
        "tests/ops/test_xielu.py::test_cuda_backward_is_deterministic\n\n"
        "80/242 tests collected (162 deselected) in 2.83s"
    )
    assert suite.pytest_counts(collected) == {"collected": 80, "deselected": 162}
    assert suite.pytest_counts("1 test collected in 1.15s") == {"collected": 1}


def test_ratios_and_metrics_overhead_from_recorded_rows():
    result = json.loads(RECORDED_TE_ROWS.read_text())
    ratios = suite.tokens_ratio(result, [("te-bf16-packed", "te-fp8-delayed-packed")])
    assert ratios == {
        "te-fp8-delayed-packed-sdpa / te-bf16-packed-sdpa": pytest.approx(
            47964.18 / 48086.77, rel=1e-5
        )
    }
    renamed = {
        "rows": [
            {
                **r,
                "config": r["config"].replace(
                    "te-fp8-delayed-packed-sdpa", "te-bf16-packed-metrics-sdpa"
                ),
            }
            for r in result["rows"]
            if r["model"] == "apertus-v1.1-1.5b"
        ]
    }
    overhead = suite.metrics_overhead(renamed)["metrics_overhead"]
    (row,) = overhead.values()
    assert row["hooked_step_overhead"] == pytest.approx(48086.77 / 47964.18 - 1, rel=1e-3)
    assert row["overhead_at_interval_10"] == pytest.approx(row["hooked_step_overhead"] / 10)


def test_profile_categories_on_a_real_cpu_step():
    x = torch.randn(256, 512, requires_grad=True)
    w = torch.randn(512, 512, requires_grad=True)
    alpha = torch.zeros(1, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        xielu(x @ w, alpha, alpha, 0.5, -1e-6, impl="cpu").sum().backward()
    totals = bench.time_by_category(prof.key_averages(), "cpu")
    assert totals["gemm"] > 0 and totals["xielu"] > 0
