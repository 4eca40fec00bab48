"""The calibrator registry: every method, ATS included, under a name; classes are imported only when used.

    build_calibrator("temperature")                    # a fresh, unfitted calibrator
    calibrator_for("thermometer", source)              # sized for a FitSource (then .fit(source))
    load_calibrator("runs/smol/head")                  # any saved calibrator, by the "type" in its config

A name maps to a class and preset options: `selective-temperature` and `selective-linear` are ATS with a constant
(one global temperature) or linear head, trained exactly like the ATS head they are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ATSError
from ..lazy import load
from .saving import CONFIG_NAME, OFFICIAL_LAYOUT, saved_type

if TYPE_CHECKING:
    from .base import Calibrator, FitSource


@dataclass(frozen=True)
class Entry:
    """A registered name: the class it builds and the constructor options every instance of the name gets."""

    target: str  # "module:Class", relative to this package
    preset: dict = field(default_factory=dict)  # options every instance of this name gets
    help: str = ""

    def load(self) -> type[Calibrator]:
        """Import the class on first use.

        Returns:
            The calibrator class named by `target`.
        """
        return load(self.target, __name__)


REGISTRY: dict[str, Entry] = {}


def register(name: str, target: str, *, help: str = "", **preset) -> None:
    """Register a calibrator class ("module:Class") under `name`, with preset constructor options.

    Args:
        name: the registry name (`--method` values, table rows); an existing entry is replaced.
        target: "module:Class", the module relative to this package (".temperature:TemperatureScaling").
        help: a one-line description for listings.
        **preset: keyword-only constructor options every instance of `name` gets.
    """
    REGISTRY[name] = Entry(target, preset, help)


register("none", ".base:Uncalibrated", help="the backbone as it is")
register("temperature", ".temperature:TemperatureScaling", help="one temperature, NLL (Guo et al. 2017)")
register("vector", ".vector:VectorScaling", help="per-class scale and bias, NLL")
register("scaling-binning", ".binning:ScalingBinning", help="temperature, then equal-mass bins (Kumar et al. 2019)")
register("histogram", ".binning:HistogramBinning", help="equal-mass bins of the confidence -> accuracy")
register("isotonic", ".isotonic:IsotonicCalibration", help="monotone map of the confidence -> accuracy")
register("thermometer", ".thermometer:Thermometer", help="one temperature per prompt (Shen et al. 2024)")
register("probe", ".probe:CorrectnessProbe",
         help="answer confidence by a logistic probe on several layers' hidden states; tokens by one temperature")
register("ats", ".ats:ATSCalibrator", help="adaptive temperature scaling (the run's head and loss)")
register("selective-temperature", ".ats:ATSCalibrator", head_type="constant", method="selective-temperature",
         help="control: ONE temperature trained with ATS's loss, data and schedule")
register("selective-linear", ".ats:ATSCalibrator", head_type="linear", method="selective-linear",
         help="control: a linear per-token head trained with ATS's loss, data and schedule")

# the post-hoc methods fitted beside ATS (`ats.workflows.pipeline.fit_calibrators`' default, the experiments' tables)
BASELINES = ("temperature", "vector", "scaling-binning", "histogram", "isotonic", "thermometer")


def names() -> list[str]:
    """Every registered name.

    Returns:
        The names, in registration order.
    """
    return list(REGISTRY)


def entry(name: str) -> Entry:
    """The registry entry of `name`.

    Args:
        name: a registered name.

    Returns:
        Its `Entry`.

    Raises:
        ATSError: if `name` is not registered (the error lists the known names).
    """
    if name not in REGISTRY:
        raise ATSError(f"calibrator: unknown name {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def calibrator_class(name: str) -> type[Calibrator]:
    """The class registered under `name` (its preset options are not applied).

    Args:
        name: a registered name.

    Returns:
        The calibrator class.

    Raises:
        ATSError: if `name` is not registered.
    """
    return entry(name).load()


def build_calibrator(name: str, **options) -> Calibrator:
    """A fresh (unfitted) calibrator; `options` are its keyword-only constructor arguments.

    Args:
        name: a registered name.
        **options: constructor options; they override the name's preset.

    Returns:
        The unfitted calibrator.

    Raises:
        ATSError: if `name` is not registered or an option is unknown or invalid.
    """
    return _construct(name, options, lambda cls, merged: cls(**merged))


def _construct(name: str, options: dict, make) -> Calibrator:
    """`make(cls, preset | options)` for the registered `name`; a TypeError (unknown option) becomes `ATSError`."""
    item = entry(name)
    try:
        return make(item.load(), {**item.preset, **options})
    except TypeError as err:  # an unknown or positional option
        raise ATSError(f"calibrator {name!r}: bad options {sorted(options)} ({err})") from None


def calibrator_for(name: str, source: FitSource, **options) -> Calibrator:
    """As `build_calibrator`, but sized for the data of `source` (fit it with `.fit(source)`).

    Args:
        name: a registered name.
        source: the data it will be fitted on (backbone, hidden size).
        **options: as for `build_calibrator`.

    Returns:
        The unfitted calibrator.

    Raises:
        ATSError: as `build_calibrator`.
    """
    return _construct(name, options, lambda cls, merged: cls.for_source(source, **merged))


# types that load from a saved folder but are not names to fit: the paper's released heads, converted (and in their
# own layout, `saving.OFFICIAL_LAYOUT`)
SAVED_TYPES: dict[str, Entry] = {"ats-official": Entry(".official:OfficialATSCalibrator",
                                                        help="the paper's released heads (docs/official_heads.md)")}
SAVED_TYPES[OFFICIAL_LAYOUT] = SAVED_TYPES["ats-official"]


def saved_class(directory: Path) -> type[Calibrator]:
    """The class of the calibrator saved in `directory`, by the "type" of its calibrator_config.json; a folder in
    the layout of the paper's code (`saving.saved_type`) is an `OfficialATSCalibrator`.

    Args:
        directory: a local calibrator folder.

    Returns:
        The class whose `from_pretrained` reads it.

    Raises:
        ATSError: if the config is missing or invalid or its "type" is not a class name in the registry.
    """
    kind = saved_type(directory)
    loadable = {**{n: e for n, e in REGISTRY.items() if not e.preset}, **SAVED_TYPES}
    if kind not in loadable:
        known = [k for k in loadable if k != OFFICIAL_LAYOUT]
        raise ATSError(f"{directory / CONFIG_NAME}: field 'type' is {kind!r}; known: {', '.join(known)}")
    return loadable[kind].load()


def load_calibrator(directory: str | Path, backbone=None) -> Calibrator:
    """Load any saved calibrator, of the class its folder names (`saved_class`); with `backbone`, check that it
    matches.

    A folder in the layout of the paper's code (config.json with "calibration_type" + calibration_head.safetensors)
    is read as an `OfficialATSCalibrator`. A name that is not a local folder but has the shape owner/name is a Hub
    repo id, read from the Hugging Face cache or downloaded (`ats.hub.resolve_folder`); local folders come first.

    Args:
        directory: the calibrator's folder (as written by `save_pretrained`, or the official layout), or a Hub id.
        backbone: the `Backbone` it will be applied to, or None to skip the check.

    Returns:
        The loaded calibrator.

    Raises:
        ATSError: if the config is missing or invalid, its "type" is not a class name in the registry, the weights
            do not match, the calibrator was fitted for another backbone, or a Hub id cannot be resolved.
    """
    return load(".base:Calibrator", __name__).from_pretrained(directory, backbone=backbone)


def __getattr__(name: str):  # the classes, imported on first use: `from ats.calibrators import TemperatureScaling`
    if name in ("Calibrator", "FitSource", "LogitChunks"):
        return load(f".base:{name}", __name__)
    for item in (*REGISTRY.values(), *SAVED_TYPES.values()):
        if item.target.endswith(":" + name):
            return item.load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BASELINES", "CONFIG_NAME", "Calibrator", "Entry", "FitSource", "LogitChunks", "REGISTRY", "SAVED_TYPES",
           "Uncalibrated", "build_calibrator", "calibrator_class", "calibrator_for", "entry", "load_calibrator",
           "names", "register", "saved_class"]
