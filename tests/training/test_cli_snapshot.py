"""The command line of ``pretrain_gpt.py`` is frozen in ``cli_flags.json``: every flag's
spellings, group, default, type and whether it is our addition. A change to the CLI (a new
field of a config dataclass, a renamed flag, another default) fails here until the snapshot is
regenerated, so it is always deliberate and visible in review. Regenerate with::

    python -m tests.training.test_cli_snapshot

The registry's own rules are checked too: every registered group's fields become flags with a
help text, a field's docstring is its help, and ``"ours"`` fields carry the addition mark.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

import pretrain_gpt
from megatron.apertus import cli, flags
from megatron.apertus.model.config import ParallelConfig
from megatron.apertus.training import config as C

SNAPSHOT = Path(__file__).with_name("cli_flags.json")


def flag_table(parser: argparse.ArgumentParser) -> list[dict]:
    """One entry per flag of ``parser``, in ``--help`` order (``--help`` itself left out)."""
    table = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction):
                continue
            table.append(
                {
                    "flags": action.option_strings,
                    "group": group.title,
                    "default": repr(action.default),
                    "type": getattr(action.type, "__name__", None),
                    "nargs": action.nargs,
                    "ours": (action.help or "").endswith(flags.ADDITION_MARK),
                }
            )
    return table


def current() -> list[dict]:
    return flag_table(pretrain_gpt.build_parser())


def test_command_line_matches_the_snapshot():
    frozen = json.loads(SNAPSHOT.read_text())
    now = current()
    added = [e["flags"] for e in now if e not in frozen]
    removed = [e["flags"] for e in frozen if e not in now]
    assert now == frozen, (
        f"pretrain_gpt.py's flags changed (new or changed: {added}; gone or changed: {removed}); "
        "if deliberate, regenerate: python -m tests.training.test_cli_snapshot"
    )


def test_every_flag_has_help():
    parser = pretrain_gpt.build_parser()
    missing = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert not missing


def test_every_field_of_every_registered_group_is_a_flag():
    flags = {f for entry in current() for f in entry["flags"]}
    for name, group in C.GROUPS.items():
        prefix = group.metadata["prefix"]
        for f in dataclasses.fields(C.group_class(name)):
            assert "--" + (prefix + f.name).replace("_", "-") in flags, (name, f.name)


@dataclass(kw_only=True, frozen=True)
class _NewGroup:
    plain: int = 3
    """What a docstring says becomes the help."""
    explained: str = flags.flag_help("metadata help wins", "x", ours=True)


def test_a_new_field_needs_nothing_but_its_declaration():
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser, _NewGroup, title="new", prefix="new_")
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["new_plain"] == "What a docstring says becomes the help."
    assert helps["new_explained"] == "metadata help wins" + flags.ADDITION_MARK
    args = parser.parse_args(["--new-plain", "5"])
    assert flags.from_arguments(_NewGroup, args, prefix="new_") == _NewGroup(plain=5)


@dataclass(kw_only=True, frozen=True)
class _ToolGroup:
    source: str
    """No default: a required flag."""
    kind: Literal["a", "b"] = "a"
    """Only the values it names."""
    skip: list[str] = flags.flag_help(
        "may be given without a value", default_factory=list, empty=True
    )
    keys: list[str] = flags.flag_help("one value at least", default_factory=list)


def test_required_choice_and_empty_list_flags_come_from_the_declaration(capsys):
    parser = cli.ArgumentParser(prog="tool.py")
    flags.add_arguments(parser, _ToolGroup, title="tool")
    args = parser.parse_args(["--source", "s", "--kind", "b", "--skip"])
    assert flags.from_arguments(_ToolGroup, args) == _ToolGroup(source="s", kind="b", skip=[])
    for argv, message in [
        (["--kind", "b"], "the following arguments are required: --source"),
        (["--source", "s", "--kind", "c"], "invalid choice: 'c'"),
        (["--source", "s", "--keys"], "--keys: expected at least one argument"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err


@dataclass(kw_only=True, frozen=True)
class _SelfParsingGroup:
    doubled: int = 0

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, title: str) -> None:
        parser.add_argument_group(title).add_argument("--half", type=int, default=1)

    @classmethod
    def from_flags(cls, args: argparse.Namespace, prefix: str, built: dict) -> "_SelfParsingGroup":
        return cls(doubled=2 * args.half + built["new"].plain)


def test_a_self_parsing_group_writes_and_reads_its_own_flags():
    """add_group/build_group ask a group with add_flags/from_flags, which sees the groups built
    before it; a plain dataclass gets the generated flags (no ``--doubled`` for the other)."""
    assert isinstance(_SelfParsingGroup, flags.SelfParsing)
    assert not isinstance(_NewGroup, flags.SelfParsing)
    parser = argparse.ArgumentParser()
    flags.add_group(parser, _NewGroup, title="new", prefix="new_")
    flags.add_group(parser, _SelfParsingGroup, title="own")
    assert {a.dest for a in parser._actions} == {"help", "new_plain", "new_explained", "half"}
    args = parser.parse_args(["--half", "4", "--new-plain", "5"])
    new = flags.build_group(_NewGroup, args, prefix="new_")
    own = flags.build_group(_SelfParsingGroup, args, built={"new": new})
    assert (new.plain, own.doubled) == (5, 13)


def test_model_and_layout_parse_themselves_through_the_registry():
    """The layout reads the model built before it: PP 2 x 2 layers per virtual stage of the
    tiny preset's 4 layers is one virtual stage per rank, the plain schedule (None)."""
    argv = ["--num-layers", "8", "--pipeline-model-parallel-size", "2"]
    parser = argparse.ArgumentParser()
    C.add_run_arguments(parser, ("model", "parallel"))
    args = parser.parse_args([*argv, "--num-layers-per-virtual-pipeline-stage", "2"])
    built = C.groups_from_arguments(args, ("model", "parallel"))
    assert built["model"].num_layers == 8
    assert built["parallel"].virtual_pipeline_model_parallel_size == 2
    args = parser.parse_args([*argv[2:], "--num-layers-per-virtual-pipeline-stage", "2"])
    assert C.groups_from_arguments(args, ("model", "parallel"))["parallel"] == (
        ParallelConfig(pipeline_model_parallel_size=2)
    )


def test_tools_read_the_same_flags_as_pretrain_gpt():
    """A tool's subset of groups parses as pretrain_gpt.py parses those flags."""
    argv = [
        "--train-iters",
        "7",
        "--global-batch-size",
        "16",
        "--seed",
        "3",
        "--split",
        "9,1,0",
        "--device",
        "cpu",
    ]
    parser = argparse.ArgumentParser()
    C.add_run_arguments(parser, ("training", "dataset"))
    subset = C.groups_from_arguments(parser.parse_known_args(argv)[0], ("training", "dataset"))
    whole = pretrain_gpt.parse_args(argv)
    assert subset == {"training": whole.training, "dataset": whole.dataset}


@pytest.mark.parametrize("name", sorted(C.GROUPS))
def test_registry_names_each_group_once(name):
    assert list(C.GROUPS).count(name) == 1 and C.GROUPS[name].metadata["title"]


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current(), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")
