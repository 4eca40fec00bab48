"""The task registry (lm-eval's `register_task` style): a task class registers its spec name once, with a decorator,
and every place that lists, parses or builds tasks reads the registry.

A plain task is named by its spec ('mmlu'); a parametric one ('mc:PATH[:mode]') registers a prefix and a parser
that turns the rest of the spec into constructor arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...errors import ATSError


@dataclass(frozen=True)
class TaskEntry:
    """One registered task: its name, its class, how its spec reads (`forms`), and, for a parametric task, the parser
    of the text after 'NAME:' into positional constructor arguments."""

    name: str
    cls: type
    forms: tuple[str, ...]
    parse: Callable[[str, str], tuple] | None = None


REGISTRY: dict[str, TaskEntry] = {}


def register_task(name: str, *, forms: tuple[str, ...] | None = None,
                  parse: Callable[[str, str], tuple] | None = None):
    """Class decorator: register a task class under `name`.

    Args:
        name: the spec name ('mmlu'), or the prefix of a parametric spec ('mc' for 'mc:PATH').
        forms: how the spec is written, for help texts and errors (default: the name).
        parse: for a parametric task, (rest of the spec, the whole spec) -> positional constructor arguments.

    Raises:
        ATSError: if the name is already registered to another class.
    """
    def decorate(cls: type) -> type:
        if name in REGISTRY and REGISTRY[name].cls is not cls:
            raise ATSError(f"task {name!r} is already registered to {REGISTRY[name].cls.__name__}")
        REGISTRY[name] = TaskEntry(name, cls, forms or (name,), parse)
        return cls
    return decorate


def known_specs() -> tuple[str, ...]:
    """Every registered spec form: plain tasks first, then parametric ones, each in registration order."""
    entries = sorted(REGISTRY.values(), key=lambda e: e.parse is not None)
    return tuple(form for entry in entries for form in entry.forms)


def resolve(spec: str) -> tuple[TaskEntry, tuple]:
    """(the registry entry, positional constructor arguments) of a task spec.

    Raises:
        ATSError: if the spec is not a non-empty string, names no registered task, or its parameters are bad.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ATSError(f"task spec must be a non-empty string, got {spec!r}; known: {', '.join(known_specs())}")
    spec = spec.strip()
    name, sep, rest = spec.partition(":")
    entry = REGISTRY.get(name)
    if entry is not None and sep and entry.parse is not None:
        return entry, entry.parse(rest, spec)
    if entry is not None and not sep and entry.parse is None:
        return entry, ()
    raise ATSError(f"unknown task {spec!r}; known: {', '.join(known_specs())}")
