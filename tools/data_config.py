"""Print the ``--data-path`` list (``WEIGHT PREFIX ...``) of tokenized folders or mixtures.

    python tools/data_config.py mixtures/phase2 --output phase2.args
    python pretrain_gpt.py --data-args-path phase2.args ...

Each dataset is weighted by its tokens, so the blend draws from every dataset (and every source
of a mixture) in proportion to its size. ``--output`` writes the same list to a file for
``pretrain_gpt.py --data-args-path`` (written under a temporary name, then renamed).

Unlike the other data tools, its arguments are argparse's own, not generated from a config
dataclass (``megatron/apertus/flags.py``): the folders are positional, which the generator does
not make (it makes one ``--`` flag per field), and one generated ``--output`` beside them would
split two arguments between two mechanisms.
"""

from __future__ import annotations

import argparse
import sys

from megatron.apertus.cli import ArgumentParser, atomic_outputs, run
from megatron.apertus.prep.mixture import MixtureError, data_path_list


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", nargs="+", help="tokenized folders or mixtures")
    parser.add_argument("--output", default=None, help="file for --data-args-path")
    args = parser.parse_args(argv)
    try:
        data_path = data_path_list(args.folders)
    except MixtureError as err:
        print(f"data_config.py: error: {err}", file=sys.stderr)
        return 2
    text = "\n".join(f"{w} {p}" for w, p in zip(data_path[::2], data_path[1::2])) + "\n"
    if args.output:
        with atomic_outputs(args.output) as (temporary,):
            with open(temporary, "w", encoding="utf-8") as out:
                out.write(text)
    print(" ".join(data_path))
    return 0


if __name__ == "__main__":
    run(main)
