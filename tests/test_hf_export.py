"""The Hugging Face export as a user meets it.

A real (tiny, two-step) training run saves a checkpoint that records its run; the export
writes the run's tokenizer, a generation config and a model card, world-readable. Read back
through ``transformers``, the tokenizer gives the ids our data pipeline wrote for real
documents, and lm-evaluation-harness (its ``hf`` model, offline, on a task built from
held-out text) computes the same log-likelihoods as our megatron-core model on the checkpoint.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import final_losses, read_run_info
from megatron.apertus.convert.hf_tokenizer import (
    TokenizerSource,
    tokenizer_source,
    tokenizer_type_of,
    write_hf_tokenizer,
)
from megatron.apertus.convert.model_card import MIN_TRANSFORMERS
from megatron.apertus.prep.corpus import training_documents
from megatron.apertus.prep.preprocess import PreprocessConfig, preprocess
from megatron.apertus.tokenizer.tokenizers import Tokenizer, build_tokenizer, bundled_tekken_path
from tests.conftest import PRETRAIN, cpu_models, run_entry

REPO = Path(__file__).resolve().parents[1]
EXPORT = REPO / "tools" / "checkpoint" / "export_hf.py"
# A wide init, so that every token (and the <s> in front) moves the log-likelihoods far beyond
# the comparison tolerance.
TRAIN = (
    "--model-preset tiny --init-method-std 0.05 --global-batch-size 4 --micro-batch-size 2 "
    "--train-iters 2 --eval-iters 1 --log-interval 1 --seed 7"
).split()
EXPORT_FILES = {
    "README.md",
    "chat_template.jinja",  # the Apertus chat format (tekken tokenizers)
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
LOGLIKELIHOOD_RTOL = 1e-6
"""Both sum float32 log-probabilities; 1e-6 is a few float32 roundings."""
TASK = "apertus_heldout"
HELD_OUT_DOCUMENTS = 8
WORD_SPACE = re.compile(r"(?<=\S) (?=\S)")
SPECIAL_LITERALS = "A web page may contain </s>, <s>, <pad> and [INST] as plain text."


@functools.cache
def corpus() -> tuple[str, ...]:
    """The embedded training corpus (parsing the standard library takes seconds: once)."""
    return tuple(training_documents())


def run_script(script: Path, *args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` of this tree (``PYTHONPATH`` wins over an installed copy of the package)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    preexec = None if umask is None else (lambda: os.umask(umask))
    cmd = [sys.executable, str(script), *args]
    return subprocess.run(
        cmd, cwd=REPO, env=env, preexec_fn=preexec, capture_output=True, text=True, timeout=600
    )


def succeeded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        pytest.fail(f"{shlex.join(proc.args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@dataclass(frozen=True)
class Exported:
    root: Path
    checkpoint: Path
    hf_dir: Path
    tokenizer: Tokenizer


FREQUENT = "frequent"
"""The training run's --non-persistent-global-ckpt-dir, beside its --save: non-persistent
checkpoints with no history of the run next to them."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Exported:
    """Train (non-persistent checkpoints at every step in a directory of its own, the persistent
    one at the end), then export the persistent one with the umask of a cautious user (077) and
    no --tokenizer."""
    root = tmp_path_factory.mktemp("export")
    ckpt, hf_dir = root / "ckpt", root / "hf"
    non_persistent = ["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval"]
    non_persistent += ["1", "--non-persistent-global-ckpt-dir", str(root / FREQUENT)]
    run_entry(PRETRAIN, [*TRAIN, *non_persistent, "--save", str(ckpt)])
    succeeded(run_script(EXPORT, "--load", str(ckpt), "--output", str(hf_dir), umask=0o077))
    return Exported(root, checkpoint.resolve_checkpoint(ckpt), hf_dir, build_tokenizer())


def test_export_is_complete_and_world_readable(exported):
    assert {p.name for p in exported.hf_dir.iterdir()} == EXPORT_FILES
    assert stat.S_IMODE(exported.hf_dir.stat().st_mode) == 0o755
    for path in exported.hf_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name
    left = sorted(p.name for p in exported.root.iterdir())
    assert left == ["ckpt", FREQUENT, "hf"]  # no temporary


