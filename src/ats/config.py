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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

from .checks import check_choice, check_number
from .errors import ATSError, OptionError

_CHECK_KEYS = ("low", "high", "low_open", "high_open")


def option(default, help: str, *, choices: Iterable | None = None, cli: bool = True, flag: str | None = None,
           unset: str = "automatic", result: bool = True, **checks):
    """A config field with its help text and checks (`low`, `high`, `low_open`, `high_open`, `choices`).

    Args:
        default: the field's default; a mutable default (dict, list) is given as a zero-argument callable.
        help: the help text, shown by --help.
        choices: the allowed values, or None for any.
        cli: False keeps the field out of generated command-line options (sizes filled in from the backbone,
            records).
        flag: the command-line flag; default: `--` plus the field name with dashes.
        unset: what a None default means, for --help ("all", "automatic").
        result: False for an option that changes how work is done, never its result (batch sizes of a pass,
            checkpoint spacing): fingerprints leave it out (`ats.fingerprint.result_options`).
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
                "checks": checks, "unset": unset,
                "result": result}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _base_type(annotation) -> type:
    """int / float / str / bool / dict ... from an annotation such as `float | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _base_type(args[0])
    return typing.get_origin(annotation) or annotation


def check_field(name: str, value, kind: type | None, meta, *, none_ok: bool):
    """One field's value checked against its metadata (choices, range, type): `ConfigMixin.validate`'s rule.

    Args:
        name: the field's name, quoted in errors.
        value: the value.
        kind: int / float / str / bool / ..., from the field's annotation.
        meta: the field's metadata, as `option` makes it (`choices`, `checks`).
        none_ok: None passes (the field's default is None).

    Returns:
        The value, numbers in their clean form (int or float).

    Raises:
        ATSError: naming the field and the value.
    """
    if value is None and none_ok:
        return value
    if meta.get("choices"):
        check_choice(name, value, meta["choices"])
    if kind in (int, float):
        return check_number(name, value, integer=kind is int, **meta.get("checks", {}))
    if kind is bool and not isinstance(value, bool):
        raise ATSError(f"{name}: expected true or false, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ATSError(f"{name}: expected a string, got {value!r}")
    return value


class OptionType:
    """argparse's `type=` for a number option: the command-line text converted by `kind`, then `check(name, value)`
    (a validator of `ats.checks`), so a bad value stops parsing with that validator's message, before the command
    imports anything. Config fields get their range check (`ConfigMixin.add_arguments`); argparse checks `choices`.

        p.add_argument("--max-batch", type=OptionType("--max-batch", int, check_positive_int), default=16)

    Args:
        name: the option's name, quoted in errors (a config field's name, or a flag).
        kind: int or float.
        check: (name, value) -> the clean value; raises `ATSError`.
    """

    def __init__(self, name: str, kind: type, check: Callable[[str, int | float], int | float]) -> None:
        self.name, self.kind, self.check = name, kind, check
        self.__name__ = kind.__name__  # argparse names the type in "invalid float value: 'x'"

    def __call__(self, text: str) -> int | float:
        value = self.kind(text)  # a ValueError here is argparse's own "invalid int value" error
        try:
            return self.check(self.name, value)
        except ATSError as err:
            raise OptionError(str(err)) from None


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
            if f.metadata:
                setattr(self, f.name, check_field(f.name, getattr(self, f.name), types.get(f.name), f.metadata,
                                                  none_ok=f.default is None))

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
                      exclude: Iterable[str] = (), defaults: dict | None = None,
                      shown: dict[str, str] | None = None) -> None:
        """Add one `--option` per CLI field, with the field's help, choices and default (`defaults` overrides); a
        number is checked against the field's range as it is parsed (`OptionType`).

        Args:
            parser: the parser or argument group to add to.
            exclude: names of fields to leave out.
            defaults: {field name: default} replacing the fields' own defaults.
            shown: {field name: the default as --help states it}, for a default the command chooses after parsing
                (one that depends on other options), which the field's own metadata cannot know.
        """
        types, exclude, defaults, shown_as = cls._types(), set(exclude), defaults or {}, shown or {}
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
            shown = shown_as.get(f.name, meta.get("unset", "automatic") if default is None else default)
            parse = kind
            if kind in (int, float):
                parse = OptionType(f.name, kind, partial(check_number, integer=kind is int, **meta.get("checks", {})))
            parser.add_argument(flag, dest=f.name, type=parse, default=default, choices=meta.get("choices"),
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
