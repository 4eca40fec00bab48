"""Configs as dataclasses that validate themselves, serialise to JSON and generate their own CLI options.

Modelled on peft's `PeftConfigMixin`: every option is a dataclass field whose metadata carries its help text and its
checks, so the defaults, the validation and the `--help` of the command line come from one place:

    @dataclass
    class TrainingConfig(ConfigMixin):
        lr: float = option(1e-3, "peak learning rate", low=0, low_open=True)

    TrainingConfig(lr=-1)                       # ATSError: lr: expected a value in (0, inf], got -1
    TrainingConfig.add_arguments(parser)        # --lr LR  peak learning rate (default: 0.001)
    TrainingConfig.from_args(parser.parse_args())
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field

from .checks import check_choice, check_number
from .errors import ATSError

_CHECK_KEYS = ("low", "high", "low_open", "high_open")


def option(default, help: str, *, choices: Iterable | None = None, cli: bool = True, flag: str | None = None,
           unset: str = "automatic", **checks):
    """A config field with its help text and checks (`low`, `high`, `low_open`, `high_open`, `choices`).

    Args:
        default: the field's default; a mutable default (dict, list) is given as a zero-argument callable.
        help: the help text, shown by --help.
        choices: the allowed values, or None for any.
        cli: False keeps the field out of generated command-line options (sizes filled in from the backbone,
            records).
        flag: the command-line flag; default: `--` plus the field name with dashes.
        unset: what a None default means, for --help ("all", "automatic").
        **checks: range checks for numbers, as for `check_number` (`low`, `high`, `low_open`, `high_open`).

    Returns:
        A `dataclasses.Field` whose metadata carries the help, choices, flag and checks.

    Raises:
        TypeError: for a check other than `low`, `high`, `low_open`, `high_open`.
    """
    unknown = set(checks) - set(_CHECK_KEYS)
    if unknown:
        raise TypeError(f"option: unknown check(s) {sorted(unknown)}")
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "cli": cli, "flag": flag,
                "checks": checks, "unset": unset}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _base_type(annotation) -> type:
    """int / float / str / bool / dict ... from an annotation such as `float | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _base_type(args[0])
    return typing.get_origin(annotation) or annotation


@dataclass
class ConfigMixin:
    """Validation on construction, `to_dict` / `from_dict`, and `add_arguments` / `from_args` for the CLI."""

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def _types(cls) -> dict[str, type]:
        return {name: _base_type(t) for name, t in typing.get_type_hints(cls).items()}

    def validate(self) -> None:
        """Check every field against its metadata (None passes where the default is None).

        Numbers are stored back in their clean form (int or float).

        Raises:
            ATSError: naming the first field whose value fails its choices, range or type.
        """
        types = self._types()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            if not meta or (value is None and f.default is None):
                continue
            if meta.get("choices"):
                check_choice(f.name, value, meta["choices"])
            kind = types.get(f.name)
            if kind in (int, float):
                value = check_number(f.name, value, integer=kind is int, **meta.get("checks", {}))
                setattr(self, f.name, value)
            elif kind is bool and not isinstance(value, bool):
                raise ATSError(f"{f.name}: expected true or false, got {value!r}")
            elif kind is str and not isinstance(value, str):
                raise ATSError(f"{f.name}: expected a string, got {value!r}")

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field (nested configs as dicts).

        Returns:
            {field name: value}.
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "config", *, ignore: Iterable[str] = ()):
        """The config from `to_dict`'s output; an unknown key is an error naming `where` (a typo must not silently
        fall back to a default). Keys in `ignore` are dropped (fields of older versions).

        Args:
            data: {field name: value}, as `to_dict` writes it.
            where: what the data came from (a file, a section), quoted in errors.
            ignore: keys to drop before reading.

        Returns:
            The validated config.

        Raises:
            ATSError: if `data` is not a dict, has an unknown key, lacks a required field, or a value fails
                validation.
        """
        if not isinstance(data, dict):
            raise ATSError(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k not in set(ignore)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ATSError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        try:
            return cls(**data)
        except ATSError as err:
            raise ATSError(f"{where}: {err}") from None
        except TypeError as err:
            raise ATSError(f"{where}: {err}") from None

    def replace(self, **changes):
        """A validated copy with some fields changed.

        Args:
            **changes: {field name: new value}.

        Returns:
            A new config of the same class.

        Raises:
            ATSError: if a changed value fails validation.
        """
        return dataclasses.replace(self, **changes)

    # --- command line ---------------------------------------------------------------------------------------------
    @classmethod
    def cli_fields(cls) -> list[dataclasses.Field]:
        """The fields that get a command-line option (those made with `option(..., cli=True)`).

        Returns:
            The `dataclasses.Field`s, in declaration order.
        """
        return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                      exclude: Iterable[str] = (), defaults: dict | None = None) -> None:
        """Add one `--option` per CLI field, with the field's help, choices and default (`defaults` overrides).

        Args:
            parser: the parser or argument group to add to.
            exclude: names of fields to leave out.
            defaults: {field name: default} replacing the fields' own defaults.
        """
        types, exclude, defaults = cls._types(), set(exclude), defaults or {}
        for f in cls.cli_fields():
            if f.name in exclude:
                continue
            meta = f.metadata
            default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
            flag = meta.get("flag") or "--" + f.name.replace("_", "-")
            kind = types[f.name]
            help_text = meta["help"]
            if kind is bool:
                parser.add_argument(flag, dest=f.name, action="store_true", default=default, help=help_text)
                continue
            shown = meta.get("unset", "automatic") if default is None else default
            parser.add_argument(flag, dest=f.name, type=kind, default=default, choices=meta.get("choices"),
                                help=f"{help_text} (default: {shown})")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides):
        """The config from parsed arguments (fields the parser does not have keep their defaults).

        Args:
            args: the parsed arguments, with one attribute per CLI field added by `add_arguments`.
            **overrides: {field name: value} taking precedence over `args`.

        Returns:
            The validated config.

        Raises:
            ATSError: if a value fails validation.
        """
        values = {f.name: getattr(args, f.name) for f in cls.cli_fields() if hasattr(args, f.name)}
        return cls(**{**values, **overrides})
