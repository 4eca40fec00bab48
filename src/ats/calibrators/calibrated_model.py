"""CalibratedModel: a frozen backbone and a trained ATS head as one module, `model(input_ids) -> q (B, T, V)`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..model.backbone import Backbone

if TYPE_CHECKING:
    from .ats import ATSCalibrator


class CalibratedModel(nn.Module):
    """A backbone + ATS head returning calibrated logits from a forward pass: `model(input_ids) -> q (B, T, V)`.

    Args:
        backbone: the frozen backbone.
        calibrator: an ATS calibrator trained for it.

    Raises:
        ATSError: if the calibrator was trained for another backbone.
    """

    def __init__(self, backbone: Backbone, calibrator: ATSCalibrator) -> None:
        super().__init__()
        calibrator.check_backbone(backbone)
        self.backbone, self.calibrator = backbone, calibrator

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Calibrated logits for a batch, without gradients.

        Args:
            input_ids: (B, T) token ids.
            attention_mask: (B, T), 1 on real tokens.

        Returns:
            q, (B, T, V).
        """
        hidden, _ = self.backbone.forward(input_ids, attention_mask)  # (B, T, H)
        return self.calibrator.calibrate(self.backbone.logits(hidden), hidden, attention_mask=attention_mask)
