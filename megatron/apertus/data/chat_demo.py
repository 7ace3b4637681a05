"""Offline demo data for post-training: questions about the standard library, answered by
its own docstrings.

Every public function and class of a fixed list of standard-library modules that has a
docstring gives one conversation: the user asks what ``module.name`` does, the assistant
answers with the first paragraph of its docstring. The text is real (CPython's own
documentation), ships with every Python, and is the same for a given Python version.
Preference pairs (:func:`docstring_preferences`) pair the right answer with the docstring of
another function of the same list.

What it can show: that fine-tuning teaches a small model the chat format and to answer with
text of the kind the assistant turns hold (the held-out assistant-token loss falls), and that
an alignment objective raises the margin of right over wrong answers. What it cannot show:
instruction following, helpfulness or any benchmark figure: the answers are short, the model
tiny, and held-out questions ask about functions it never saw.
"""

from __future__ import annotations

import importlib
import inspect
import random

MODULES = (
    "builtins", "math", "os.path", "string", "itertools", "functools", "json", "re",
    "collections", "statistics", "textwrap", "shutil", "random", "bisect", "heapq", "operator",
    "fractions", "decimal", "datetime", "calendar", "base64", "binascii", "zlib", "difflib",
)  # fmt: skip
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
        {"messages": [{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": question(name)},
                      {"role": "assistant", "content": answer}]}  # fmt: skip
        for name, answer in docstring_answers()
    ]


def docstring_preferences(seed: int = 1234) -> list[dict]:
    """``{"prompt": messages, "chosen": right answer, "rejected": another's}`` per callable."""
    answers = docstring_answers()
    rng = random.Random(seed)
    records = []
    for i, (name, answer) in enumerate(answers):
        j = rng.randrange(len(answers) - 1)
        other = answers[j + (j >= i)][1]
        prompt = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question(name)},
        ]
        records.append({"prompt": prompt, "chosen": answer, "rejected": other})
    return records


def overlap_reward(answer: str, truth: str) -> float:
    """A deterministic scorer: the share of the true docstring's distinct words that the
    answer contains (1.0 for the true docstring itself)."""
    words = set(truth.lower().split())
    return len(words & set(answer.lower().split())) / max(len(words), 1)


def docstring_rewards(seed: int = 1234, references: int = 8) -> list[dict]:
    """QRPO records: per callable, its right and one wrong answer, each with its reward, and
    the rewards of ``references`` other docstrings standing for the reference policy's own
    completions (an untrained policy answers with unrelated text)."""
    answers = docstring_answers()
    rng = random.Random(seed)
    records = []
    for i, (name, truth) in enumerate(answers):
        prompt = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question(name)},
        ]
        others = [answers[(i + 1 + rng.randrange(len(answers) - 1)) % len(answers)][1]
                  for _ in range(references + 1)]  # fmt: skip
        ref_rewards = [overlap_reward(text, truth) for text in others[1:]]
        for completion in (truth, others[0]):
            records.append({"prompt": prompt, "completion": completion,
                            "reward": overlap_reward(completion, truth), "ref_rewards": ref_rewards})  # fmt: skip
    return records
