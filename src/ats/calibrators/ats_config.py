"""ATSConfig: everything needed to rebuild an ATS head and to check it against a backbone, saved as the head's
calibrator_config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import __version__
from ..config import ConfigMixin, option
from ..errors import ATSError
from ..model.heads.config import MAX_SCALE, HeadConfig


@dataclass
class ATSConfig(ConfigMixin):
    """Everything needed to rebuild an ATS calibrator and to check it against a backbone."""

    head: HeadConfig = option(HeadConfig, "the head's type and sizes", cli=False)
    max_scale: float = option(MAX_SCALE, "clamp on exp(tau), the factor applied to the logits (the reference code's)",
                              low=0, low_open=True)
    base_model: str = option("unknown", "backbone name", cli=False)
    revision: str = option("unknown", "backbone revision", cli=False)
    hidden_size: int = option(0, "backbone hidden size", cli=False, low=0)
    vocab_size: int = option(0, "backbone vocabulary size", cli=False, low=0)
    library_version: str = option(__version__, "ats version that made it", cli=False)
    method: str = option("ats", "method name in tables (ats, selective-temperature, selective-linear)", cli=False)
    training: dict = option(dict, "the training settings, for the record", cli=False)

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field, the head config nested as a dict.

        Returns:
            {field name: value}.
        """
        return {**dataclasses.asdict(self), "head": self.head.to_dict()}

    @classmethod
    def from_dict(cls, data: dict, where: str = "config", **_) -> "ATSConfig":
        """The config of a saved head, the nested head config validated too.

        Args:
            data: the saved config (without "type"), as `to_dict` writes it.
            where: what the data came from, quoted in errors.
            **_: ignored (the `ConfigMixin.from_dict` signature).

        Returns:
            The validated config.

        Raises:
            ATSError: if `data` is not a dict, lacks "head", has an unknown key or an invalid value.
        """
        if not isinstance(data, dict):
            raise ATSError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if "head" not in data:
            raise ATSError(f"{where}: missing field 'head'")
        data = dict(data)
        data["head"] = HeadConfig.from_dict(data["head"], where=f"{where}: head")
        return super().from_dict(data, where)
