"""The Hugging Face export and import tools on a cluster that fails: a full disk, a read-only
file system, an HF directory whose config.json was cut short. Each ends in one line naming
the directory the user asked for (not a temporary one), exit 2, and leaves nothing behind:
neither the output nor its temporary directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import pretrain_gpt
from megatron.apertus.training.loop import train
from tests.conftest import REPO, SMALL_VOCABULARY, run_script
from tests.prep.test_tool_errors import assert_one_line_exit_2

CHECKPOINT_TOOLS = REPO / "tools" / "checkpoint"
RUN = (
    "--model-preset tiny --global-batch-size 2 --micro-batch-size 1 --eval-iters 0 "
    "--train-iters 1 --seed 5"
).split()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The save directory of a one-step run of the tiny model on the small vocabulary."""
    save = tmp_path_factory.mktemp("export-faults") / "ckpt"
    train(pretrain_gpt.parse_args(RUN + SMALL_VOCABULARY + ["--save", str(save)]))
    return save


@pytest.fixture
def mount_tmpfs(tmp_path: Path):
    """``mount(name, options)``: a fresh tmpfs at ``tmp_path/name`` (root only)."""
    points = []

    def mount(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        points.append(point)
        return point

    yield mount
    for point in points:
        subprocess.run(["umount", str(point)], capture_output=True)


def tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return run_script(
        CHECKPOINT_TOOLS / name, list(args), env=dict(os.environ, OMP_NUM_THREADS="1")
    )


EXPORTS = {
    "export_hf.py": [],
    "export_quantized_hf.py": ["--quant-format", "int4", "--quant-group-size", "32"],
}


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_an_export_that_cannot_be_written_is_one_line_naming_the_output(saved, mount_tmpfs, disk):
    """A 1 MiB disk fills while model.safetensors (2 MiB) is written: safetensors raises its
    own error type, which ended in a traceback; a read-only one refuses the temporary
    directory, which the line named instead of the output."""
    volume = mount_tmpfs("disk", "size=1m" if disk == "full" else "size=1m,ro")
    for name, extra in EXPORTS.items():
        output = volume / "hf"
        proc = tool(name, "--load", str(saved), "--output", str(output), *extra)
        reason = "No space left on device" if disk == "full" else "Read-only file system"
        assert_one_line_exit_2(proc, f"{name}: error: {output}: {reason}")
        assert not list(volume.iterdir()), name


def test_an_export_that_fits_is_world_readable_and_named_as_asked(saved, tmp_path):
    """The quantized export rewrites model.safetensors after the plain export made the
    directory readable: it must stay readable, and the model card names the output, not the
    temporary directory it was written in."""
    for name, extra in EXPORTS.items():
        output = tmp_path / name.removesuffix(".py")
        proc = tool(name, "--load", str(saved), "--output", str(output), *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(p.name for p in tmp_path.iterdir() if ".tmp" in p.name) == []
        for path in output.iterdir():
            assert path.stat().st_mode & 0o777 == 0o644, (name, path.name)
        assert f"# {output.name}\n" in (output / "README.md").read_text()


def test_an_hf_directory_with_a_damaged_config_is_refused_naming_it(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"architectures": ["ApertusForCausalLM"],')
    save = tmp_path / "ckpt"
    proc = tool("import_hf.py", "--hf-dir", str(hf_dir), "--save", str(save))
    assert_one_line_exit_2(
        proc, f"import_hf.py: error: {hf_dir / 'config.json'}: not valid JSON (", "download it"
    )
    assert not save.exists()


WEIGHT_TOOLS = {
    "fuse_norms.py": [],
    "average_checkpoints.py": ["--last", "1"],
    "quantize.py": ["--method", "rtn", "--quant-format", "int4", "--quant-group-size", "32"],
}


def test_a_weights_tool_out_of_disk_leaves_no_directory_behind(saved, mount_tmpfs):
    """The tools that write a checkpoint refuse a disk too small in one line saying nothing
    was written; the --save directory they had made for it went away too (it stayed, empty,
    and a save interrupted by Ctrl-C or SIGTERM left its temporary directory in it)."""
    volume = mount_tmpfs("disk", "size=1m")
    for name, extra in WEIGHT_TOOLS.items():
        save = volume / "out"
        proc = run_script(
            REPO / "tools" / name,
            ["--load", str(saved), "--save", str(save), *extra],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert_one_line_exit_2(proc, f"{name}: error: {save}: no space left on device for ")
        assert "nothing was written" in proc.stderr
        assert not list(volume.iterdir()), name


def test_a_group_size_that_does_not_tile_the_rows_names_the_flag(saved, tmp_path):
    """quantize.py said "last dimension 64 is not a multiple of group size 128", naming no
    flag; it now says what the quantized export says, before anything is read."""
    save = tmp_path / "out"
    proc = run_script(
        REPO / "tools" / "quantize.py",
        ["--load", str(saved), "--save", str(save), "--method", "rtn", "--quant-format", "int4"],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert_one_line_exit_2(
        proc,
        "quantize.py: error: --quant-group-size 128 does not divide the 64 input features of "
        "model.layers.*.self_attn.q_proj",
    )
    assert not save.exists()
