"""Weighted mixtures of tokenized folders, and the ``--data-path`` list that trains on them.

A mixture takes whole datasets (``.bin/.idx`` pairs) from each folder, in an order shuffled
with a seed, until the folder's share of the token budget (``weight / sum(weights) x
max_tokens``) is reached: each share is met or passed by less than the last dataset taken.
Datasets of earlier mixtures (``exclude``) are never taken again, so that successive training
phases see no document twice. The mixture folder holds symbolic links to the chosen datasets
(one subfolder per source folder) and ``mixture.json``, the record of the choice.

The blend of a mixture (:func:`data_path_list`) gives each source its weight, shared among its
datasets by their tokens, so that megatron-core's blended dataset draws from the sources at the
requested weights even where whole datasets overshoot a share.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron.apertus.data.indexed import read_index
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help
from megatron.apertus.prep.merge import MergeError, check_records, dataset_prefixes

MIXTURE_FILE = "mixture.json"


class MixtureError(ConfigError):
    """A mixture that cannot be built as asked; the message names the flag or folder."""


@dataclass(frozen=True)
class Part:
    """One dataset of a folder: its prefix and size."""

    prefix: str
    tokens: int
    documents: int

    def samples(self, seq_length: int) -> int:
        """Samples of one pass at ``seq_length`` (megatron-core's GPTDataset, one extra token
        for the last label)."""
        return max(self.tokens - 1, 0) // seq_length


def read_part(prefix: str) -> Part:
    """The size of ``prefix``, refused when damaged."""
    index = read_index("", prefix)
    return Part(prefix, int(index.sequence_lengths.sum()), len(index.document_indices) - 1)


def folder_parts(folder: str | os.PathLike) -> list[Part]:
    """The datasets directly in ``folder`` or in its subfolders (a mixture), sorted by path."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MixtureError(f"{folder} is not a directory")
    folders = [folder, *sorted(p for p in folder.iterdir() if p.is_dir() and p.name[0] != ".")]
    try:
        return [read_part(p) for f in folders for p in dataset_prefixes(f)]
    except MergeError as err:
        raise MixtureError(str(err)) from None


def identity(prefix: str) -> str:
    """A dataset's identity across mixtures: the real path of its ``.bin``."""
    return os.path.realpath(prefix + ".bin")


def select(parts: list[Part], budget: float, rng: np.random.Generator) -> list[Part]:
    """Whole datasets in shuffled order until ``budget`` tokens are reached."""
    chosen, tokens = [], 0
    for i in rng.permutation(len(parts)):
        if tokens >= budget:
            break
        chosen.append(parts[i])
        tokens += parts[i].tokens
    return sorted(chosen, key=lambda p: p.prefix)


@dataclass(kw_only=True, frozen=True)
class MixtureOptions:
    """``tools/build_mixture.py``'s flags: the arguments of :func:`build_mixture`."""

    folders: list[str] = flag_help("folders of .bin/.idx datasets (or earlier mixtures)", ours=True)
    weights: list[float] = flag_help("one per folder; normalised", ours=True)
    max_tokens: int = flag_help("token budget of the mixture (underscores allowed)", ours=True)
    exclude: list[str] = flag_help(
        "folders whose datasets must not be taken again",
        default_factory=list,
        ours=True,
        empty=True,
    )
    output: str = flag_help("the mixture folder (must not exist)", ours=True)
    seed: int = flag_help("shuffles each folder's datasets", 1234, ours=True)
    seq_length: int = flag_help("sequence length of the samples in the report", 4096, ours=True)


def build_mixture(
    folders: list[str],
    weights: list[float],
    max_tokens: int,
    output: str,
    *,
    exclude: list[str],
    seed: int,
    seq_length: int,
) -> dict:
    """Choose, link and record a mixture in ``output`` (written as ``output.tmp``, renamed)."""
    if len(weights) != len(folders):
        raise MixtureError(f"--weights: {len(weights)} weights for {len(folders)} --folders")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise MixtureError(
            f"--weights {' '.join(map(str, weights))}: each weight must be a "
            "positive finite number"
        )
    if max_tokens <= 0:
        raise MixtureError(f"--max-tokens {max_tokens}: must be positive")
    if Path(output).exists():
        raise MixtureError(f"--output {output} exists; mixtures are never overwritten")
    if not Path(output).absolute().parent.is_dir():
        raise MixtureError(f"--output: {Path(output).absolute().parent} does not exist")
    taken = {identity(p.prefix) for d in exclude for p in folder_parts(d)}
    rng = np.random.default_rng(seed)
    record = dict(
        folders=folders,
        weights=weights,
        max_tokens=max_tokens,
        exclude=exclude,
        seed=seed,
        seq_length=seq_length,
        sources=[],
    )
    chosen_all = []
    for folder, weight in zip(folders, weights):
        available = [p for p in folder_parts(folder) if identity(p.prefix) not in taken]
        budget = weight / sum(weights) * max_tokens
        if sum(p.tokens for p in available) < budget:
            raise MixtureError(
                f"{folder}: {sum(p.tokens for p in available)} tokens left (after "
                f"--exclude) for a share of {budget:.0f}"
            )
        chosen = select(available, budget, rng)
        chosen_all.extend(chosen)
        record["sources"].append(
            dict(
                folder=folder,
                weight=weight,
                budget=round(budget),
                tokens=sum(p.tokens for p in chosen),
                parts=[_part_entry(p, seq_length) for p in chosen],
            )
        )
    try:
        check_records([p.prefix for p in chosen_all])
    except MergeError as err:
        raise MixtureError(f"the folders do not mix: {err}") from None
    _write(output, record)
    return record


