"""The data tools on bad input and faults, as a user meets them: one line, exit 2, nothing lost.

Unwritable output directories, input with no usable line, Ctrl-C and SIGTERM in the middle of a
multi-process run, and weights that are not numbers; each tool runs as a real subprocess on
real text with the tekken tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron.apertus.prep.corpus import embedded_documents
from tests.conftest import (
    PRETRAIN,
    REPO,
    SMALL_TOKENIZER,
    SMALL_TOKENIZER_FLAGS,
    SMALL_VOCABULARY,
    run_script,
)

TOOLS = REPO / "tools"
NOBODY = 65534
TINY_RUN = "--model-preset tiny --global-batch-size 2 --micro-batch-size 1 --train-iters 1".split()


def tool(
    name: str, *args: str, prefix: tuple[str, ...] = (), **kwargs
) -> subprocess.CompletedProcess:
    kwargs.setdefault("env", dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    return subprocess.run(
        [*prefix, sys.executable, str(TOOLS / name), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )


def assert_one_line_exit_2(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(error_lines) == 1, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


def warm_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python tools/NAME ARGS``, forked from the warm interpreter (no torch import to pay)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return run_script(TOOLS / name, list(args), env=env, timeout=600)


def written_files(folder: Path) -> list[Path]:
    """What a tool left under ``folder``, its logs (datatrove's ``.datatrove``) aside."""
    return [p for p in folder.rglob("*") if p.is_file() and ".datatrove" not in p.parts]


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    path.chmod(0o644)
    return path


@pytest.fixture
def shared_dir():
    """A folder another user can read, with an output folder only its owner can write: the tool
    runs as ``nobody`` when the tests run as root (root writes anywhere)."""
    root = Path(tempfile.mkdtemp(prefix="tool-errors-"))
    root.chmod(0o755)
    (root / "out").mkdir(mode=0o755)
    if os.geteuid() != 0:
        (root / "out").chmod(0o555)
    yield root
    (root / "out").chmod(0o755)
    shutil.rmtree(root)


def as_other_user(root: Path) -> dict:
    if os.geteuid() != 0:
        return {}
    home = root / "home"
    home.mkdir(mode=0o777, exist_ok=True)
    home.chmod(0o777)
    if shutil.which("setpriv") is None:
        pytest.skip("running a tool as another user needs setpriv (util-linux)")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HOME=str(home))
    prefix = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
    probe = subprocess.run([*prefix, sys.executable, "-c", "pass"], capture_output=True, env=env)
    if probe.returncode != 0:  # e.g. an interpreter whose libraries only root can read
        pytest.skip(f"{sys.executable} does not start as another user")
    return dict(prefix=prefix, env=env)


def test_unwritable_output_directory_is_one_line_in_every_writing_tool(shared_dir):
    docs = [json.dumps({"text": d}) for d in embedded_documents()[:3]]
    source = jsonl(shared_dir / "corpus.jsonl", docs)
    out = shared_dir / "out"
    # datasets to merge and mix: written by this user, into a folder every user can read
    data = shared_dir / "data"
    data.mkdir(mode=0o755)
    made = warm_tool(
        "preprocess_data.py", "--input", str(source), "--output-prefix", str(data / "c")
    )
    assert made.returncode == 0, made.stderr[-2000:]
    for path in data.iterdir():
        path.chmod(0o644)
    runs = {
        "preprocess_data.py": ["--input", str(source), "--output-prefix", str(out / "c")],
        "tokenize_corpus.py": ["--input", str(source), "--output-dir", str(out / "tokens")],
        "merge_datasets.py": ["--input", str(data), "--output-prefix", str(out / "m")],
        "build_mixture.py": [
            "--folders",
            str(data),
            "--weights",
            "1",
            "--max-tokens",
            "10",
            "--output",
            str(out / "mix"),
        ],
    }
    for name, args in runs.items():
        proc = tool(name, *args, **as_other_user(shared_dir))
        assert_one_line_exit_2(proc, str(out))
        assert not list(out.iterdir()), name


