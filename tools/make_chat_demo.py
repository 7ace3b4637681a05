"""Write the offline post-training demo data: standard-library questions answered by their
docstrings (docs/post_training.md, section 5).

    python tools/make_chat_demo.py --output-dir demo_chat

writes ``sft_train.jsonl`` / ``sft_valid.jsonl`` (conversations), ``dpo_*.jsonl`` (preference
pairs) and ``qrpo_*.jsonl`` (rewarded completions); the validation files hold the prompts of
the last ``--valid`` callables, which the training files never ask about.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron.apertus.cli import ArgumentParser, atomic_outputs, run
from megatron.apertus.data.chat_demo import (
    docstring_conversations,
    docstring_preferences,
    docstring_rewards,
)


def write(path: Path, records: list[dict]) -> None:
    with atomic_outputs(path) as (temporary,):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        Path(temporary).write_text(text, "utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--valid", type=int, default=55, help="held-out callables")
    args = parser.parse_args(argv)
    if args.valid < 0:
        parser.error(f"--valid {args.valid}: the number of held-out callables must be 0 or more")
    out = Path(args.output_dir)
    if not out.parent.is_dir():
        print(f"make_chat_demo.py: error: {out.parent} does not exist", file=sys.stderr)
        return 2
    sets = {
        "sft": (docstring_conversations(), 1),
        "dpo": (docstring_preferences(), 1),
        "qrpo": (docstring_rewards(), 2),
    }
    callables = len(sets["sft"][0])
    if args.valid > callables:
        parser.error(f"--valid {args.valid}: there are only {callables} callables to hold out")
    out.mkdir(exist_ok=True)
    for name, (records, per_callable) in sets.items():
        cut = len(records) - args.valid * per_callable
        write(out / f"{name}_train.jsonl", records[:cut])
        write(out / f"{name}_valid.jsonl", records[cut:])
        print(f"{name}: {cut} training and {len(records) - cut} held-out records")
    return 0


if __name__ == "__main__":
    run(main)
