"""The registry of trained method variants (lm-eval's `register_task` style): a decorated function lists a group's
variants once, and every workflow, plan default and record reads the registry.

A variant is a registry method (ats, selective-temperature, selective-linear), a head type and the training options
it changes. Groups: "selected" (the methods whose learning rate the evidence run selects on held-out data),
"tradeoff" (the trade-off figure's objectives, trained at the learning rate chosen for ATS) and one group per
ablation ("smoothing", "alpha", "head"), whose rows carry their table label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import ATSError
from ..model.heads import HEAD_TYPES
from ..training.config import TrainingConfig


@dataclass(frozen=True)
class Variant:
    """One trained variant: its name (its folder and its key in results), the registry method it trains, its head
    type (None: the method's preset), the training options it changes (in declaration order) and the method name
    its head records (`label`; None: the method's own, as heads trained before variants had names record)."""

    name: str
    method: str = "ats"
    head_type: str | None = None
    overrides: tuple[tuple[str, object], ...] = ()
    label: str | None = None

    @property
    def options(self) -> dict:
        """The training options it changes, as a dict (what records show)."""
        return dict(self.overrides)

    def training(self, base: TrainingConfig, **changes) -> TrainingConfig:
        """`base` with this variant's options, then `changes` (e.g. the learning rate), applied."""
        return base.replace(**{**self.options, **changes})


@dataclass(frozen=True)
class Row:
    """One row of a group: its label in tables and its variant."""

    label: str
    variant: Variant


GROUPS: dict[str, tuple[Row, ...]] = {}
ABLATION_GROUPS: list[str] = []  # the groups that are ablations (`ats ablate --ablations`), in registration order


def register_variants(group: str, *, ablation: bool = False) -> Callable:
    """Function decorator: the function returns a group's rows (`Row`, or a bare `Variant` labelled by its name),
    registered once under `group`; `ablation`: the group is one of the ablations.

    Raises:
        ATSError: if `group` is already registered.
    """
    def decorate(fn: Callable[[], Iterable[Row | Variant]]) -> Callable:
        if group in GROUPS:
            raise ATSError(f"variant group {group!r} is already registered")
        GROUPS[group] = tuple(r if isinstance(r, Row) else Row(r.name, r) for r in fn())
        if ablation:
            ABLATION_GROUPS.append(group)
        return fn
    return decorate


def rows(group: str) -> tuple[Row, ...]:
    """The rows of a registered group, in registration order.

    Raises:
        ATSError: if the group is unknown.
    """
    if group not in GROUPS:
        raise ATSError(f"unknown variant group {group!r}; known: {', '.join(GROUPS)}")
    return GROUPS[group]


def names(group: str) -> tuple[str, ...]:
    """The variant names of a group, in order."""
    return tuple(row.variant.name for row in rows(group))


def variant(group: str, name: str) -> Variant:
    """The variant `name` of `group`.

    Raises:
        ATSError: naming the group and the known names, if there is no such variant.
    """
    found = [row.variant for row in rows(group) if row.variant.name == name]
    if not found:
        raise ATSError(f"{group}: unknown variant {name!r}; known: {', '.join(names(group))}")
    return found[0]


# --- the evidence run -------------------------------------------------------------------------------------------------
@register_variants("selected")
def selected() -> list[Variant]:
    """The methods whose learning rate is selected on the held-out instruction split."""
    return [Variant("ats", label="ats"),
            Variant("ats-top-label", overrides=(("loss_type", "top-label"),), label="ats-top-label"),
            Variant("selective-temperature", "selective-temperature", label="selective-temperature"),
            Variant("selective-linear", "selective-linear", label="selective-linear")]


@register_variants("tradeoff")
def tradeoff() -> list[Variant]:
    """The trade-off figure's points: the selective loss at other alphas, and plain NLL."""
    return [*(Variant(f"selective-a{a:g}", overrides=(("alpha", a),), label=f"selective-a{a:g}")
              for a in (0.1, 0.3, 0.7, 0.9)),
            Variant("nll", overrides=(("loss_type", "none"),), label="nll")]


# --- the ablations ----------------------------------------------------------------------------------------------------
ALPHAS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class HeadRun:
    """One ablation configuration; `name` is its folder under heads/ and its method name in evaluate()."""

    head_type: str = "transformer"
    loss_type: str = "selective"
    alpha: float = 0.5

    @property
    def name(self) -> str:
        """The folder and method name: "<head>-<loss>-a<alpha>" ("<head>-<loss>" for losses without alpha)."""
        base = f"{self.head_type}-{self.loss_type}"
        return base if self.loss_type in ("none", "top-label") else f"{base}-a{self.alpha:g}"  # alpha unused there

    @property
    def variant(self) -> Variant:
        """The configuration as a variant: its head type, loss type and alpha."""
        return Variant(self.name, head_type=self.head_type,
                       overrides=(("loss_type", self.loss_type), ("alpha", self.alpha)))


@register_variants("smoothing", ablation=True)
def smoothing() -> list[Row]:
    """Smoothing type: none / full / selective (transformer head, alpha 0.5)."""
    return [Row(loss, HeadRun(loss_type=loss).variant) for loss in ("none", "full", "selective")]


@register_variants("alpha", ablation=True)
def alpha() -> list[Row]:
    """Smoothing weight alpha (selective loss, transformer head)."""
    return [Row(f"{a:g}", HeadRun(alpha=a).variant) for a in ALPHAS]


@register_variants("head", ablation=True)
def head() -> list[Row]:
    """Head architecture (selective loss, alpha 0.5)."""
    return [Row(h, HeadRun(head_type=h).variant) for h in HEAD_TYPES]


ABLATIONS = tuple(ABLATION_GROUPS)
