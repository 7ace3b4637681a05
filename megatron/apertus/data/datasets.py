"""Training data through megatron-core's dataset builder: blends, splits, cached sample indices.

``--data-path`` takes Megatron's forms (``PREFIX ...`` or ``WEIGHT PREFIX WEIGHT PREFIX ...``),
or ``--data-args-path`` names a file holding that list (as in Megatron-LM, for long blends),
``--split`` the train/valid/test proportions by document; or, as in Megatron-LM, each part gets
its own blend (``--train-data-path``, ``--valid-data-path``, ``--test-data-path``), all of its
documents, with no split. Samples are megatron-core
``GPTDataset`` items; the attention layout and Goldfish mask are added per micro-batch in
:mod:`megatron.apertus.data.batches`, so the dataset's own dense attention masks stay off.

Every local prefix must name a whole ``.bin``/``.idx`` pair (:mod:`megatron.apertus.data.indexed`);
this is checked before megatron-core opens them (it would assert, or read past the end of a
``.bin`` cut short), naming the flag and the file.

Without a blend, the datasets are those of the corpus the caller hands in (``default_corpus``;
:mod:`megatron.apertus.training.runtime` hands in the embedded corpus of
:mod:`megatron.apertus.prep.corpus`): preparing a corpus is offline work, which the data that
training reads does not import.

``--mock-data`` (Megatron-LM's) trains on megatron-core's synthetic ``MockGPTDataset`` instead:
the builder is given no blend, which makes megatron-core's dataset config a mock one (its own
train/valid/test split, ``1,1,1``). Its documents are ``1, 2, ..., n-1`` followed by the end of
document token, with lengths drawn from a fixed seed, so document masking and
``--eod-mask-loss`` find their boundaries; the samples are shuffled with ``--seed`` and their
indices cached like a real dataset's.

torch and megatron-core are imported by the functions that use them: :class:`DatasetConfig`
serves ``--help`` and argument errors, which must not pay for them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from megatron.apertus.cache import default_cache_dir
from megatron.apertus.cli import check_output, exclusive
from megatron.apertus.data.indexed import check_tokenizer, read_index
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, switch

if TYPE_CHECKING:
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron.apertus.tokenizer.tokenizers import Tokenizer

log = logging.getLogger("apertus.data")


@dataclass(kw_only=True, frozen=True)
class DatasetConfig:
    data_path: list[str] = field(default_factory=list)
    """Megatron blend; empty means the embedded corpus (preprocessed on first use)."""
    data_args_path: str | None = flag_help(
        "file holding the --data-path list (whitespace-separated weights and "
        "prefixes), for blends too long for a command line",
        None,
    )
    """Megatron-LM's --data-args-path: the --data-path list read from a file."""
    split: str | None = None
    """Train/valid/test proportions by document; default 969,30,1 (90,10,0 on the embedded corpus)."""
    train_data_path: list[str] = field(default_factory=list)
    """Blend of the training part (instead of --data-path and --split)."""
    valid_data_path: list[str] = field(default_factory=list)
    """Blend of the validation part (instead of --data-path and --split)."""
    test_data_path: list[str] = field(default_factory=list)
    """Blend of the test part (instead of --data-path and --split)."""
    data_cache_path: str | None = None
    """Where megatron-core caches sample indices (and the embedded corpus is preprocessed)."""
    reset_position_ids: bool = False
    """Restart position ids at every document of a packed sample."""
    reset_attention_mask: bool = False
    """Packed documents never attend to each other (document masking)."""
    eod_mask_loss: bool = False
    """Leave the end-of-document positions out of the loss."""
    num_dataset_builder_threads: int = flag_help(
        "threads that build the sample indices of a blend's datasets (megatron-core's); the "
        "indices are the same for any number",
        1,
    )
    multiple_validation_sets: bool = switch(
        "validate on each --valid-data-path prefix on its own (prefixes without weights), with "
        "a loss per set"
    )
    validation_set_names: list[str] = flag_help(
        "with --multiple-validation-sets: one name per --valid-data-path prefix, used in the "
        "log lines and TensorBoard tags instead of 0, 1, ...",
        default_factory=list,
    )
    mmap_bin_files: bool = flag_help(
        "read the datasets' .bin files through a memory map; --no-mmap-bin-files reads each "
        "sample with a file read instead (for file systems where a memory map is slow)",
        True,
    )
    sft: bool = switch(
        "supervised fine-tuning on chat datasets from "
        "tools/preprocess_chat.py: the loss counts only the assistant's tokens"
    )
    mock_data: bool = switch(
        "train and validate on megatron-core's synthetic MockGPTDataset instead of --data-path: "
        "throughput runs without preprocessed data"
    )

    def __post_init__(self) -> None:
        self._check_mock_data()
        self._check_validation_sets()
        self._check_split()
        if self.num_dataset_builder_threads < 1:
            raise ValueError(
                f"--num-dataset-builder-threads must be >= 1, got {self.num_dataset_builder_threads}"
            )
        if self.per_split and (self.data_path or self.data_args_path or self.split):
            raise ValueError(
                "--train-data-path/--valid-data-path/--test-data-path give each part its own "
                "data: drop --data-path and --split (and --data-args-path)"
            )
        if self.data_path and self.data_args_path:
            raise ValueError("give the blend with --data-path or --data-args-path, not both")
        if self.data_args_path and not Path(self.data_args_path).is_file():
            raise ValueError(f"--data-args-path {self.data_args_path}: no such file")
        if self.data_cache_path:
            check_output("--data-cache-path", self.data_cache_path, directory=True)
        if self.per_split and not self.train_data_path:
            raise ValueError("--valid-data-path/--test-data-path need --train-data-path")
        if self.sft and not (self.data_path or self.train_data_path):
            raise ValueError(
                "--sft needs --data-path (or --train-data-path): a chat dataset written by "
                "tools/preprocess_chat.py, e.g. PREFIX_chat_document"
            )
        if self.reset_position_ids != self.reset_attention_mask:
            raise ValueError(
                "--reset-position-ids and --reset-attention-mask go together: documents are "
                "packed as separate sequences, so positions restart exactly where attention does"
            )

    def _check_validation_sets(self) -> None:
        """Megatron-LM's rules: the sets are the prefixes of --valid-data-path, unweighted, and
        names, if given, name each of them."""
        if self.validation_set_names and not self.multiple_validation_sets:
            raise ConfigError("--validation-set-names needs --multiple-validation-sets")
        if not self.multiple_validation_sets:
            return
        if not self.valid_data_path:
            raise ConfigError(
                "--multiple-validation-sets needs --valid-data-path PREFIX [PREFIX ...] (with "
                "--train-data-path): each prefix is a validation set"
            )
        if _is_number(self.valid_data_path[0]):
            raise ConfigError(
                "--multiple-validation-sets: --valid-data-path takes prefixes without weights "
                "(each set is validated on its own)"
            )
        names, sets = self.validation_set_names, len(self.valid_data_path)
        if names and len(names) != sets:
            raise ConfigError(
                f"--validation-set-names: {len(names)} names for the {sets} validation sets of "
                f"--valid-data-path"
            )

    def _check_split(self) -> None:
        """megatron-core reads the numbers in ``--split`` (``969,30,1``, ``99/1/0``) and
        normalises them: text with none, more than three, a lone '.' or only zeros fails inside
        it with a traceback (or divides by zero)."""
        if not self.split:
            return
        parts = re.findall(r"[.0-9]+", self.split)
        shares = [float(p) for p in parts if re.fullmatch(r"\d+\.?\d*|\.\d+", p)]
        plain = re.fullmatch(r"[.0-9,/\s]+", self.split) and len(shares) == len(parts)
        if not plain or not 1 <= len(shares) <= 3 or sum(shares) <= 0:
            raise ValueError(
                f"--split {self.split!r}: give up to three shares of train, validation and test "
                "(such as 969,30,1), not all zero"
            )

    def _check_mock_data(self) -> None:
        """--mock-data is the data: refuse the flags that name other data or split it."""
        if not self.mock_data:
            return
        given = [
            flag
            for flag, value in (
                ("--data-path", self.data_path),
                ("--data-args-path", self.data_args_path),
                ("--train-data-path", self.train_data_path),
                ("--valid-data-path", self.valid_data_path),
                ("--test-data-path", self.test_data_path),
                ("--split", self.split),
                ("--sft", self.sft),
            )
            if value
        ]
        if given:
            raise ConfigError(
                f"--mock-data trains on synthetic data with its own train/valid/test parts: "
                f"drop {' and '.join(given)}"
            )

    @property
    def per_split(self) -> bool:
        return bool(self.train_data_path or self.valid_data_path or self.test_data_path)

    def validation_set_suffixes(self) -> tuple[str, ...]:
        """What follows ``validation`` in the log line and TensorBoard tag of each validation
        set, as Megatron-LM writes it: ``-NAME`` or ``-INDEX`` per set, one empty suffix
        without --multiple-validation-sets."""
        if not self.multiple_validation_sets:
            return ("",)
        names = self.validation_set_names or [str(i) for i in range(len(self.valid_data_path))]
        return tuple(f"-{name}" for name in names)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class DefaultCorpus(Protocol):
    """The ``PREFIX`` of a corpus tokenized by ``tokenizer`` under ``cache``, prepared first when
    missing unless ``build`` is False (then only named, for the ranks that wait for rank 0)."""

    def __call__(self, cache: Path, tokenizer: Tokenizer, *, build: bool = True) -> Path: ...