@pytest.mark.parametrize(
    "content", ["", 'not json\n{"title": "no text"}\n\n'], ids=["empty", "all-malformed"]
)
def test_input_without_a_usable_line_writes_nothing(tmp_path, content):
    source = tmp_path / "in.jsonl"
    source.write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    runs = {
        "preprocess_data.py": [],
        "preprocess_chat.py": [],
        "preprocess_preferences.py": ["--objective", "dpo"],
    }
    for name, extra in runs.items():
        proc = warm_tool(name, "--input", str(source), "--output-prefix", str(out / "x"), *extra)
        expected = "all 3 lines were rejected" if content else "no lines; nothing written"
        assert_one_line_exit_2(proc, str(source), expected)
        assert not list(out.iterdir()), name


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "a directory, not a file"),
        ("", "no lines; nothing written"),
        ('not json\n{"title": "no text"}\n', "all 2 lines were rejected"),
    ],
    ids=["directory", "empty", "all-malformed"],
)
def test_tokenize_corpus_refuses_what_preprocess_data_refuses(tmp_path, content, expected):
    """A directory, an empty file or one without a usable line: both tools end in one line,
    and a rerun of tokenize_corpus is refused again rather than found complete."""
    source = tmp_path / "in.jsonl"
    if content is None:
        source.mkdir()
    else:
        source.write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    runs = [
        ("preprocess_data.py", "--output-prefix", str(out / "x")),
        ("tokenize_corpus.py", "--output-dir", str(out / "tokens")),
        ("tokenize_corpus.py", "--output-dir", str(out / "tokens")),
    ]
    for name, *output in runs:
        proc = warm_tool(name, "--input", str(source), *output)
        assert_one_line_exit_2(proc, f"--input {source}", expected)
        assert not written_files(out), name
        assert "wrote" not in proc.stdout


def _sigint_as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_preprocessing_ends_quietly_and_leaves_nothing(tmp_path, signum):
    """Ctrl-C reaches the whole process group (the workers too); SIGTERM the main process."""
    docs = embedded_documents()
    source = jsonl(tmp_path / "in.jsonl", [json.dumps({"text": d}) for d in docs * 20])
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        str(TOOLS / "preprocess_data.py"),
        "--input",
        str(source),
        "--output-prefix",
        str(out / "c"),
        "--workers",
        "2",
    ]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # Ctrl-C as at a terminal: a suite started in the background by a shell inherits SIGINT
        # ignored, and Python then installs no KeyboardInterrupt handler.
        preexec_fn=_sigint_as_at_a_terminal,
    )
    started = out / "c_text_document.tmp.bin"
    deadline = time.monotonic() + 300
    while (not started.exists() or started.stat().st_size == 0) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("preprocess_data.py: ")
    assert not list(out.iterdir())


@pytest.mark.parametrize("weight", ["nan", "inf", "-1"])
def test_mixture_weights_must_be_positive_finite_numbers(tmp_path, weight):
    proc = warm_tool(
        "build_mixture.py",
        "--folders",
        str(tmp_path),
        str(tmp_path),
        "--weights",
        weight,
        "1",
        "--max-tokens",
        "100",
        "--output",
        str(tmp_path / "mix"),
    )
    assert_one_line_exit_2(proc, f"--weights {float(weight)} 1.0", "positive finite number")
    assert not (tmp_path / "mix").exists()


