"""Imports on first use, so that importing a package (and the CLI, which reads its tables) loads no torch.

`load("module:name", package)` imports one object named by a string (the registries of heads, tasks and calibrators
name their classes so); `lazy_exports(package, exports)` is a package's PEP 562 `__getattr__`: each public name is
imported from its module when it is first read.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module


def load(target: str, package: str | None = None):
    """The object `target` names.

    Args:
        target: "module:name"; the module absolute ("ats.model.heads.simple") or relative to `package` (".simple").
        package: the package a relative module is resolved against.

    Returns:
        The module's attribute `name`.
    """
    module, _, name = target.partition(":")
    return getattr(import_module(module, package), name)


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A package's module-level `__getattr__` that imports each of `exports` from its module on first use.

    Args:
        package: the package's `__name__`.
        exports: {public name: the module that defines it, absolute or relative to `package`}.

    Returns:
        The `__getattr__` function (AttributeError for a name not in `exports`).
    """

    def __getattr__(name: str):
        if name in exports:
            return load(f"{exports[name]}:{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
