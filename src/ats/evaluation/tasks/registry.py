"""The task registry (lm-eval's `register_task` style): every place that lists, parses or builds tasks reads it.

The built-in tasks are registered below by "module:Class", imported when a task is built, so the names load without
torch (the CLI's --help); a task defined elsewhere registers its class with `@register_task(name)`. A plain task is
named by its spec ('mmlu'); a parametric one ('mc:PATH[:mode]') registers a prefix and a parser that turns the rest
of the spec into constructor arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...errors import ATSError
from ...lazy import load


@dataclass(frozen=True)
class TaskEntry:
    """One registered task: its name, its class (or "module:Class" of this package, imported on first use), how its
    spec reads (`forms`), and, for a parametric task, the parser (or "module:function") of the text after 'NAME:'
    into positional constructor arguments."""

    name: str
    target: type | str
    forms: tuple[str, ...]
    parse: Callable[[str, str], tuple] | str | None = None

    @property
    def cls(self) -> type:
        """The task class."""
        return load(self.target, __package__) if isinstance(self.target, str) else self.target

    def arguments(self, rest: str, spec: str) -> tuple:
        """The positional constructor arguments of a parametric spec: `parse(rest, spec)`."""
        parse = load(self.parse, __package__) if isinstance(self.parse, str) else self.parse
        return parse(rest, spec)


REGISTRY: dict[str, TaskEntry] = {}


def register_task(name: str, target: type | str | None = None, *, forms: tuple[str, ...] | None = None,
                  parse: Callable[[str, str], tuple] | str | None = None):
    """Register a task class under `name`; without `target`, a class decorator that registers the class.

    Args:
        name: the spec name ('mmlu'), or the prefix of a parametric spec ('mc' for 'mc:PATH').
        target: the class, or "module:Class" relative to this package (imported when first built).
        forms: how the spec is written, for help texts and errors (default: the name).
        parse: for a parametric task, (rest of the spec, the whole spec) -> positional constructor arguments (a
            function, or "module:function").

    Raises:
        ATSError: if the name is already registered to another class.
    """
    def add(cls: type | str) -> type | str:
        if name in REGISTRY and REGISTRY[name].target is not cls and REGISTRY[name].cls is not cls:
            raise ATSError(f"task {name!r} is already registered to {REGISTRY[name].cls.__name__}")
        REGISTRY[name] = TaskEntry(name, cls, forms or (name,), parse)
        return cls
    return add if target is None else add(target)


register_task("mmlu", ".mmlu:MMLUTask")
register_task("triviaqa", ".triviaqa:TriviaQATask")
register_task("nq_open", ".nq_open:NQOpenTask")
register_task("truthfulqa_mc1", ".truthfulqa:TruthfulQAMC1Task")
register_task("truthfulqa_gen", ".truthfulqa_gen:TruthfulQAGenTask")
register_task("mc", ".multiple_choice:MultipleChoiceTask", forms=("mc:PATH", "mc:PATH:letters", "mc:PATH:likelihood"),
              parse=".multiple_choice:parse_mc_spec")


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
        return entry, entry.arguments(rest, spec)
    if entry is not None and not sep and entry.parse is None:
        return entry, ()
    raise ATSError(f"unknown task {spec!r}; known: {', '.join(known_specs())}")
