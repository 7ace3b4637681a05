"""Offline demo data for post-training: questions about the standard library, answered by
its own docstrings (docs/post_training.md, section 5).

    python examples/chat_demo.py --output-dir demo_chat

writes ``sft_train.jsonl`` / ``sft_valid.jsonl`` (conversations), ``dpo_*.jsonl`` (preference
pairs) and ``qrpo_*.jsonl`` (rewarded completions); the validation files hold the prompts of
the last ``--valid`` callables, which the training files never ask about.

Every public function and class of a fixed list of standard-library modules that has a
docstring gives one conversation: the user asks what ``module.name`` does, the assistant
answers with the first paragraph of its docstring. The text is real (CPython's own
documentation), ships with every Python, and is the same for a given Python version.
Preference pairs (:func:`docstring_preferences`) pair the right answer with the same answer
in capitals; QRPO records (:func:`docstring_rewards`) score completions with a deterministic
reward, the share of words written as in the true answer.

What it can show: that fine-tuning teaches a small model the chat format and to answer with
text of the kind the assistant turns hold (the held-out assistant-token loss falls), and that
an alignment objective raises the held-out margin of the plain over the shouted answer. What
it cannot show: instruction following, helpfulness or any benchmark figure: the answers are
short, the model tiny, and held-out questions ask about functions it never saw.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import sys
from pathlib import Path

from megatron.apertus.cli import ArgumentParser, atomic_outputs, run

MODULES = (
    "builtins",
    "math",
    "os.path",
    "string",
    "itertools",
    "functools",
    "json",
    "re",
    "collections",
    "statistics",
    "textwrap",
    "shutil",
    "random",
    "bisect",
    "heapq",
    "operator",
    "fractions",
    "decimal",
    "datetime",
    "calendar",
    "base64",
    "binascii",
    "zlib",
    "difflib",
)
SYSTEM = "You answer questions about the Python standard library in one short paragraph."


def _first_paragraph(doc: str) -> str:
    """The first paragraph of a docstring that is prose (not a signature line)."""
    paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n")]
    for text in paragraphs:
        if text and "(" not in text.split(" ")[0] and len(text) > 20:
            return text
    return ""


def docstring_answers() -> list[tuple[str, str]]:
    """(qualified name, answer) for every documented public callable, in a fixed order."""
    answers = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if name.startswith("_") or not callable(obj) or not getattr(obj, "__doc__", None):
                continue
            answer = _first_paragraph(obj.__doc__)
            if answer and answer not in answers.values():
                answers[f"{module_name}.{name}"] = answer
    return sorted(answers.items())


def question(name: str) -> str:
    return f"What does `{name}` do in Python?"


def docstring_conversations() -> list[dict]:
    """One ``{"messages": [...]}`` record per documented callable."""
    return [
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question(name)},
                {"role": "assistant", "content": answer},
            ]
        }
        for name, answer in docstring_answers()
    ]


def shout(text: str, share: float, rng: random.Random) -> str:
    """``text`` with a ``share`` of its words, chosen at random, in capitals."""
    words = text.split()
    loud = set(rng.sample(range(len(words)), round(share * len(words))))
    return " ".join(w.upper() if i in loud else w for i, w in enumerate(words))


def case_reward(answer: str, truth: str) -> float:
    """A deterministic scorer: the share of the true answer's words that the answer writes
    exactly as the truth does (1.0 for the true answer, near 0 for one in capitals)."""
    words = truth.split()
    return sum(a == t for a, t in zip(answer.split(), words)) / max(len(words), 1)


def _prompt(name: str) -> list[dict]:
    """The system message and the question about callable ``name``."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(name)}]


def docstring_preferences(seed: int = 1234) -> list[dict]:
    """``{"prompt", "chosen", "rejected"}`` per callable: its answer against the same answer in
    capitals (a style preference, "do not shout", that a small model can learn and carry over
    to prompts it never saw)."""
    rng = random.Random(seed)
    records = []
    for name, answer in docstring_answers():
        prompt = _prompt(name)
        records.append({"prompt": prompt, "chosen": answer, "rejected": shout(answer, 1.0, rng)})
    return records


def docstring_rewards(seed: int = 1234, references: int = 8) -> list[dict]:
    """QRPO records: per callable, two completions (its answer with none and all of its words
    in capitals) with their :func:`case_reward`, and the rewards of ``references`` answers
    with a random share of capitals, standing for the reference policy's own samples."""
    rng = random.Random(seed)
    records = []
    for name, answer in docstring_answers():
        prompt = _prompt(name)
        ref_rewards = [
            case_reward(shout(answer, rng.random(), rng), answer) for _ in range(references)
        ]
        for share in (0.0, 1.0):
            completion = shout(answer, share, rng)
            records.append(
                {
                    "prompt": prompt,
                    "completion": completion,
                    "reward": case_reward(completion, answer),
                    "ref_rewards": ref_rewards,
                }
            )
    return records


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
        print(f"chat_demo.py: error: {out.parent} does not exist", file=sys.stderr)
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
