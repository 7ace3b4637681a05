"""Every GPU figure ``docs/gpu.md`` still owes, from one command on a fresh GPU machine.

    python3 bench/gpu_suite.py --out $OUT                 # the next pending stages that fit
    python3 bench/gpu_suite.py --out $OUT fp8-resume      # this stage, even if it has results
    python bench/gpu_suite.py --dry-run --out /tmp/suite  # on CPU: everything but the GPU calls
    python bench/gpu_suite.py --collect DIR               # a device reply's files into the tree
    python bench/gpu_suite.py --prepare                   # the carried folders, on this machine

What the command carries (ignored folders of the repository root, made by ``--prepare``):

* ``.tebundle/``: Transformer Engine 2.20.2 for sm_90 (``shared/tools/te-device/bundle``: the
  pruned core library, TE's wheels, its torch extension prebuilt for torch 2.11.0+cu130 /
  Python 3.12, ``install_te.sh``);
* ``.whl/``: wheels the GPU image lacks, for CPython 3.12 (``WHEELS``): megatron-core (both
  lines: ``--megatron-core`` picks the one a call installs),
  mistral-common (the tekken tokenizer) and their dependencies, zstandard;
* ``.kernels/``: our CUDA and CPU kernels (``csrc/``) prebuilt for the device's torch, Python,
  architecture and sources, as the suite returns them after building them once
  (``kernels_<stamp>.tar.gz``); without a matching one the suite builds them (1-3 min).

Setup on the device: ``install_te.sh`` (its fat-binary load and smoke test only with
``--te-checks``), ``pip install --target`` of the wheels, the kernels; then the stages, in order of
value (``STAGES``). Each stage runs under its own limit (``STAGE_LIMIT_S``, 9 min), and writes
``$OUT/<stage>.log`` and ``$OUT/<stage>.json`` as it finishes, so a call cut short still returns
every finished stage. A device call returns at most 8 files: setup's log, a kernel archive and
three stages. Without stage names the suite runs the stages with no results in the tree yet
(``bench/results/gpu_suite_<stage>_<device>.json``, written by ``--collect``), as many as fit
``--budget-s``; named stages run even when they have results, and the ``on_request`` ones
(``cuda-graphs``) run only when named.

``--dry-run`` runs the same path without a GPU: the setup commands are printed, pytest collects
the very tests a stage would run, every trainer command line a stage would start is parsed by
``pretrain_gpt.py``'s parser (and its CUDA graphs checked as on a Hopper GPU with TE), the
attention check's parser reads a recorded TE debug log, and the
FP8-loss stage trains the tiny model twice on CPU and plots the recorded result.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

STAGE_LIMIT_S = 540
"""Each stage stops after 9 minutes: one stage never takes a whole 10-minute device call."""
CALL_FILES = 8
"""Files one device call brings back."""
SUITE_RESULT = "SUITE_RESULT "
TE_BUNDLE = "shared/tools/te-device/bundle"
"""The TE bundle, relative to the parent of the repository root."""
MEGATRON_CORE_LINES = ("0.16.1", "0.19.2")
"""The two megatron-core lines we support; the first is the default (``--megatron-core``)."""
WHEELS = [
    "mistral-common==1.13.1",
    "pydantic-extra-types==2.11.1",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "zstandard==0.25.0",
]
"""Python packages the GPU image lacks (its list: the device notes' KINDS.md), besides
megatron-core (``MEGATRON_CORE_LINES``)."""
MANYLINUX = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
SLIM_WHEELS = {"pycountry==26.2.16": "pycountry/locales"}
"""Pure-Python packages carried unpacked without their bulk (the wheel's part named here), so
that everything fits one call's 64 MiB: pycountry's translations are 8 MB and never read."""
SITE = Path("/tmp/apertus-site")
TE_SITE = Path("/tmp/site")
RESUME_TEST = (
    "tests/gpu/test_transformer_engine.py::test_fp8_trains_is_deterministic_and_resumes_exactly"
)
GRAPH_TEST = "tests/gpu/test_cuda_graphs.py"
ATTENTION_LOG = REPO / "docs" / "device_runs" / "2026-11-24_h100_gpu_path.log"
"""A recorded TE debug log: what the dry run's attention parser reads."""
DEFAULT_METRICS_INTERVAL = 10
HOPPER = (9, 0)
"""The compute capability the dry run checks trainer command lines against."""
"""``--log-intermediate-metrics-interval``'s default (``--log-interval``'s default)."""


# -- running commands ---------------------------------------------------------------------------


@dataclass
class Context:
    """One invocation: where outputs go, the environment of the commands, the clock."""

    out: Path
    tree: Path
    dry: bool
    env: dict
    started: float
    budget_s: float
    log: Path | None = None
    stage_started: float = 0.0
    megatron_core: str = MEGATRON_CORE_LINES[0]

    def record(self, stage: str) -> str:
        """The name of ``stage``'s log and result: with ``-mcore<version>`` on the other line."""
        return record_name(stage, self.megatron_core)

    def remaining_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def write_log(self, text: str) -> None:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(text if text.endswith("\n") else text + "\n")

    def call(self, argv: list[str], *, limit_s: float, env: dict | None = None) -> tuple[int, str]:
        """Run ``argv`` in its own process group, its output streamed into the stage log; on the
        limit the whole group is killed (returns code 124)."""
        self.write_log(f"$ {' '.join(argv)}")
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        lines: list[str] = []

        def pump() -> None:
            for raw in proc.stdout:
                lines.append(raw.decode(errors="replace"))
                self.write_log(lines[-1])

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=max(limit_s, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
        reader.join(timeout=30)
        self.write_log(f"[exit {code}]")
        return code, "".join(lines)


def python() -> str:
    return sys.executable


def bench_module():
    """``bench/bench_train_step.py``, imported once megatron-core is importable: on the device,
    only after setup has installed the carried wheels."""
    import bench_train_step

    return bench_train_step


# -- setup on the device ------------------------------------------------------------------------


def kernel_stamp(torch_version: str, arch: str) -> str:
    """Which prebuilt kernels fit: torch, Python, architecture and the kernel sources."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "csrc").rglob("*")):
        if path.suffix in (".cu", ".cuh", ".cpp", ".h"):
            digest.update(path.relative_to(REPO).as_posix().encode() + path.read_bytes())
    digest.update((REPO / "setup.py").read_bytes())
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    safe = re.sub(r"[^A-Za-z0-9.]+", "-", f"torch{torch_version}-{py}-sm{arch}")
    return f"{safe}-{digest.hexdigest()[:12]}"


def env_from_script(script: Path) -> dict:
    """The environment after ``source script`` (install_te.sh's te_env.sh)."""
    out = subprocess.run(
        ["bash", "-c", f'source "{script}" && env -0'], capture_output=True, check=True
    ).stdout.decode()
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


def setup(ctx: Context, te_checks: bool) -> bool:
    """TE, the wheels and the kernels; False when something the stages need is missing."""
    ok = True
    install = REPO / ".tebundle" / "install_te.sh"
    if install.exists():
        skip = {} if te_checks else {"TE_SKIP_SMOKE": "1", "TE_SKIP_FATBIN_CHECK": "1"}
        if ctx.dry:
            ctx.write_log(
                f"would run: {' '.join(f'{k}={v}' for k, v in skip.items())} bash {install}"
            )
        else:
            code, _ = ctx.call(["bash", str(install)], limit_s=420, env=skip)
            ok &= code == 0
            if code == 0:
                ctx.env.update(env_from_script(TE_SITE / "te_env.sh"))
    else:
        ctx.write_log(f"no {install.relative_to(REPO)}: TE must already be importable")
    other_lines = [v for v in MEGATRON_CORE_LINES if v != ctx.megatron_core]
    wheels = [
        wheel
        for wheel in sorted((REPO / ".whl").glob("*.whl"))
        if not wheel.name.startswith(tuple(f"megatron_core-{v}-" for v in other_lines))
    ]
    if wheels:
        argv = [
            python(),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--disable-pip-version-check",
            "--target",
            str(SITE),
            *map(str, wheels),
        ]
        if ctx.dry:
            ctx.write_log(f"would run: {' '.join(argv[:12])} ... ({len(wheels)} wheels)")
        else:
            code, _ = ctx.call(argv, limit_s=180)
            ok &= code == 0
    else:
        ctx.write_log("no .whl/: megatron-core and mistral-common must already be importable")
    sites = [str(SITE), str(REPO / ".whl" / "pure")]
    sys.path[:0] = sites  # this process imports the benchmark (and megatron-core) after setup
    paths = [str(REPO), *sites, ctx.env.get("PYTHONPATH", "")]
    ctx.env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return ok & setup_kernels(ctx)


def setup_kernels(ctx: Context) -> bool:
    """Unpack matching prebuilt kernels from ``.kernels/``, else build them for this GPU and
    return the archive in ``$OUT`` for the next call."""
    if ctx.dry:
        stamp = kernel_stamp("DEVICE-TORCH", "90")
        ctx.write_log(
            f"would unpack .kernels/kernels_{stamp}.tar.gz or run: "
            f"TORCH_CUDA_ARCH_LIST=9.0 {python()} setup.py build_ext --inplace -j 4"
        )
        return True
    import torch

    major, minor = torch.cuda.get_device_capability()
    stamp = kernel_stamp(torch.__version__, f"{major}{minor}")
    archive = REPO / ".kernels" / f"kernels_{stamp}.tar.gz"
    if archive.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(REPO, filter="data")
        if kernels_load(ctx):
            ctx.write_log(f"kernels: unpacked {archive.name}")
            return True
        ctx.write_log(f"kernels: {archive.name} does not load here; building them")
    argv = [python(), "setup.py", "build_ext", "--inplace", "-j", "4"]
    code, _ = ctx.call(
        argv,
        limit_s=400,
        env={"TORCH_CUDA_ARCH_LIST": f"{major}.{minor}", "MAX_JOBS": str(os.cpu_count() or 8)},
    )
    if code:
        return False
    built = sorted((REPO / "megatron" / "apertus" / "ops").glob("_*.so"))
    if shutil.which("strip"):
        # debug sections are five sixths of each library: the archive then fits a later call
        ctx.call(["strip", "--strip-debug", *map(str, built)], limit_s=60)
    partial = ctx.out / f"kernels_{stamp}.tar.gz.part"
    with tarfile.open(partial, "w:gz") as tar:
        for path in built:
            tar.add(path, arcname=str(path.relative_to(REPO)))
    partial.rename(ctx.out / f"kernels_{stamp}.tar.gz")
    ctx.write_log(f"kernels: built {[p.name for p in built]}; archive in $OUT")
    return True


def kernels_load(ctx: Context) -> bool:
    """Whether the CUDA kernels in the tree import on this machine (an archive built elsewhere
    may miss a library the device has under another name)."""
    modules = [
        f"megatron.apertus.ops.{p.name.split('.')[0]}"
        for p in (REPO / "megatron" / "apertus" / "ops").glob("_*_cuda*.so")
    ]
    if not modules:
        return False
    code, _ = ctx.call(
        [python(), "-c", "; ".join(f"import {m}" for m in ["torch", *modules])], limit_s=120
    )
    return code == 0


# -- stages -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    minutes: float
    """Expected wall time: measured on an H200 where a stage has run, with a margin for an H100
    (the suite starts a stage only when this much is left)."""
    run: Callable[[Context, "Stage"], dict]
    on_request: bool = False
    """Runs only when named: a lever to try, not a figure the docs owe."""


def record_name(stage: str, megatron_core: str) -> str:
    return stage if megatron_core == MEGATRON_CORE_LINES[0] else f"{stage}-mcore{megatron_core}"


def stage_limit(ctx: Context) -> float:
    """Seconds the running stage has left: its own limit, within the call's budget."""
    return min(STAGE_LIMIT_S - (time.monotonic() - ctx.stage_started), ctx.remaining_s())


PYTEST_COUNT = re.compile(
    r"(\d+) (passed|failed|skipped|deselected|errors?|warnings?|xfailed|xpassed)"
)
PYTEST_COLLECTED = re.compile(r"(\d+)(?:/\d+)? tests? collected")


def pytest_counts(output: str) -> dict:
    """``{"passed": n, "failed": n, ...}`` (``collected`` with ``--collect-only``) from pytest's
    last summary line."""
    lines = [
        line
        for line in output.splitlines()
        if PYTEST_COUNT.search(line) or PYTEST_COLLECTED.search(line)
    ]
    if not lines:
        return {}
    counts = {word: int(n) for n, word in PYTEST_COUNT.findall(lines[-1])}
    collected = PYTEST_COLLECTED.search(lines[-1])
    if collected:
        counts["collected"] = int(collected.group(1))
    return counts


def run_pytest(ctx: Context, targets: list[str], env: dict | None = None) -> dict:
    """The GPU tests of ``targets``; in the dry run pytest collects them (same selection)."""
    argv = [python(), "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *targets]
    if ctx.dry:
        argv.append("--collect-only")
    code, output = ctx.call(argv, limit_s=stage_limit(ctx), env=env)
    counts = pytest_counts(output)
    ok = code == 0 and bool(counts)
    return {"status": status(ok, code, ctx), "pytest": counts, "targets": targets}


def status(ok: bool, code: int, ctx: Context) -> str:
    if code == 124:
        return "cut"
    if ctx.dry:
        return "dry" if ok else "failed"
    return "ok" if ok else "failed"


def selected_backends(output: str) -> dict[str, str]:
    """TE's attention choice per probed layout: ``PROBE <layout>`` markers followed by TE's
    ``Selected backend = X`` debug lines (``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2``)."""
    backends, layout = {}, "unlabelled"
    for line in output.splitlines():
        marker = re.match(r"PROBE (\S+)", line)
        if marker:
            layout = marker.group(1)
        found = re.search(r"Selected backend = (\w+)", line)
        if found:
            backends.setdefault(layout, found.group(1))
    return backends


def attention_stage(ctx: Context, stage: Stage) -> dict:
    """Which TE attention backend runs the 8B's and the 1.5B's heads, unpacked (sbhd) and packed
    (thd): fused (cuDNN) or flash pass, TE's unfused fallback fails."""
    if ctx.dry:
        output = ATTENTION_LOG.read_text()
        ctx.write_log(f"dry run: parsing the recorded TE debug log {ATTENTION_LOG.name}")
        backends = selected_backends(output)
        return {"status": "dry" if backends else "failed", "backends": backends}
    env = {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"}
    code, output = ctx.call(
        [python(), __file__, "--probe-attention"], limit_s=stage_limit(ctx), env=env
    )
    backends = selected_backends(output)
    probe = next(
        (
            json.loads(line[len(SUITE_RESULT) :])
            for line in output.splitlines()
            if line.startswith(SUITE_RESULT)
        ),
        {},
    )
    fast = set(backends) == set(PROBES) and "UnfusedDotProductAttention" not in backends.values()
    return {"status": status(code == 0 and fast, code, ctx), "backends": backends, **probe}


PROBES = {  # layout: (heads, groups, head dim)
    "8b-sbhd": (32, 8, 128),
    "8b-thd": (32, 8, 128),
    "1.5b-sbhd": (32, 8, 64),
    "1.5b-thd": (32, 8, 64),
}


def probe_attention() -> None:
    """Child process: one forward and backward of ``te.DotProductAttention`` per ``PROBES``
    layout at seq 4096, bf16, causal; the packed ones with three documents (THD ``cu_seqlens``)."""
    import torch
    import transformer_engine
    import transformer_engine.pytorch as te

    seq, docs = 4096, [1000, 1500, 1596]
    for layout, (heads, groups, dim) in PROBES.items():
        packed = layout.endswith("thd")
        print(f"PROBE {layout}", flush=True)
        attn = te.DotProductAttention(
            heads,
            dim,
            num_gqa_groups=groups,
            attention_dropout=0.0,
            qkv_format="thd" if packed else "sbhd",
            attn_mask_type="padding_causal" if packed else "causal",
        )
        shape = (seq, heads, dim) if packed else (seq, 2, heads, dim)
        kv_shape = (*shape[:-2], groups, dim)
        q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kwargs = {}
        if packed:
            cu = torch.tensor(
                [0, *torch.tensor(docs).cumsum(0).tolist()], device="cuda", dtype=torch.int32
            )
            kwargs = {
                "cu_seqlens_q": cu,
                "cu_seqlens_kv": cu,
                "max_seqlen_q": max(docs),
                "max_seqlen_kv": max(docs),
            }
        attn(q, k, v, **kwargs).float().sum().backward()
        torch.cuda.synchronize()
    cudnn = torch.backends.cudnn.version()
    print(
        SUITE_RESULT
        + json.dumps(
            {
                "torch_cudnn": cudnn,
                "te": transformer_engine.__version__,
                "cudnn_home": os.environ.get("CUDNN_HOME"),
            }
        ),
        flush=True,
    )


def pytest_gpu_stage(ctx: Context, stage: Stage) -> dict:
    """Every GPU test but the FP8 resume and the CUDA graphs (stages of their own)."""
    return run_pytest(
        ctx, ["tests/gpu", "tests/ops", "--deselect", RESUME_TEST, "--ignore", GRAPH_TEST]
    )


def fp8_resume_stage(ctx: Context, stage: Stage) -> dict:
    """FP8 (delayed scaling) runs twice bitwise alike and resumes exactly; the test itself sets
    ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` for the resumed leg."""
    return run_pytest(ctx, [RESUME_TEST])


def step_levers_stage(ctx: Context, stage: Stage) -> dict:
    """The step's own levers, checked: TE's weight-gradient GEMMs accumulating into
    ``main_grad`` (the same gradients as a bf16 gradient plus DDP's add; bf16 and FP8 runs that
    train), and host waits that do not grow with the micro-batches."""
    return run_pytest(
        ctx,
        [
            "tests/gpu/test_step_host_waits.py",
            "tests/gpu/test_transformer_engine.py",
            "-k",
            "main_grad or gradient_accumulation_fusion or host_waits",
        ],
    )


def attention_suffix(ctx: Context) -> str:
    """``-sdpa`` (PyTorch's flash / varlen attention between TE's linears) when the attention
    stage found TE on its unfused fallback, which runs out of memory on packed samples."""
    tree = sorted(results_dir(ctx.tree).glob("gpu_suite_attention_*.json"))
    for path in [ctx.out / "attention.json", *tree]:
        if path.exists():
            backends = json.loads(path.read_text()).get("backends", {})
            return "-sdpa" if "UnfusedDotProductAttention" in backends.values() else ""
    return ""


def bench_stage(
    ctx: Context, name: str, flags: list[str], derive=None, follows=lambda config: True
) -> dict:
    """``bench_train_step.py`` with ``flags`` (the configs that ``follows`` take the attention
    stage's verdict), its JSON read back. In the dry run every trainer command line it would
    start is parsed."""
    suffix = attention_suffix(ctx)
    configs = bench_module().CONFIGS
    flags = [
        f"{f}{suffix}" if f.startswith("te-") and f + suffix in configs and follows(f) else f
        for f in flags
    ]
    work = Path("/tmp/gpu_suite") / name
    argv = [
        *flags,
        "--name",
        f"train_step_{name}",
        "--results-dir",
        str(work),
        "--out",
        str(work / "runs"),
    ]
    if ctx.dry:
        return {"status": "dry", **check_bench_argv(ctx, argv)}
    shutil.rmtree(work, ignore_errors=True)
    code, _ = ctx.call(
        [python(), str(REPO / "bench" / "bench_train_step.py"), *argv], limit_s=stage_limit(ctx)
    )
    files = sorted(work.glob(f"train_step_{name}_*.json"))
    result = json.loads(files[0].read_text()) if files else {}
    rows = result.get("rows", []) + result.get("loss_comparison", [])
    ok = code == 0 and bool(rows) and not any("error" in row for row in rows)
    derived = derive(result) if derive and result else {}
    return {"status": status(ok, code, ctx), "bench": result, **derived}


def check_bench_argv(ctx: Context, argv: list[str]) -> dict:
    """Parse the benchmark's flags and every trainer command line they start."""
    bench = bench_module()
    planned = bench.planned_trainer_argvs(bench.build_parser().parse_args(argv))
    check_trainer_argvs(ctx, planned, f"bench_train_step.py {' '.join(argv)}")
    return {"planned": planned}


def check_trainer_argvs(ctx: Context, planned: list[list[str]], what: str) -> None:
    """Parse every trainer command line ``what`` starts, and check its CUDA graphs as a GPU with
    Transformer Engine would; the first refusal ends the stage."""
    from megatron.apertus.training.megatron_flags import refusals
    from pretrain_gpt import build_parser

    parser = build_parser()
    for trainer_argv in planned:
        args = parser.parse_args(trainer_argv)
        refused = refusals(args) or cuda_graph_refusals(args)
        if refused:
            raise SystemExit(f"gpu_suite.py: {' '.join(trainer_argv)}: {refused[0]}")
    ctx.write_log(f"dry run: {what}: {len(planned)} trainer command lines parsed")


def cuda_graph_refusals(args: argparse.Namespace) -> list[str]:
    """The trainer's CUDA-graph refusal of parsed ``args`` on a Hopper GPU with Transformer
    Engine (the groups that rule reads, built from the flags; the model is the preset's)."""
    from types import SimpleNamespace

    from megatron.apertus.errors import ConfigError
    from megatron.apertus.model.config import preset
    from megatron.apertus.model.engine import validate_engine
    from megatron.apertus.training.config import groups_from_arguments
    from megatron.apertus.training.cuda_graphs import check_cuda_graphs

    model = preset(args.model_preset)
    names = ["parallel", "training", "engine", "cuda_graphs", "dataset", "logging", "fp8_guard"]
    try:
        config = SimpleNamespace(**groups_from_arguments(args, names, model=model))
        impl = validate_engine(
            config.engine,
            device="cuda",
            num_layers=args.num_layers or model.num_layers,
            te_error=lambda: None,
            capability=lambda: HOPPER,
        )
        check_cuda_graphs(
            config, device="cuda", impl=impl, engine=config.engine, te_error=lambda: None
        )
    except ConfigError as err:
        return [str(err)]
    return []


def tokens_ratio(result: dict, pairs: list[tuple[str, str]]) -> dict[str, float]:
    """tokens/s of the second config over the first, per pair (same model, same call)."""
    by_config = {row["config"]: row for row in result.get("rows", []) if "error" not in row}
    ratios = {}
    for base, other in pairs:
        for suffix in ("", "-sdpa"):
            a, b = by_config.get(base + suffix), by_config.get(other + suffix)
            if a and b:
                ratios[f"{other}{suffix} / {base}{suffix}"] = (
                    b["tokens_per_s_per_gpu"] / a["tokens_per_s_per_gpu"]
                )
    return ratios


def eight_b_configs() -> list[str]:
    """TE bf16, then every FP8 recipe with all layers in FP8 and (where the recipe allows it)
    with bf16 first and last layers."""
    configs = bench_module().CONFIGS
    return [
        "te-bf16-packed",
        *(
            c
            for c in configs
            if c.startswith("te-fp8-") and c.endswith(("-packed", "-packed-bf16-ends"))
        ),
    ]


def eight_b_flags(configs: list[str]) -> list[str]:
    """The bench's flags for ``configs`` at the 8B's layer shapes: global batch 8, 2 warm-up
    and 4 measured steps."""
    return [
        *("--models", bench_module().EIGHT_B_LAYERS, "--global-batch", "8"),
        *("--warmup", "2", "--steps", "4", "--configs", *configs),
    ]


def train_step_8b_stage(ctx: Context, stage: Stage) -> dict:
    """bf16 against FP8 (tensorwise, delayed, blockwise; all layers or bf16 ends) at the 8B's
    layer shapes."""
    configs = eight_b_configs()
    flags = eight_b_flags(configs)
    pairs = [("te-bf16-packed", c) for c in configs[1:]]
    return bench_stage(
        ctx, stage.name, flags, lambda r: {"speedup_over_bf16": tokens_ratio(r, pairs)}
    )


LONG_CONTEXT = ((4096, 2, 16), (16384, 1, 4), (32768, 1, 2))
"""(sequence length, micro-batch, global batch): 65,536 tokens a step at every length."""


def long_context_stage(ctx: Context, stage: Stage) -> dict:
    """The 1.5B with TE bf16 and packed documents (THD) at 16k and 32k tokens against 4k, the
    same tokens a step: tokens/s and peak memory on one GPU (context parallelism 1)."""
    results = {
        f"seq_{seq}": bench_stage(
            ctx,
            f"{stage.name}-{seq}",
            [
                "--models",
                "apertus-v1.1-1.5b",
                "--seq-length",
                str(seq),
                "--micro-batch",
                str(micro),
                "--global-batch",
                str(global_batch),
                "--warmup",
                "2",
                "--steps",
                "4",
                "--configs",
                "te-bf16-packed",
            ],
        )
        for seq, micro, global_batch in LONG_CONTEXT
    }
    return {
        "status": worst_status(results.values()),
        **{name: result.get("bench", result) for name, result in results.items()},
    }


def fp8_profile_stage(ctx: Context, stage: Stage) -> dict:
    """Where a step's time goes at the 8B's layer shapes, bf16 against FP8: kernel time by
    category (GEMMs, FP8 casts / transposes / amax, attention, xIELU, loss, norms, optimizer)."""
    flags = [
        "--models",
        bench_module().EIGHT_B_LAYERS,
        "--global-batch",
        "8",
        "--warmup",
        "2",
        "--steps",
        "2",
        "--profile",
        "--configs",
        "te-bf16-packed",
        "te-fp8-tensorwise-packed",
        "te-fp8-delayed-packed",
    ]
    return bench_stage(ctx, stage.name, flags)


def cuda_graphs_stage(ctx: Context, stage: Stage) -> dict:
    """CUDA graphs: first ``GRAPH_TEST`` (graphs captured, the same losses as without), then the
    8B's layer shapes (``bench_train_step.GRAPH_PAIRS``): TE's graphs of the MLPs (packed; bf16
    and FP8 delayed), of whole layers (unpacked), and megatron-core's own (unpacked, weight
    gradients unfused), each beside the same configuration without graphs; the rows keep their
    losses."""
    checked = run_pytest(ctx, [GRAPH_TEST])
    pairs = bench_module().GRAPH_PAIRS
    flags = eight_b_flags([config for pair in pairs for config in pair])
    # Only packed rows take PyTorch's attention where TE's is unfused (there it runs out of
    # memory): whole-layer graphs need TE's attention, and their pairs keep it on both sides.
    measured = bench_stage(
        ctx,
        stage.name,
        flags,
        lambda r: {"speedup_with_graphs": tokens_ratio(r, pairs)},
        follows=lambda config: "packed" in config,
    )
    return {**measured, "status": worst_status([checked, measured]), "pytest": checked["pytest"]}


def distill_step_stage(ctx: Context, stage: Stage) -> dict:
    """``bench_distill_step.py --device cuda``: the fused loss step with a top-k 256 store's and a
    sampled store's targets against cross-entropy, at the 0.5B / 1.5B / 4B students' hidden
    sizes. The dry run parses its command line."""
    work = Path("/tmp/gpu_suite") / stage.name
    argv = ["--device", "cuda", "--rounds", "5", "--results-dir", str(work)]
    script = REPO / "bench" / "bench_distill_step.py"
    if ctx.dry:
        import bench_distill_step

        bench_distill_step.build_parser().parse_args(argv)
        ctx.write_log(f"dry run: {script.name} {' '.join(argv)} parsed")
        return {"status": "dry", "argv": argv}
    shutil.rmtree(work, ignore_errors=True)
    code, _ = ctx.call([python(), str(script), *argv], limit_s=stage_limit(ctx))
    files = sorted(work.glob("distill_step_*.json"))
    result = json.loads(files[0].read_text()) if files else {}
    ok = code == 0 and bool(result.get("rows"))
    return {"status": status(ok, code, ctx), "bench": result}


def worst_status(results) -> str:
    """The status of a stage made of several runs: its worst run's."""
    statuses = {result["status"] for result in results}
    return next(s for s in ("cut", "failed", "dry", "ok") if s in statuses)


def train_step_small_stage(ctx: Context, stage: Stage) -> dict:
    """The 1.5B and 0.5B TE rows again, with TE's own attention (fused / flash)."""
    flags = [
        "--warmup",
        "2",
        "--steps",
        "4",
        "--configs",
        "te-bf16",
        "te-bf16-packed",
        "te-fp8-tensorwise-packed",
        "te-fp8-delayed-packed",
    ]
    large = bench_stage(ctx, "train-step-1.5b", ["--models", "apertus-v1.1-1.5b", *flags])
    small = bench_stage(
        ctx,
        "train-step-0.5b",
        ["--models", "apertus-v1.1-0.5b", *flags[:5], "te-bf16-packed", "te-fp8-delayed-packed"],
    )
    return {
        "status": worst_status([large, small]),
        "bench": large.get("bench", large),
        "bench_0.5b": small.get("bench", small),
    }


LOSS_FLAGS = [
    "--configs",
    "--loss-steps",
    "300",
    "--loss-configs",
    "te-bf16-packed",
    "te-fp8-delayed-packed",
]
"""No throughput rows; the loss runs, bf16 first (their configs take the attention stage's
verdict). Delayed scaling is the recipe that pays at the 8B's shapes (tensorwise ran before:
docs/gpu.md)."""


def fp8_loss_stage(ctx: Context, stage: Stage) -> dict:
    """bf16 against FP8 (delayed scaling) over 300 steps of the 0.5B on the same data, each
    with the GEMM-input statistics (kurtosis, under/overflow); in the dry run, two tiny CPU runs."""
    if ctx.dry:
        check_bench_argv(ctx, LOSS_FLAGS)
        return {"status": "dry", "bench": dry_loss_runs(ctx)}
    result = bench_stage(ctx, stage.name, LOSS_FLAGS)
    runs = result.get("bench", {}).get("loss_comparison", [])
    if runs and all("valid_loss" in run for run in runs):
        bf16 = runs[0]["valid_loss"]
        result["valid_loss_relative_difference"] = {
            run["config"]: run["valid_loss"] / bf16 - 1 for run in runs[1:]
        }
    return result


def dry_loss_runs(ctx: Context) -> dict:
    """Two real CPU runs of the tiny model with the loss stage's metrics (fp32; FP8 needs a GPU),
    recorded the way the GPU stage records them: what the dry run plots."""
    work = Path("/tmp/gpu_suite") / "fp8-loss-dry"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    bench, runs = bench_module(), []
    for seed in (1234, 1235):
        log_json = work / f"loss_tiny_{seed}.json"
        argv = [
            "--model-preset",
            "tiny",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--train-iters",
            "3",
            "--lr",
            "1e-3",
            "--seed",
            str(seed),
            "--eval-iters",
            "1",
            "--log-interval",
            "1",
            "--log-json",
            str(log_json),
            *bench.LOSS_METRICS[:-1],
            "1",
        ]
        ctx.write_log(f"$ pretrain_gpt.py {' '.join(argv)}")
        label = {"model": "tiny", "config": f"cpu-fp32-seed{seed}", "steps": 3}
        runs.append(bench.loss_run(argv, log_json, label))
    return {"rows": [], "loss_comparison": runs}


def variant_pairs(variant: str) -> list[tuple[str, str]]:
    """TE bf16 and FP8 delayed (packed), each without and with ``-<variant>``."""
    return [(base, f"{base}-{variant}") for base in ("te-bf16-packed", "te-fp8-delayed-packed")]


def variant_flags(variant: str) -> list[str]:
    """The benchmark's flags for ``variant_pairs`` on the 1.5B."""
    configs = [config for pair in variant_pairs(variant) for config in pair]
    return ["--models", "apertus-v1.1-1.5b", "--warmup", "2", "--steps", "4", "--configs", *configs]


def determinism_stage(ctx: Context, stage: Stage) -> dict:
    """tokens/s with and without ``--deterministic-mode`` (TE bf16 and FP8 delayed, 1.5B)."""
    pairs = variant_pairs("deterministic")
    return bench_stage(
        ctx,
        stage.name,
        variant_flags("deterministic"),
        lambda r: {"deterministic_over_default": tokens_ratio(r, pairs)},
    )


def metrics_overhead(result: dict, interval: int = DEFAULT_METRICS_INTERVAL) -> dict:
    """Overhead of a hooked step (every step hooked in the ``-metrics`` rows), and of
    ``--log-intermediate-metrics`` at its default interval (one hooked step in ``interval``)."""
    hooked = {}
    for name, ratio in tokens_ratio(result, variant_pairs("metrics")).items():
        step_cost = 1 / ratio - 1
        hooked[name] = {
            "hooked_step_overhead": step_cost,
            f"overhead_at_interval_{interval}": step_cost / interval,
        }
    return {"metrics_overhead": hooked}


def metrics_overhead_stage(ctx: Context, stage: Stage) -> dict:
    """``--log-intermediate-metrics`` cost (TE bf16 and FP8 delayed, 1.5B)."""
    return bench_stage(ctx, stage.name, variant_flags("metrics"), metrics_overhead)


def fp8_guard_stage(ctx: Context, stage: Stage) -> dict:
    """The injected outlier under TE FP8 delayed scaling (0.5B, ``bench_fp8_guard.py``): the
    alarm, the ``bf16-layers`` switch back to the checkpoint before it, the run from that
    checkpoint with ``--bf16-layers`` to compare losses with, and the guard's cost per step at
    its default interval. The dry run parses every trainer command line the call would start."""
    import bench_fp8_guard as guard

    work = Path("/tmp/gpu_suite") / stage.name
    if ctx.dry:
        planned = guard.planned_trainer_argvs(guard.gpu_scenario(), work)
        check_trainer_argvs(ctx, planned, "bench_fp8_guard.py --device cuda")
        return {"status": "dry", "planned": planned}
    code, _ = ctx.call(
        [
            python(),
            str(REPO / "bench" / "bench_fp8_guard.py"),
            "--device",
            "cuda",
            "--out",
            str(work),
        ],
        limit_s=stage_limit(ctx),
    )
    report = work / "fp8_guard.json"
    result = json.loads(report.read_text()) if report.exists() else {}
    ok = code == 0 and result.get("decision_as_expected") and "measured_step_overhead" in result
    return {"status": status(bool(ok), code, ctx), **result}


STAGES = [
    Stage("attention", "TE attention backend, unpacked and packed (THD)", 0.5, attention_stage),
    Stage("pytest-gpu", "pytest -m gpu tests/gpu tests/ops", 4, pytest_gpu_stage),
    Stage("fp8-resume", "FP8 delayed scaling: deterministic, exact resume", 2.5, fp8_resume_stage),
    Stage("step-levers", "wgrad accumulation fusion, host waits per step", 2.5, step_levers_stage),
    Stage(
        "train-step-8b", "8B layer shapes: bf16 vs FP8 recipes, bf16 ends", 3.5, train_step_8b_stage
    ),
    Stage("fp8-loss", "bf16 vs FP8 loss over 300 steps, with kurtosis", 4.5, fp8_loss_stage),
    Stage("train-step-small", "1.5B / 0.5B TE rows with TE's attention", 4, train_step_small_stage),
    Stage("long-context", "1.5B at 16k / 32k tokens against 4k (THD)", 3, long_context_stage),
    Stage("distill-step", "fused KD loss step: top-k and sampled vs CE", 1.5, distill_step_stage),
    Stage("fp8-profile", "8B layer shapes: kernel time by category", 4, fp8_profile_stage),
    Stage("determinism", "--deterministic-mode cost in tokens/s", 3, determinism_stage),
    Stage("metrics-overhead", "--log-intermediate-metrics overhead", 2.5, metrics_overhead_stage),
    Stage("fp8-guard", "FP8 guard: injected outlier, bf16-layers, cost", 4.5, fp8_guard_stage),
    Stage(
        "cuda-graphs",
        "CUDA graphs: GPU test, then 8B layer shapes (TE MLP / layer, local) vs none",
        6,
        cuda_graphs_stage,
        on_request=True,
    ),
]
"""In order of value; the stages ``on_request`` run only when named."""


def stage_named(name: str) -> Stage:
    return next(s for s in STAGES if s.name == name)


# -- selection and results ----------------------------------------------------------------------


def results_dir(tree: Path) -> Path:
    return tree / "bench" / "results"


def done_in_tree(tree: Path, stage: str) -> bool:
    """A stage counts as done once a GPU result of it with status ``ok`` is in the tree."""
    for path in results_dir(tree).glob(f"gpu_suite_{stage}_*.json"):
        if json.loads(path.read_text()).get("status") == "ok":
            return True
    return False


def select(
    names: list[str], tree: Path, megatron_core: str = MEGATRON_CORE_LINES[0]
) -> tuple[list[Stage], list[str]]:
    """The candidate stages and why others are left: named ones as given; else the ones without
    results in the tree (for this megatron-core line) and not ``on_request``, in order of
    value."""
    if names:
        return [stage_named(n) for n in names], []
    pending, notes = [], []
    for stage in STAGES:
        if stage.on_request:
            notes.append(f"{stage.name}: runs only when named")
        elif done_in_tree(tree, record_name(stage.name, megatron_core)):
            notes.append(f"{stage.name}: has results in the tree (name it to run it again)")
        else:
            pending.append(stage)
    return pending, notes


def device_tag(dry: bool) -> str:
    if dry:
        return "dry"
    from _common import device_tag as tag

    return tag()


def write_json(path: Path, payload: dict) -> None:
    """Under a temporary name, renamed when complete."""
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(payload, indent=2))
    partial.replace(path)


def run_stage(ctx: Context, stage: Stage) -> dict:
    ctx.log = ctx.out / f"{ctx.record(stage.name)}.log"
    ctx.log.write_text("")
    ctx.write_log(f"== {stage.name}: {stage.what}")
    start = ctx.stage_started = time.monotonic()
    try:
        result = stage.run(ctx, stage)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, SystemExit) as err:
        ctx.write_log(f"{stage.name}: {type(err).__name__}: {err}")
        result = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    from _common import git_commit, machine

    payload = {
        "stage": ctx.record(stage.name),
        "what": stage.what,
        **result,
        "wall_s": time.monotonic() - start,
        "device": device_tag(ctx.dry),
        "machine": machine(),
        "megatron_core": ctx.megatron_core,
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_json(ctx.out / f"{ctx.record(stage.name)}.json", payload)
    ctx.write_log(f"== {stage.name}: {payload['status']} in {payload['wall_s']:.0f} s")
    return payload


# -- bringing a reply home ----------------------------------------------------------------------


def plot_fp8_loss(payload: dict, path: Path) -> Path:
    """Losses of the bf16 and FP8 runs, and per GEMM the largest kurtosis and e4m3 underflow
    share over layers, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in payload["bench"]["loss_comparison"] if "history" in r]
    if not runs:
        raise ValueError("no recorded run with a history to plot")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run, color in zip(runs, ("tab:blue", "tab:red", "tab:green")):
        history = run["history"]
        for name, style in (("train/loss", "-"), ("valid/loss", "o")):
            if name in history:
                steps, values = zip(*history[name])
                axes[0].plot(steps, values, style, color=color, label=f"{run['config']} {name}")
        for ax, statistic in ((axes[1], "kurtosis"), (axes[2], "underflow")):
            for gemm, style in zip(("qkv", "proj", "fc1", "fc2"), ("-", "--", ":", "-.")):
                series = per_step_max(history, gemm, statistic)
                if series:
                    ax.plot(*zip(*series), style, color=color, label=f"{run['config']} {gemm}")
    axes[0].set(xlabel="step", ylabel="loss", title="loss")
    axes[1].set(xlabel="step", ylabel="max over layers", title="GEMM-input kurtosis", yscale="log")
    axes[2].set(xlabel="step", ylabel="max over layers", title="e4m3 underflow share")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.tight_layout()
    partial = path.with_name(path.stem + ".part.png")
    fig.savefig(partial, dpi=110)
    plt.close(fig)
    partial.replace(path)
    return path


def per_step_max(history: dict, gemm: str, statistic: str) -> list[tuple[int, float]]:
    """``max over layers of intermediate/layer*/{gemm}/{statistic}`` per recorded step."""
    pattern = re.compile(rf"intermediate/layer\d+/{gemm}/{statistic}$")
    by_step: dict[int, float] = {}
    for name, points in history.items():
        if pattern.match(name):
            for step, value in points:
                by_step[step] = max(by_step.get(step, float("-inf")), value)
    return sorted(by_step.items())


def collect(reply: Path, tree: Path) -> list[Path]:
    """A device reply's files into the tree: each stage's JSON to ``bench/results/`` (and its
    benchmark JSON beside it), its log to ``docs/device_runs/``, the FP8-loss plot to ``docs/``,
    a kernel archive to ``.kernels/``."""
    written = []
    for stage_json in sorted(reply.glob("*.json")):
        payload = json.loads(stage_json.read_text())
        if "stage" not in payload:
            continue
        stage, tag, day = payload["stage"], payload["device"], payload["date"].split()[0]
        target = results_dir(tree) / f"gpu_suite_{stage}_{tag}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json(target, payload)
        written.append(target)
        log = stage_json.with_suffix(".log")
        if log.exists():
            log_target = tree / "docs" / "device_runs" / f"{day}_{tag}_{stage}.log"
            log_target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, log_target)
            written.append(log_target)
        if stage == "fp8-loss" and payload.get("bench", {}).get("loss_comparison"):
            written.append(plot_fp8_loss(payload, tree / "docs" / f"fp8_vs_bf16_loss_{tag}.png"))
    for archive in reply.glob("kernels_*.tar.gz"):
        (tree / ".kernels").mkdir(exist_ok=True)
        written.append(Path(shutil.copyfile(archive, tree / ".kernels" / archive.name)))
    return written


# -- preparing the carried folders --------------------------------------------------------------


def pip_download(dest: Path, requirements: list[str], *options: str) -> None:
    """Binary wheels of ``requirements`` without their dependencies into ``dest``."""
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*argv, *options, "-d", str(dest), *requirements], check=True)


def unpack_slim_wheels(wheels: Path) -> None:
    """``SLIM_WHEELS`` unpacked into ``wheels/pure`` without their bulk (a wheel is a zip)."""
    import tempfile
    import zipfile

    pure = wheels / "pure"
    shutil.rmtree(pure, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(Path(tmp), list(SLIM_WHEELS))
        bulk = tuple(SLIM_WHEELS.values())
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(pure, [n for n in archive.namelist() if not n.startswith(bulk)])


def prepare(tree: Path) -> None:
    """``.tebundle/`` and ``.whl/`` in the repository root, ignored by git."""
    exclude = Path(
        subprocess.run(
            ["git", "rev-parse", "--git-path", "info/exclude"],
            cwd=tree,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    exclude = exclude if exclude.is_absolute() else tree / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    with exclude.open("a") as f:
        for folder in ("/.tebundle/", "/.whl/", "/.kernels/"):
            if folder not in lines:
                f.write(folder + "\n")
    bundle = tree.parent / TE_BUNDLE
    if not bundle.exists():
        bundle = REPO.parents[1] / TE_BUNDLE  # a worktree under <root>/wt/<name>
    shutil.rmtree(tree / ".tebundle", ignore_errors=True)
    shutil.copytree(bundle, tree / ".tebundle")
    for path in (tree / ".tebundle").rglob("*"):
        path.chmod(path.stat().st_mode | 0o200)  # the shared copy is read-only
    target = ["--python-version", "3.12", "--implementation", "cp"]
    target += [arg for p in MANYLINUX for arg in ("--platform", p)]
    pip_download(tree / ".whl", WHEELS, *target)
    for version in MEGATRON_CORE_LINES:  # one resolver run each: they cannot share one
        pip_download(tree / ".whl", [f"megatron-core=={version}"], *target)
    unpack_slim_wheels(tree / ".whl")
    print(f"prepared {tree / '.tebundle'} and {tree / '.whl'} (carry them with .kernels)")


# -- entry point --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", nargs="*", help="stages to run (default: the pending ones)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu_suite")))
    parser.add_argument("--dry-run", action="store_true", help="no GPU: all but the GPU calls")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=570,
        help="seconds this call may use (a device command has 600)",
    )
    parser.add_argument(
        "--max-stages",
        type=int,
        default=(CALL_FILES - 2) // 2,
        help="stages a call runs at most (two files each come back)",
    )
    parser.add_argument(
        "--te-checks",
        action="store_true",
        help="install_te.sh's fat-binary load and smoke test too",
    )
    parser.add_argument(
        "--megatron-core",
        choices=MEGATRON_CORE_LINES,
        default=MEGATRON_CORE_LINES[0],
        help="the megatron-core line to install and run (results of the other line are named "
        "<stage>-mcore<version>)",
    )
    parser.add_argument("--tree", type=Path, default=REPO, help="where results are looked up")
    parser.add_argument("--list", action="store_true", help="the stages and whether they are done")
    parser.add_argument("--collect", type=Path, metavar="DIR", help="a device reply's files")
    parser.add_argument("--prepare", action="store_true", help="make .tebundle/ and .whl/")
    parser.add_argument("--probe-attention", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.probe_attention:
        probe_attention()
        return 0
    if args.collect:
        if not args.collect.is_dir():
            parser.error(f"--collect {args.collect}: no such directory")
        for path in collect(args.collect, args.tree):
            print(f"wrote {path}")
        return 0
    if args.prepare:
        prepare(args.tree)
        return 0
    unknown = [n for n in args.stages if n not in {s.name for s in STAGES}]
    if unknown:
        parser.error(
            f"unknown stage {unknown[0]!r}; choose among {', '.join(s.name for s in STAGES)}"
        )
    if args.list:
        for stage in STAGES:
            name = record_name(stage.name, args.megatron_core)
            done = "done" if done_in_tree(args.tree, name) else "pending"
            done = "named" if stage.on_request else done
            print(f"{stage.name:18s} {done:8s} ~{stage.minutes:g} min  {stage.what}")
        return 0
    if not args.dry_run and len(args.stages) > args.max_stages:
        parser.error(
            f"{len(args.stages)} stages named; a device call returns {CALL_FILES} files, "
            f"enough for {args.max_stages} stages (--max-stages)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ctx = Context(
        out=args.out,
        tree=args.tree,
        dry=args.dry_run,
        env=env,
        started=time.monotonic(),
        budget_s=args.budget_s,
        log=args.out / "setup.log",
        megatron_core=args.megatron_core,
    )
    ctx.log.write_text("")
    stages, notes = select(args.stages, args.tree, args.megatron_core)
    for note in notes:
        ctx.write_log(note)
    if not stages:
        ctx.write_log("nothing to run: every stage has results (name stages to run them again)")
        return 0
    if not setup(ctx, args.te_checks):
        ctx.write_log("setup failed; see above")
        return 1
    failed, ran = False, 0
    most = len(STAGES) if args.dry_run else args.max_stages
    for stage in stages:
        if ran == most:
            ctx.write_log(f"{stage.name}: for the next call ({most} stages a call)")
        elif not args.dry_run and ctx.remaining_s() < stage.minutes * 60:
            ctx.write_log(
                f"{stage.name}: not started, {ctx.remaining_s():.0f} s left of the "
                f"budget and it takes ~{stage.minutes:g} min"
            )
        else:
            ran += 1
            failed |= run_stage(ctx, stage)["status"] not in ("ok", "dry")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