def _part_entry(part: Part, seq_length: int) -> dict:
    return dict(
        prefix=part.prefix,
        real_path=identity(part.prefix)[: -len(".bin")],
        tokens=part.tokens,
        documents=part.documents,
        samples=part.samples(seq_length),
    )


def _write(output: str, record: dict) -> None:
    tmp = Path(output + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _link_parts(tmp, output, record)
    except BaseException:  # errors, Ctrl-C, SIGTERM: no half-built mixture is left behind
        shutil.rmtree(tmp)
        raise
    os.replace(tmp, output)


def _link_parts(tmp: Path, output: str, record: dict) -> None:
    """Symbolic links to every chosen dataset, one folder per source, and ``mixture.json``."""
    for index, source in enumerate(record["sources"]):
        sub = tmp / f"{index:02d}-{Path(source['folder']).resolve().name}"
        sub.mkdir()
        for part in source["parts"]:
            real = part["real_path"]
            for suffix in (".bin", ".idx", ".meta.json"):
                if Path(real + suffix).is_file():
                    (sub / (Path(real).name + suffix)).symlink_to(real + suffix)
            part["link"] = str(Path(output) / sub.name / Path(real).name)
    (tmp / MIXTURE_FILE).write_text(json.dumps(record, indent=1))


def format_report(record: dict) -> str:
    """Tokens and samples per dataset at the mixture's sequence length, then per source."""
    seq = record["seq_length"]
    lines = [f"{'tokens':>14} {'samples@' + str(seq):>14}  dataset"]
    total = 0
    for source in record["sources"]:
        for part in source["parts"]:
            lines.append(f"{part['tokens']:>14,} {part['samples']:>14,}  {part['link']}")
    lines.append("")
    for source in record["sources"]:
        total += source["tokens"]
        lines.append(
            f"{source['folder']}: {len(source['parts'])} datasets, "
            f"{source['tokens']:,} tokens (share {source['budget']:,}, weight "
            f"{source['weight']})"
        )
    lines.append(f"mixture: {total:,} tokens for --max-tokens {record['max_tokens']:,}")
    return "\n".join(lines)


def data_path_list(folders: list[str]) -> list[str]:
    """Megatron's ``WEIGHT PREFIX ...`` list over every dataset of ``folders``.

    In a mixture, a dataset's weight is its source's weight times its share of the source's
    tokens, so the blend draws from the sources at the mixture's ``--weights``; elsewhere it is
    the dataset's tokens (megatron-core normalises the weights).
    """
    out = []
    for folder in folders:
        record_path = Path(folder) / MIXTURE_FILE
        if record_path.is_file():
            out += _mixture_data_path(Path(folder), json.loads(record_path.read_text()))
            continue
        parts = folder_parts(folder)
        if not parts:
            raise MixtureError(f"{folder}: no .bin/.idx datasets")
        for part in parts:
            out += [str(part.tokens), os.path.abspath(part.prefix)]
    return out


def _mixture_data_path(folder: Path, record: dict) -> list[str]:
    out = []
    total_weight = sum(s["weight"] for s in record["sources"])
    for index, source in enumerate(record["sources"]):
        sub = folder / f"{index:02d}-{Path(source['folder']).resolve().name}"
        for part in source["parts"]:
            weight = source["weight"] / total_weight * part["tokens"] / source["tokens"]
            prefix = sub / Path(part["real_path"]).name
            if not Path(str(prefix) + ".idx").exists():
                raise MixtureError(f"{folder}: {prefix}.idx of {MIXTURE_FILE} is missing")
            out += [f"{weight:.12g}", os.path.abspath(prefix)]
    return out
