"""Dataclass fields as command-line flags: the generator every unit's config is written for.

A config dataclass declares its flags by its fields: ``micro_batch_size`` becomes
``--micro-batch-size``, its type and default the flag's. A field's help is what
:func:`flag_help` (or :func:`switch`) gives it, else its docstring (the string literal after
it); ``ours=True`` marks a flag neither Megatron-LM nor the Apertus fork has, and ``--help``
says so (:data:`ADDITION_MARK`). A field without a default is a required flag, and a
``Literal[...]`` field takes only the values it names (argparse's ``choices``).
:func:`add_arguments` adds one dataclass's flags as an argument group, :func:`from_arguments`
builds the dataclass back from the parsed flags.

A group whose flags are more than its fields (the model's preset, the layout's Megatron-LM
spellings) parses itself: it provides the :class:`SelfParsing` methods, and :func:`add_group`
and :func:`build_group`, which every caller goes through, use them instead of the generator.
The generator itself knows no group by name.

This module sits on the ground floor, beside :mod:`megatron.apertus.errors`, and imports
nothing else of the package and no third-party package: every unit (model, data, optim, align,
quant, ...) declares its config next to its code without importing ``training/``, which only
collects the groups into one command line, and ``--help`` and argument errors start at once.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Mapping, Protocol, runtime_checkable

from megatron.apertus.errors import ConfigError

ALIASES = {
    "override_opt_param_scheduler": ["--override-opt_param-scheduler"],
    "use_checkpoint_opt_param_scheduler": ["--use-checkpoint-opt_param-scheduler"],
    "rope_scaling": ["--use-rope-scaling"],
    "fused_output_loss": ["--cross-entropy-loss-fusion"],
    "no_fp8_wgrad": ["--disable-fp8-wgrad"],
    "virtual_pipeline_model_parallel_size": ["--num-virtual-stages-per-pipeline-rank"],
    "top_k": ["--top_k"],
    "top_p": ["--top_p"],
}
"""Megatron-LM's own spellings, kept beside the generated flag names. A boolean's alias only
switches on, as Megatron-LM's does (``--cross-entropy-loss-fusion``: a fused cross-entropy, here
the fused output layer + loss)."""

NEGATIONS = {
    "manual_gc_eval": ["--disable-manual-gc-eval"],
    "log_loss_scale_to_tensorboard": ["--disable-log-loss-scale-to-tensorboard"],
}
"""Megatron-LM's other spelling of a ``--no-`` flag: it switches the (default on) field off."""

ADDITION_MARK = " [megatron-apertus addition]"
"""Ends the help of a flag neither Megatron-LM nor the Apertus fork has (``"ours"`` fields)."""


def flag_help(
    text: str,
    default: Any = dataclasses.MISSING,
    *,
    ours: bool = False,
    switch: bool = False,
    empty: bool = False,
    **kwargs: Any,
) -> Any:
    """A dataclass field with its flag's help: the one place that writes a field's metadata.

    ``ours``: a flag neither Megatron-LM nor the Apertus fork has (marked as our addition in
    ``--help``); ``switch``: a boolean flag that only switches on; ``empty``: a list's flag
    may be given without a value (an empty list); ``kwargs`` go to :func:`dataclasses.field`
    (``default_factory``).
    """
    metadata = {"help": text, "ours": ours, "switch": switch, "empty": empty}
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def switch(text: str, *, ours: bool = False) -> Any:
    """A boolean field whose flag, as in Megatron-LM, only switches on (no ``--no-`` form)."""
    return flag_help(text, False, ours=ours, switch=True)