def test_output_onto_a_directory_is_one_line_and_leaves_no_temporary(tmp_path):
    """The rename that completes an output fails (the final name is a directory): the error
    names that path, and the temporary file is gone with it."""
    source = jsonl(
        tmp_path / "in.jsonl", [json.dumps({"text": d}) for d in embedded_documents()[:2]]
    )
    data = tmp_path / "data"
    data.mkdir()
    made = warm_tool(
        "preprocess_data.py", "--input", str(source), "--output-prefix", str(data / "c")
    )
    assert made.returncode == 0, made.stderr[-2000:]
    existing = tmp_path / "phase2.args"
    existing.mkdir()
    proc = warm_tool("data_config.py", str(data), "--output", str(existing))
    assert_one_line_exit_2(proc, f"{existing}: Is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "in.jsonl", "phase2.args"]
    assert not list(existing.iterdir()) and not proc.stdout


def test_every_rejected_line_report_starts_a_line_of_its_own(tmp_path):
    """In a log file the progress bar's carriage returns erase nothing: ``grep FILE:LINE``
    must find the first report too, not only those after it."""
    good = {"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}
    source = jsonl(tmp_path / "in.jsonl", ["not json", json.dumps(good), "[]", json.dumps(good)])
    runs = {
        "preprocess_data.py": ["--json-keys", "chosen"],
        "preprocess_preferences.py": ["--objective", "dpo"],
    }
    for name, extra in runs.items():
        proc = warm_tool(
            name, "--input", str(source), "--output-prefix", str(tmp_path / "x"), *extra
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        reports = [line for line in proc.stderr.split("\n") if line.startswith(f"{source}:")]
        assert [r.split(": skipped")[0] for r in reports] == [f"{source}:1", f"{source}:3"], name


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A folder with one whole dataset (``c_text_document``) of a few documents."""
    folder = tmp_path_factory.mktemp("dataset")
    source = jsonl(
        folder.parent / "in.jsonl", [json.dumps({"text": d}) for d in embedded_documents()[:4]]
    )
    made = warm_tool(
        "preprocess_data.py",
        "--input",
        str(source),
        "--output-prefix",
        str(folder / "c"),
        *SMALL_TOKENIZER_FLAGS,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    return folder


def _cut(path: Path, size: int) -> str:
    original = path.stat().st_size
    os.truncate(path, size)
    return str(original)


DAMAGES = {
    ".bin cut short": (
        lambda p: _cut(p.with_suffix(".bin"), 10),
        "{p}.bin is damaged: 10 bytes, but c_text_document.idx describes {kept}",
    ),
    ".idx cut short": (
        lambda p: _cut(p.with_suffix(".idx"), 40),
        "{p}.idx is damaged or cut short (buffer is smaller than requested size)",
    ),
    ".meta.json not JSON": (
        lambda p: Path(f"{p}.meta.json").write_text('{"tokenizer": '),
        "{p}.meta.json is damaged (not JSON: ",
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_dataset_is_refused_by_every_tool_that_reads_it(dataset, tmp_path, damage):
    """A copy stopped half-way (the index or the data cut short) or a record overwritten: each
    reader names the damaged file in one line and writes nothing, where megatron-core's reader
    fails with a traceback, or, for a ``.bin`` cut short, does not notice and merges it."""
    data = Path(shutil.copytree(dataset, tmp_path / "data"))
    prefix = data / "c_text_document"
    damage_it, expected = DAMAGES[damage]
    expected = expected.format(p=prefix, kept=damage_it(prefix))
    out = tmp_path / "out"
    out.mkdir()
    mixture = ["--folders", str(data), "--weights", "1", "--max-tokens", "10"]
    runs = {
        TOOLS / "merge_datasets.py": ["--input", str(data), "--output-prefix", str(out / "m")],
        TOOLS / "build_mixture.py": [*mixture, "--output", str(out / "mix")],
    }
    if damage != ".meta.json not JSON":  # the record is read where tokenizers must match
        runs[TOOLS / "data_config.py"] = [str(data), "--output", str(out / "args")]
        train = ["--data-path", str(prefix), "--save", str(out / "ckpt")]
        runs[PRETRAIN] = [*TINY_RUN, *SMALL_VOCABULARY, *train]
    for script, args in runs.items():
        proc = run_script(script, args, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
        assert_one_line_exit_2(proc, expected)
        # the run's log (debug.log in --save) records the refusal; nothing else is written
        assert [p.name for p in written_files(out)] in ([], ["debug.log"]), script.name


def test_a_tokenizer_file_cut_short_is_refused_by_every_tokenizing_tool(tmp_path):
    """A ``tokenizer.json`` cut short (a download stopped half-way) is named in one line, as a
    missing one is, instead of ending in the tokenizers library's traceback."""
    broken = tmp_path / "tokenizer.json"
    broken.write_bytes(SMALL_TOKENIZER.read_bytes()[:100])
    source = jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "a line"})])
    out = tmp_path / "out"
    out.mkdir()
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(broken)]
    runs = {
        "preprocess_data.py": ["--output-prefix", str(out / "x")],
        "preprocess_chat.py": ["--output-prefix", str(out / "x")],
        "preprocess_preferences.py": ["--output-prefix", str(out / "x"), "--objective", "dpo"],
        "tokenize_corpus.py": ["--output-dir", str(out / "tokens")],
    }
    for name, args in runs.items():
        proc = warm_tool(name, "--input", str(source), *args, *flags)
        assert_one_line_exit_2(
            proc, f"--tokenizer-model {broken}: not a HuggingFaceTokenizer file (Exception("
        )
        assert not written_files(out), name


