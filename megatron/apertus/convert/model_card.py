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

UNKNOWN = "unknown"
EMBEDDED_CORPUS = "the embedded corpus (Python's documentation and standard-library docstrings)"


def _recorded(run_info: dict | None, key: str) -> Any:
    return UNKNOWN if run_info is None or run_info.get(key) is None else run_info[key]


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _data(run_info: dict | None) -> list[str]:
    paths = _recorded(run_info, "data_path")
    if paths == UNKNOWN:
        return [UNKNOWN]
    return [f"`{p}`" for p in paths] or [EMBEDDED_CORPUS]


def _command(argv: Sequence[str] | None) -> str:
    return UNKNOWN if not argv else f"```bash\n{shlex.join(argv)}\n```"


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
) -> str:
    """README.md for the export directory ``name`` of ``checkpoint``."""
    version = _recorded(run_info, "version")
    commit = _recorded(run_info, "git_commit")
    training = _table(
        [
            ("iteration", _count(_recorded(run_info, "iteration"))),
            ("consumed samples", _count(_recorded(run_info, "consumed_samples"))),
            ("training tokens", _count(_recorded(run_info, "consumed_tokens"))),
            ("sequence length", _count(_recorded(run_info, "seq_length"))),
            ("data (`--data-path`)", "<br>".join(_data(run_info))),
            ("tokenizer", tokenizer),
            ("megatron-apertus", f"{version} (git commit {commit})"),
        ]
    )
    architecture = _table(
        [("parameters", f"{model.num_parameters():,}")]
        + [(f"`{k}`", f"`{v}`") for k, v in sorted(dataclasses.asdict(model).items())]
    )
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- apertus
- megatron-apertus
---

# {name}

An Apertus model (`ApertusForCausalLM`, transformers >= 4.56) exported from the megatron-apertus
checkpoint `{checkpoint}` with weights in {dtype}.

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
(training documents end with it, prompts do not); special-token strings in the text stay text.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{name}"  # this directory
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
inputs = tokenizer("The Python language", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))
```
"""