def test_the_docs_list_exactly_the_exported_files():
    """docs/hf_interop.md's table of an export's files, and its count of them, match the export."""
    doc = (REPO / "docs" / "hf_interop.md").read_text()
    table = doc.split("## What an export holds")[1].split("\n\n")[1]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    assert {name for row in rows for name in re.findall(r"`([^`]+)`", row)} == EXPORT_FILES
    words = {6: "six", 7: "seven", 8: "eight"}
    assert f"exactly the {words[len(EXPORT_FILES)]} files above" in doc


def pipeline_documents(tmp_path: Path, documents: list[str]) -> list[list[int]]:
    """The ids ``tools/preprocess_data.py`` writes for ``documents``, read back by megatron-core."""
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), "utf-8")
    preprocess(PreprocessConfig(inputs=[source], output_prefix=str(tmp_path / "docs")))
    dataset = IndexedDataset(str(tmp_path / "docs_text_document"))
    return [np.array(dataset[i]).tolist() for i in range(len(dataset))]


def test_transformers_tokenizer_gives_the_pipeline_ids(exported, tmp_path):
    """Real documents (both sources of the embedded corpus): the export's tokenizer gives what
    the pipeline wrote, up to the end-of-document ``</s>``. Special-token strings in plain text
    are control tokens with transformers' defaults (as in the published Apertus tokenizer) and
    the pipeline's text ids with ``split_special_tokens=True``."""
    from transformers import AutoTokenizer

    documents = [*corpus()[:24], SPECIAL_LITERALS]
    tokenizer = AutoTokenizer.from_pretrained(str(exported.hf_dir))
    for text, ids in zip(documents, pipeline_documents(tmp_path, documents), strict=True):
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        assert tokenizer(text, split_special_tokens=True)["input_ids"] == ids[:-1]
        if text != SPECIAL_LITERALS:
            assert tokenizer(text)["input_ids"] == ids[:-1]
    literal = tokenizer(SPECIAL_LITERALS, split_special_tokens=True)["input_ids"]
    assert tokenizer.decode(literal[1:]) == SPECIAL_LITERALS
    assert tokenizer.eos_token_id in tokenizer(SPECIAL_LITERALS)["input_ids"]