def test_preprocess_data_needs_at_least_one_worker(tmp_path):
    source = jsonl(tmp_path / "in.jsonl", [json.dumps({"text": "a line"})])
    for workers in ("0", "-2"):
        proc = warm_tool(
            "preprocess_data.py",
            "--input",
            str(source),
            "--output-prefix",
            str(tmp_path / "x"),
            "--workers",
            workers,
        )
        assert_one_line_exit_2(proc, f"--workers {workers}: must be at least 1")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_data_of_a_larger_vocabulary_is_refused_before_the_first_batch(tmp_path):
    """Data tokenized with the 131072-id tekken tokenizer, trained with a 4096-id one: its ids
    index past the embedding table (an IndexError traceback at the first batch on the CPU, a
    device-side assert on a GPU). Its record names the tokenizer that made it; the same data
    trains with that tokenizer (negative control)."""
    source = jsonl(
        tmp_path / "in.jsonl", [json.dumps({"text": d}) for d in embedded_documents()[:8]]
    )
    made = warm_tool(
        "preprocess_data.py", "--input", str(source), "--output-prefix", str(tmp_path / "t")
    )
    assert made.returncode == 0, made.stderr[-2000:]
    prefix = tmp_path / "t_text_document"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [*TINY_RUN, "--seq-length", "64", "--eval-iters", "0", "--data-path", str(prefix)]
    proc = run_script(PRETRAIN, [*args, *SMALL_VOCABULARY], env=env, timeout=600)
    assert_one_line_exit_2(
        proc,
        f"--data-path: {prefix} was tokenized with TekkenTokenizer ",
        f"(131072 ids, {prefix}.meta.json), but this run's tokenizer has 4096: preprocess it",
    )
    control = run_script(PRETRAIN, args, env=env, timeout=600)
    assert control.returncode == 0, control.stderr[-3000:]


