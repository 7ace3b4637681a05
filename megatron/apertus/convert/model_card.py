"""The README.md model card of an export: what the model is and how it was made.

Everything comes from the checkpoint: the architecture from ``apertus_model.json``, the
training record from ``apertus_run.json`` (written by training saves; a checkpoint made by a
conversion tool or an older version has none, and the card says "unknown" for what only that
record holds). The front matter is the Hugging Face Hub's model-card metadata.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any, Sequence

from megatron.apertus.model.config import ApertusConfig

MIN_TRANSFORMERS = "5.0"
"""The oldest transformers that reads the export's ``rope_parameters`` (docs/hf_interop.md)."""
DEFAULT_LICENSE = "apache-2.0"
"""The Hub licence id of the published Apertus models; ``export_hf.py --license`` sets another."""
UNKNOWN = "unknown"
EMBEDDED_CORPUS = "the embedded corpus (Python's documentation and standard-library docstrings)"
MOCK_DATA = "megatron-core's synthetic MockGPTDataset (--mock-data)"


def _recorded(run_info: dict | None, key: str) -> Any:
    return UNKNOWN if run_info is None or run_info.get(key) is None else run_info[key]


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _data(run_info: dict | None) -> list[str]:
    if run_info is not None and run_info.get("mock_data"):
        return [MOCK_DATA]
    paths = _recorded(run_info, "data_path")
    if paths == UNKNOWN:
        return [UNKNOWN]
    return [f"`{p}`" for p in paths] or [EMBEDDED_CORPUS]


def _command(argv: Sequence[str] | None) -> str:
    return UNKNOWN if not argv else f"```bash\n{shlex.join(argv)}\n```"


def _validation_rows(losses: dict[str, tuple[int, float]]) -> list[tuple[str, str]]:
    """The final validation loss, or one per validation set (``valid/loss-NAME``)."""
    sets = sorted(name for name in losses if name.startswith("valid/loss-"))
    if not sets:
        return [("final validation loss", _loss(losses, "valid/loss"))]
    return [
        (f"final validation loss ({name.removeprefix('valid/loss-')})", _loss(losses, name))
        for name in sets
    ]


def _loss(losses: dict[str, tuple[int, float]], name: str) -> str:
    if name not in losses:
        return UNKNOWN
    iteration, value = losses[name]
    return f"{value:.4f} (iteration {iteration})"


def _table(rows: Sequence[tuple[str, Any]]) -> str:
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def model_card(
    *,
    name: str,
    model: ApertusConfig,
    checkpoint: Path,
    run_info: dict | None,
    tokenizer: str,
    dtype: str,
    export_command: Sequence[str] | None,
    losses: dict[str, tuple[int, float]] | None = None,
    license: str = DEFAULT_LICENSE,
) -> str:
    """README.md for the export directory ``name`` of ``checkpoint``; ``losses`` holds the last
    ``train/loss`` and ``valid/loss`` (or ``valid/loss-NAME`` per validation set) up to the
    checkpoint as (iteration, value)."""
    losses = losses or {}
    version = _recorded(run_info, "version")
    commit = _recorded(run_info, "git_commit")
    training = _table(
        [
            ("iteration", _count(_recorded(run_info, "iteration"))),
            ("consumed samples", _count(_recorded(run_info, "consumed_samples"))),
            ("training tokens", _count(_recorded(run_info, "consumed_tokens"))),
            ("sequence length", _count(_recorded(run_info, "seq_length"))),
            ("data (`--data-path`)", "<br>".join(_data(run_info))),
            ("final training loss", _loss(losses, "train/loss")),
            *_validation_rows(losses),
            ("tokenizer", tokenizer),
            ("megatron-apertus", f"{version} (git commit {commit})"),
        ]
    )
    architecture = _table(
        [("parameters", f"{model.num_parameters():,}")]
        + [(f"`{k}`", f"`{v}`") for k, v in sorted(dataclasses.asdict(model).items())]
    )
    return f"""---
license: {license}
library_name: transformers
pipeline_tag: text-generation
tags:
- apertus
- megatron-apertus
---

# {name}

An Apertus model (`ApertusForCausalLM`, transformers >= {MIN_TRANSFORMERS}) exported from the
megatron-apertus checkpoint `{checkpoint}` with weights in {dtype}.

## Licence

`{license}` (the Hub licence id given at export; the training data's own terms apply too).

## Intended use

A research checkpoint: a pretrained (base) language model for evaluation, analysis and further
training (fine-tuning, alignment, distillation). It is not instruction-tuned or safety-aligned
unless the training command below says so, and it is not meant to be put in front of end users
without an evaluation of its own.

## Training data

{"<br>".join(_data(run_info))}, {_count(_recorded(run_info, "consumed_tokens"))} tokens in
total (the `--data-path` of the run; a weighted list gives each dataset's share of the samples).

## Architecture

From the checkpoint's `apertus_model.json`:

{architecture}

## Training

From the checkpoint's `apertus_run.json` ("{UNKNOWN}" where the checkpoint does not record it):

{training}

The command that made the checkpoint:

{_command(run_info and run_info.get("command"))}

## Export

{_command(export_command)}

The tokenizer puts `<s>` before the text, as every training document began, and adds no `</s>`
(training documents end with it, prompts do not). Control strings written in the text (`</s>`,
`<|assistant_start|>`) become control tokens, as in the published Apertus tokenizer, while the
training pipeline kept them as text: pass `split_special_tokens=True` to reproduce its ids for
such text. With the Apertus chat template (tekken tokenizers) `apply_chat_template(...,
tokenize=True)` gives the ids chat training used.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{name}"  # this directory
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
inputs = tokenizer("The Python language", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))
```
"""