def test_generation_config_and_model_card(exported):
    from transformers import GenerationConfig

    ours = exported.tokenizer
    config = json.loads((exported.hf_dir / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(str(exported.hf_dir))
    ids = (ours.bos, ours.eod, ours.pad)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == ids
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == ids
    run = read_run_info(exported.checkpoint)
    model = checkpoint.load_model_config(exported.checkpoint)
    card = (exported.hf_dir / "README.md").read_text()
    assert f"| training tokens | {run['consumed_tokens']:,} |" in card
    assert run["consumed_tokens"] == 2 * 4 * model.seq_length
    assert "| data (`--data-path`) | the embedded corpus" in card
    assert "TekkenTokenizer (the bundled tekken_240718.json)" in card
    assert f"| `hidden_size` | `{model.hidden_size}` |" in card
    assert f"| parameters | {model.num_parameters():,} |" in card
    assert shlex.join(run["command"]) in card and "--init-method-std 0.05" in card
    assert f"export_hf.py --load {exported.root / 'ckpt'} --output {exported.hf_dir}" in card
    assert card.startswith("---\nlicense: apache-2.0\n")
    assert "## Intended use" in card and "## Training data" in card
    history = json.loads((exported.root / "ckpt" / "metrics.json").read_text())
    (last, loss), (valid_at, valid) = history["train/loss"][-1], history["valid/loss"][-1]
    assert f"| final training loss | {loss:.4f} (iteration {last}) |" in card and last == 2
    assert f"| final validation loss | {valid:.4f} (iteration {valid_at}) |" in card
    minimum = f"transformers >= {MIN_TRANSFORMERS}"
    assert minimum in card and minimum in (REPO / "docs" / "hf_interop.md").read_text()


def test_final_losses_of_a_non_persistent_checkpoint(exported):
    """A non-persistent checkpoint in a directory of its own, where no history of the run lies
    beside it (the model card's losses): those up to it, from the history it holds. Its step,
    the last, is also the persistent checkpoint's; the validation at the end precedes both
    saves, so both hold it."""
    frequent = checkpoint.resolve_checkpoint(exported.root / FREQUENT)
    assert frequent.name == exported.checkpoint.name == "iter_0000002"
    assert not (frequent.parent / "metrics.json").exists()
    history = json.loads((exported.root / "ckpt" / "metrics.json").read_text())
    train, valid = (tuple(history[name][-1]) for name in ("train/loss", "valid/loss"))
    assert final_losses(frequent) == {"train/loss": train, "valid/loss": valid}
    assert final_losses(exported.checkpoint) == final_losses(frequent)


def test_checkpoint_without_run_record_needs_tokenizer(exported, tmp_path, capsys):
    """A conversion tool's checkpoint records no run: one line, exit 2, nothing written."""
    bare = tmp_path / "iter_0000002"
    shutil.copytree(exported.checkpoint, bare, copy_function=os.link)
    (bare / "apertus_run.json").unlink()
    tool = load_export_tool()
    assert tool.main(["--load", str(bare), "--output", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --tokenizer" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002"]


def load_export_tool():
    spec = importlib.util.spec_from_file_location("export_hf", EXPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bad_arguments_fail_in_one_line(exported, tmp_path, capsys):
    tool = load_export_tool()
    assert tool.main(["--load", str(exported.checkpoint), "--output", str(exported.hf_dir)]) == 2
    assert "already exists" in capsys.readouterr().err
    missing = tmp_path / "nowhere.model"
    args = ["--load", str(exported.checkpoint), "--output", str(tmp_path / "hf")]
    assert tool.main([*args, "--tokenizer", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--tokenizer {missing}" in err
    assert tool.main(["--load", str(tmp_path), "--output", str(tmp_path / "hf")]) == 2
    assert "holds no Apertus checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_tokenizer_override_families(tmp_path):
    """--tokenizer takes a SentencePiece model, a tokenizer.json and its directory: each written
    tokenizer gives <s> + our ids (write_hf_tokenizer itself refuses any difference)."""
    import mistral_common
    from transformers import AutoTokenizer

    spm = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    assert tokenizer_type_of(spm) == "SentencePieceTokenizer"
    assert tokenizer_type_of(bundled_tekken_path()) == "TekkenTokenizer"
    source = tokenizer_source(tmp_path, None, str(spm))
    assert (source.type, source.origin) == ("SentencePieceTokenizer", "--tokenizer")
    ids = write_hf_tokenizer(source, tmp_path / "spm", model_max_length=64, vocab_size=32768)
    assert (ids.bos, ids.eos, ids.pad) == (1, 2, 2)  # no pad piece: the end id pads
    json_file = tmp_path / "spm" / "tokenizer.json"
    assert tokenizer_type_of(json_file) == tokenizer_type_of(tmp_path / "spm")
    assert tokenizer_type_of(json_file) == "HuggingFaceTokenizer"
    for given in (json_file, tmp_path / "spm"):
        dest = tmp_path / f"hf-{given.name}"
        write_hf_tokenizer(
            TokenizerSource("HuggingFaceTokenizer", str(given), "--tokenizer"),
            dest,
            model_max_length=64,
            vocab_size=32000,
        )
        hf = AutoTokenizer.from_pretrained(str(dest))
        ours = build_tokenizer("SentencePieceTokenizer", str(spm))
        for text in corpus()[-4:]:
            assert hf(text)["input_ids"] == [ours.bos, *ours.encode(text)]
        literal = hf(SPECIAL_LITERALS, split_special_tokens=True)["input_ids"]
        assert literal == [ours.bos, *ours.encode(SPECIAL_LITERALS)]


def test_tokenizer_refusals(tmp_path):
    source = TokenizerSource("TekkenTokenizer", None, "--tokenizer")
    with pytest.raises(ValueError, match="131072 tokens, more than the model's vocabulary of 1000"):
        write_hf_tokenizer(source, tmp_path, model_max_length=64, vocab_size=1000)
    with pytest.raises(ValueError, match=r"used the tokenizer /gone/tok\.json.*pass --tokenizer"):
        run = {"tokenizer": {"type": "TekkenTokenizer", "model": "/gone/tok.json"}}
        tokenizer_source(tmp_path, run, None)
    (tmp_path / "vocab.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="neither a tekken JSON nor a tokenizer.json"):
        tokenizer_type_of(tmp_path / "vocab.json")


# ---- lm-evaluation-harness ----------------------------------------------------------------


def held_out_pairs(tokenizer: Tokenizer) -> list[dict[str, str]]:
    """(context, continuation) from the embedded corpus's last documents, which the default
    90/10 split holds out of training; each cut at a single space between words, where tokens
    split cleanly (lm-eval would move a context's trailing whitespace to the continuation)."""
    pairs = []
    for text in corpus()[-HELD_OUT_DOCUMENTS:]:
        cut = WORD_SPACE.search(text, 160).start()
        end = WORD_SPACE.search(text, cut + 120).start()
        context, continuation = text[:cut], text[cut:end]
        whole = tokenizer.encode(context + continuation)
        assert whole == tokenizer.encode(context) + tokenizer.encode(continuation)
        pairs.append({"context": context, "continuation": continuation})
    return pairs


def write_task(directory: Path, pairs: list[dict[str, str]]) -> None:
    """A local loglikelihood task: a JSON-lines file and its lm-eval YAML."""
    directory.mkdir()
    data = directory / "heldout.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs), "utf-8")
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n"
        "    higher_is_better: false\n"
    )


def lm_eval_loglikelihoods(hf_dir: Path, task_dir: Path, out: Path) -> list[tuple[float, bool]]:
    """(log-likelihood, is greedy) per document from ``lm-eval run --model hf``, offline."""
    cache = out / "hf_home"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(cache),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={hf_dir},dtype=float32",
        "--tasks",
        TASK,
        "--include_path",
        str(task_dir),
        "--device",
        "cpu",
        "--batch_size",
        "1",
        "--log_samples",
        # The samples are compared; the aggregate metrics' bootstrap overflows on a barely
        # trained model's perplexities (seen with Python 3.12's embedded corpus).
        "--predict_only",
        "--output_path",
        str(out / "results"),
    ]
    succeeded(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600))
    (samples,) = (out / "results").rglob(f"samples_{TASK}_*.jsonl")
    rows = sorted(
        (json.loads(line) for line in samples.read_text().splitlines()),
        key=lambda row: row["doc_id"],
    )
    return [(float(ll), greedy == "True") for ll, greedy in (r["filtered_resps"][0] for r in rows)]


def our_loglikelihoods(
    save: Path, sequences: list[tuple[list[int], list[int]]]
) -> list[tuple[float, bool]]:
    """Σ log p(continuation | context) and greedy-ness from our model on the checkpoint."""
    with cpu_models() as models:
        chunk = models.build(load=save).eval()
        results = []
        for context, continuation in sequences:
            tokens = torch.tensor([context + continuation])
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
            with torch.no_grad():
                logits = chunk(tokens[:, :-1], positions[:, :-1], None).float()
            logprobs = torch.log_softmax(logits[0, len(context) - 1 :], dim=-1)
            target = torch.tensor(continuation)
            picked = logprobs.gather(1, target.unsqueeze(1)).squeeze(1)
            greedy = bool((logprobs.argmax(-1) == target).all())
            results.append((picked.double().sum().item(), greedy))
        return results


def test_lm_eval_loglikelihood_equals_ours(exported, tmp_path):
    ours = exported.tokenizer
    pairs = held_out_pairs(ours)
    write_task(tmp_path / "task", pairs)
    theirs = lm_eval_loglikelihoods(exported.hf_dir, tmp_path / "task", tmp_path)
    tokens = [
        ([ours.bos, *ours.encode(p["context"])], ours.encode(p["continuation"])) for p in pairs
    ]
    # The same continuations without the <s> that training put first: the check can fail.
    without_bos = [(context[1:], continuation) for context, continuation in tokens]
    direct = our_loglikelihoods(exported.checkpoint, tokens + without_bos)
    direct, no_bos = direct[: len(tokens)], direct[len(tokens) :]
    assert len(theirs) == len(direct) == HELD_OUT_DOCUMENTS
    worst = max(abs(a - b) / abs(b) for (a, _), (b, _) in zip(theirs, direct))
    print(
        f"lm-eval vs ours: loglikelihoods {[round(b, 3) for b, _ in direct]}, "
        f"max relative difference {worst:.2e}"
    )
    assert worst <= LOGLIKELIHOOD_RTOL
    assert [g for _, g in theirs] == [g for _, g in direct]
    closest = min(abs(a - b) / abs(b) for (a, _), (b, _) in zip(theirs, no_bos))
    assert closest > 100 * LOGLIKELIHOOD_RTOL