def _index_cache_lock(cache: str) -> contextlib.AbstractContextManager:
    """Rank 0 holds ``cache``'s lock while megatron-core builds or reads the sample indices:
    megatron-core builds them on rank 0 while the other ranks wait, but two runs that share a
    cache (jobs on one node, test workers) would otherwise write the same index files at once."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return contextlib.nullcontext()
    return exclusive(Path(cache) / "build.lock")


def data_path_of(config: DatasetConfig) -> list[str]:
    """The --data-path list, or the one in the --data-args-path file (empty when neither)."""
    if config.data_args_path:
        return Path(config.data_args_path).read_text(encoding="utf-8").split()
    return list(config.data_path)


def check_full_validation(config: DatasetConfig) -> None:
    """A pass over the whole validation data (--full-validation) needs data with an end and
    an unweighted validation blend: megatron-core sizes a weighted blend by the samples asked
    of it, and a whole pass asks for none."""
    if config.mock_data:
        raise ConfigError("--full-validation: --mock-data is synthetic and has no end to reach")
    flag = "--valid-data-path" if config.per_split else "--data-path"
    blend = config.valid_data_path if config.per_split else data_path_of(config)
    if blend and _is_number(blend[0]) and len(blend) > 2:
        raise ConfigError(
            f"--full-validation: {flag} is a weighted blend, which megatron-core sizes by a "
            f"sample count; give its prefixes without weights to validate on all of them"
        )


def resolve_blend(
    config: DatasetConfig, tokenizer: Tokenizer, default_corpus: DefaultCorpus | None
) -> list[str]:
    """The data path to train on; without one, ``default_corpus``, prepared once by rank 0."""
    import torch.distributed as dist

    if data_path := data_path_of(config):
        return data_path
    if default_corpus is None:
        raise ValueError("no data path and no default corpus to train on")
    cache = Path(config.data_cache_path) if config.data_cache_path else default_cache_dir()
    if dist.get_rank() == 0:
        default_corpus(cache, tokenizer)
    dist.barrier()
    return [str(default_corpus(cache, tokenizer, build=False))]


def check_prefixes(
    flag: str, blend: list[str], *, sft: bool = False, tokenizer: Tokenizer | None = None
) -> None:
    """Refuse a prefix of ``blend`` (Megatron's ``[WEIGHT] PREFIX ...`` list, given as ``flag``)
    whose ``.bin`` or ``.idx`` is missing or damaged (:func:`.indexed.read_index`; with ``sft``,
    the same for its loss mask), or, given the run's ``tokenizer``, that was tokenized with
    another tokenizer or a larger vocabulary (:func:`.indexed.check_tokenizer`)."""
    from megatron.core.datasets.object_storage_utils import is_object_storage_path
    from megatron.core.datasets.utils import get_blend_from_list

    from megatron.apertus.data.sft import check_mask_pair

    prefixes, _ = get_blend_from_list(blend)
    for prefix in prefixes:
        if not is_object_storage_path(prefix):
            read_index(flag, prefix)
            if sft:
                check_mask_pair(flag, prefix)
            if tokenizer is not None:
                path = getattr(tokenizer, "path", None)  # none: ids only (NullTokenizer)
                check_tokenizer(flag, prefix, tokenizer.vocab_size, path)


SPLIT_NAMES = ("train", "valid", "test")
MAX_EPOCHS = 10_000
"""Passes over a split beyond which a request is refused: megatron-core would spend minutes
building indices that repeat a handful of documents (and never ends for an empty split)."""


def skip_unasked_splits(config: GPTDatasetConfig, num_samples: tuple[int, int, int]) -> None:
    """Build no part that is asked for no samples (the test part, as a rule).

    megatron-core builds every part of ``--split`` and asks each for at least one token (the
    extra token of a sample); a part without documents, such as the test part of ``969,30,1``
    on a corpus of fewer than 500 documents, then counts epochs forever. Dropping the part from
    the split matrix leaves the other parts' document ranges exactly as ``--split`` puts them.
    """
    for i, asked in enumerate(num_samples):
        if asked == 0:
            config.split_matrix[i] = None


def check_split_sizes(
    config: GPTDatasetConfig, seq_length: int, num_samples: tuple[int, int, int]
) -> None:
    """Refuse a ``--split`` part that is asked for samples but holds no tokens (megatron-core
    would count epochs forever) or so few that the request needs more than
    :data:`MAX_EPOCHS` passes over it; the message names the split, its documents and tokens
    in each dataset, and what was asked."""
    from megatron.core.datasets.indexed_dataset import _IndexReader
    from megatron.core.datasets.object_storage_utils import is_object_storage_path

    prefixes, weights = config.blend
    weights = weights or [1.0] * len(prefixes)
    total = sum(weights)
    for i, (name, asked) in enumerate(zip(SPLIT_NAMES, num_samples)):
        if asked == 0 or config.split_matrix[i] is None:
            continue
        asked = asked or 1  # None: one epoch, which needs at least one sample
        for prefix, weight in zip(prefixes, weights):
            if is_object_storage_path(prefix):
                continue
            index = _IndexReader(prefix + ".idx", multimodal=False)  # its arrays map its file
            count = len(index.sequence_lengths)
            begin, end = (int(round(bound * count)) for bound in config.split_matrix[i])
            tokens = int(index.sequence_lengths[begin:end].sum())
            del index
            # megatron-core asks each dataset of a blend for its weighted share (all of it alone)
            share = asked if len(prefixes) == 1 else math.ceil(asked * weight / total)
            needed = share * seq_length + 1
            if tokens == 0 or needed / tokens > MAX_EPOCHS:
                raise ConfigError(
                    f"--split {config.split}: the {name} split of {prefix} holds {end - begin} "
                    f"documents, {tokens} tokens, and is asked for {share} samples of "
                    f"{seq_length} tokens ({needed} tokens, "
                    + (f"{needed / tokens:,.0f} passes over it" if tokens else "none to give")
                    + f"); give the {name} split a larger share of --split (or --split with 0 "
                    f"for it), or ask for fewer {name} samples"
                )


def _blends(
    config: DatasetConfig, tokenizer: Tokenizer, default_corpus: DefaultCorpus | None
) -> dict:
    """The blend arguments of megatron-core's dataset config, their prefixes checked first:
    one blend per part, or one blend and its split, or none (--mock-data)."""
    from megatron.core.datasets.utils import get_blend_from_list

    if config.mock_data:
        return {}
    if config.per_split:
        parts = (config.train_data_path, config.valid_data_path, config.test_data_path)
        for name, part in zip(SPLIT_NAMES, parts):
            if part:
                check_prefixes(f"--{name}-data-path", part, sft=config.sft, tokenizer=tokenizer)
        return dict(blend_per_split=[get_blend_from_list(p) if p else None for p in parts])
    data_path = data_path_of(config)
    if data_path:
        flag = "--data-args-path" if config.data_args_path else "--data-path"
        check_prefixes(flag, data_path, sft=config.sft, tokenizer=tokenizer)
    return dict(
        blend=get_blend_from_list(resolve_blend(config, tokenizer, default_corpus)),
        split=config.split or ("969,30,1" if data_path else "90,10,0"),
    )


def _dataset_class(config: DatasetConfig) -> type:
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    from megatron.apertus.data.sft import ChatGPTDataset

    if config.mock_data:
        return MockGPTDataset
    return ChatGPTDataset if config.sft else GPTDataset


def build_datasets(
    config: DatasetConfig,
    tokenizer: Tokenizer,
    *,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int | None, int],
    default_corpus: DefaultCorpus | None = None,
) -> list[GPTDataset | None]:
    """[train, valid, test] datasets of at least ``num_samples`` samples each (None when 0 or
    when the split gives that part no documents; a count of None: one epoch of the part);
    without a blend, of ``default_corpus``;
    with --mock-data, megatron-core's synthetic ones. With --multiple-validation-sets the
    validation part is a list: megatron-core's dataset of each --valid-data-path prefix."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    if num_samples[1] is None:
        check_full_validation(config)
    cache = config.data_cache_path or str(default_cache_dir() / "indices")
    gpt_config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        **_blends(config, tokenizer, default_corpus),
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=config.mmap_bin_files,
        multiple_validation_sets=config.multiple_validation_sets,
        num_dataset_builder_threads=config.num_dataset_builder_threads,
    )
    if not config.per_split:
        skip_unasked_splits(gpt_config, num_samples)
        if not config.mock_data:
            check_split_sizes(gpt_config, seq_length, num_samples)
    builder = BlendedMegatronDatasetBuilder(
        _dataset_class(config), list(num_samples), lambda: True, gpt_config
    )
    with _index_cache_lock(cache):
        datasets = builder.build()
    built = [d if n is None or n > 0 else None for d, n in zip(datasets, num_samples)]
    if config.multiple_validation_sets and built[1] is not None and not isinstance(built[1], list):
        built[1] = [built[1]]  # megatron-core builds a single prefix as one dataset
    return built