def swapped_tokenizer(folder: Path) -> Path:
    """The small BPE with the ids of two ordinary pieces exchanged: another tokenizer of the
    same vocabulary size and file name, whose data a run of the original reads as other
    tokens."""
    spec = json.loads(SMALL_TOKENIZER.read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    folder.mkdir()
    (folder / SMALL_TOKENIZER.name).write_text(json.dumps(spec))
    return folder / SMALL_TOKENIZER.name


def tokenized(tmp_path: Path, name: str, tokenizer_flags: list[str]) -> Path:
    """Eight documents preprocessed with ``tokenizer_flags`` into ``tmp_path/name/``."""
    source = tmp_path / f"{name}.jsonl"
    if not source.exists():
        jsonl(source, [json.dumps({"text": d}) for d in embedded_documents()[:8]])
    (tmp_path / name).mkdir()
    output = tmp_path / name / "t"
    made = warm_tool(
        "preprocess_data.py",
        "--input",
        str(source),
        "--output-prefix",
        str(output),
        *tokenizer_flags,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    return tmp_path / name / "t_text_document"


def test_data_of_another_tokenizer_of_the_same_size_is_refused_before_training(tmp_path):
    """Data tokenized with another tokenizer of the same vocabulary size (two pieces' ids
    exchanged): every id is in range, so nothing failed and the run trained on wrong tokens.
    Its record's hash names the tokenizer; the refusal names both. A record written before
    records held the hash is still accepted (negative control, the check itself)."""
    other = swapped_tokenizer(tmp_path / "other")
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(other)]
    prefix = tokenized(tmp_path, "data", flags)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [*TINY_RUN, "--seq-length", "64", "--eval-iters", "0", "--data-path", str(prefix)]
    proc = run_script(PRETRAIN, [*args, *SMALL_VOCABULARY], env=env, timeout=600)
    record = json.loads(Path(f"{prefix}.meta.json").read_text())
    assert_one_line_exit_2(
        proc,
        f"--data-path: {prefix} was tokenized with HuggingFaceTokenizer tokenizer.json (sha256 "
        f"{record['tokenizer']['sha256'][:12]}) ({prefix}.meta.json), but this run's tokenizer "
        f"is {SMALL_TOKENIZER} (sha256 ",
        "preprocess it again with this run's --tokenizer-type and --tokenizer-model",
    )
    assert "iteration " not in proc.stdout, "refused before training"

    from megatron.apertus.data.indexed import check_tokenizer

    del record["tokenizer"]["sha256"]
    Path(f"{prefix}.meta.json").write_text(json.dumps(record))
    check_tokenizer("--data-path", str(prefix), 4096, SMALL_TOKENIZER)


def test_merge_and_mixture_refuse_datasets_of_different_tokenizers(tmp_path):
    """Two datasets of different tokenizers of the same size (and dtype) and one without a
    record: the merge refuses them even under --no-tokenizer-check (which lets the part
    without a record through, not the records that disagree), and so does a mixture, which
    compared the records only when every part had one. Once the records agree, the same
    folders mix (negative control)."""
    ours = tokenized(tmp_path, "ours", SMALL_TOKENIZER_FLAGS)
    other = swapped_tokenizer(tmp_path / "swapped")
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(other)]
    theirs = tokenized(tmp_path, "theirs", flags)
    parts = tmp_path / "parts"
    parts.mkdir()
    for name, prefix in (("a", ours), ("b", theirs), ("c", ours)):
        for suffix in (".bin", ".idx", ".meta.json"):
            shutil.copy(f"{prefix}{suffix}", parts / f"{name}{suffix}")
    (parts / "c.meta.json").unlink()

    def mix_everything():
        """build_mixture.py over the three parts, with a budget that takes all of them."""
        tokens = [json.loads(Path(f"{p}.meta.json").read_text())["tokens"] for p in (ours, theirs)]
        every = str(2 * tokens[0] + tokens[1])
        folders = ("--folders", str(parts), "--weights", "1", "--max-tokens", every)
        return warm_tool("build_mixture.py", *folders, "--output", str(tmp_path / "mix"))

    merged = warm_tool(
        "merge_datasets.py",
        "--input",
        str(parts),
        "--output-prefix",
        str(tmp_path / "m"),
        "--no-tokenizer-check",
    )
    assert_one_line_exit_2(
        merged,
        f"{parts / 'b'} was tokenized with HuggingFaceTokenizer tokenizer.json (sha256 ",
        f"{parts / 'a'} with HuggingFaceTokenizer",
        "datasets of different tokenizers do not mix",
    )
    assert not list(tmp_path.glob("m.*"))
    mixed = mix_everything()
    assert_one_line_exit_2(mixed, "the folders do not mix: ", "do not mix")
    (parts / "b.meta.json").unlink()
    shutil.copy(f"{ours}.meta.json", parts / "b.meta.json")
    mixed = mix_everything()
    assert mixed.returncode == 0, mixed.stderr[-2000:]


def test_preference_data_cut_short_is_refused_before_training(tmp_path):
    """megatron-core's IndexedDataset opens a ``.bin`` cut short without a word; alignment read
    past its end at the first batch of those examples."""
    pair = {
        "prompt": [{"role": "user", "content": "two plus two?"}],
        "chosen": "4",
        "rejected": "5",
    }
    source = jsonl(tmp_path / "pairs.jsonl", [json.dumps(pair)] * 8)
    made = warm_tool(
        "preprocess_preferences.py",
        *("--objective", "dpo", "--input", str(source), "--output-prefix", str(tmp_path / "d")),
        *SMALL_TOKENIZER_FLAGS,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    prefix = tmp_path / "d_pref_document"
    size = _cut(Path(f"{prefix}.bin"), 10)
    align = ["--align-objective", "dpo", "--no-fused-output-loss", "--eval-iters", "0"]
    args = [*TINY_RUN, *SMALL_VOCABULARY, *align, "--train-data-path", str(prefix)]
    proc = run_script(PRETRAIN, args, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert_one_line_exit_2(
        proc, f"{prefix}.bin is damaged: 10 bytes, but d_pref_document.idx describes {size}"
    )