def require(ok: bool, flag: str, value: Any, rule: str) -> None:
    """Refuse a flag's value in one line naming the flag and the rule it breaks."""
    if not ok:
        raise ConfigError(f"{flag} must be {rule}, got {value}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> type:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@functools.cache
def field_docstrings(cls: type) -> dict[str, str]:
    """The docstring of each field of dataclass ``cls`` and of its bases (the string literal
    right after the field), on one line."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_help(cls: type, f: dataclasses.Field) -> str:
    """A field's help: its metadata's, else its docstring; our additions carry the mark."""
    text = f.metadata.get("help") or field_docstrings(cls).get(f.name, "")
    return text + ADDITION_MARK if f.metadata.get("ours") else text


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    title: str,
    defaults: bool = True,
    prefix: str = "",
) -> argparse._ArgumentGroup:
    """Add one argument group with a flag ``--<prefix><field>`` per field of dataclass ``cls``."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _base_type(hints[f.name])
        name = prefix + f.name
        kwargs = dict(default=_default(f) if defaults else None, help=field_help(cls, f))
        if defaults and _required(f):
            kwargs.update(required=True)
        if typing.get_origin(kind) is typing.Literal:
            choices = typing.get_args(kind)
            group.add_argument(_flag(name), type=type(choices[0]), choices=choices, **kwargs)
        elif kind is bool:
            action = "store_true" if f.metadata.get("switch") else argparse.BooleanOptionalAction
            group.add_argument(_flag(name), action=action, **kwargs)
            spellings = [(alias, True, "") for alias in ALIASES.get(name, [])]
            spellings += [(alias, False, "no-") for alias in NEGATIONS.get(name, [])]
            for alias, value, negated in spellings:
                group.add_argument(
                    alias,
                    dest=name,
                    action="store_const",
                    const=value,
                    default=argparse.SUPPRESS,
                    help=f"Megatron-LM's spelling of --{negated}{name.replace('_', '-')}",
                )
        elif typing.get_origin(kind) is list:
            flags = [_flag(name), *ALIASES.get(name, [])]
            nargs = "*" if f.metadata.get("empty") else "+"
            group.add_argument(*flags, nargs=nargs, type=typing.get_args(kind)[0], **kwargs)
        else:
            group.add_argument(_flag(name), *ALIASES.get(name, []), type=kind, **kwargs)
    return group


def from_arguments(cls: type, args: argparse.Namespace, base: Any = None, prefix: str = "") -> Any:
    """Build ``cls`` from parsed flags; unset flags (None) fall back to ``base`` or the default."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, prefix + f.name, None)
        if value is not None:
            values[f.name] = value
    if base is not None:
        return dataclasses.replace(base, **values)
    return cls(**values)


@runtime_checkable
class SelfParsing(Protocol):
    """A config group class that adds and reads its own flags (both class methods)."""

    def add_flags(self, parser: argparse.ArgumentParser, title: str) -> None:
        """Add the group's flags under ``title`` in ``--help``."""

    def from_flags(self, args: argparse.Namespace, prefix: str, built: Mapping[str, Any]) -> Any:
        """The group from parsed flags; ``built``: the groups built before it, by name (the
        layout reads the model's)."""


def add_group(parser: argparse.ArgumentParser, cls: type, *, title: str, prefix: str = "") -> None:
    """The flags of config group ``cls``: its own (:class:`SelfParsing`), else its fields'."""
    if isinstance(cls, SelfParsing):
        cls.add_flags(parser, title)
    else:
        add_arguments(parser, cls, title=title, prefix=prefix)


def build_group(
    cls: type,
    args: argparse.Namespace,
    *,
    prefix: str = "",
    built: Mapping[str, Any] | None = None,
) -> Any:
    """Config group ``cls`` from parsed flags: by its own reading (:class:`SelfParsing`), else
    field by field; ``built``: the groups built before it, by name."""
    if isinstance(cls, SelfParsing):
        return cls.from_flags(args, prefix, built or {})
    return from_arguments(cls, args, prefix=prefix)


def given_destinations(parser: argparse.ArgumentParser, argv: list[str]) -> frozenset[str]:
    """The destinations ``argv`` sets itself, told apart from defaults (equal values included):
    argparse fills in a default only where the namespace holds nothing yet, so in a namespace
    filled with a marker beforehand the marker stays exactly where no flag was given."""
    unset = object()
    probe = argparse.Namespace(**{action.dest: unset for action in parser._actions})
    parser.parse_known_args(argv, probe)
    return frozenset(name for name, value in vars(probe).items() if value is not unset)
