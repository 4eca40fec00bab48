"""Exact or summary: the one rule that chooses how every loss and fit gets the per-token quantities of q = z * s
(`ScaledCE`), and the one function that computes them by the chosen route.

- summary route: from the tokens' scale summary rows (`scale_summary`), no vocabulary-sized work;
- exact route: from the logits recomputed from the hidden states in chunks (`scaled_ce`), one full-vocabulary pass.

`summary_route` decides: the summary whenever the data carry one, unless the caller asks for the exact route (the
`exact_loss` training option, `shared_pass=False` fits, `exact=True` answer scoring); a head whose scales may exceed
the summary's range is refused rather than silently fitted on a clamped loss. The trainer, the held-out objective,
the token term of answer training, answer scoring, the calibrators' fitting source and the fingerprints all ask it.
"""

from __future__ import annotations

from torch import Tensor

from ..errors import ATSError
from .scale_summary import ScaleSummarySpec, scaled_ce_from_summary
from .scaled_ce import LogitsFn, ScaledCE, scaled_cross_entropy


def summary_route(spec: ScaleSummarySpec | None, *, exact: bool = False, max_scale: float | None = None,
                  where: str = "the features") -> bool:
    """Whether the per-token quantities come from the scale summary (else from the logits).

    Args:
        spec: the settings of the data's scale summary, or None when they carry none.
        exact: the caller asks for the exact route.
        max_scale: the largest scale the calibrator can apply (a head's clamp), checked against the summary's range;
            None: not checked.
        where: the data, named in the error.

    Returns:
        True for the summary route.

    Raises:
        ATSError: on the summary route, if `max_scale` exceeds the summary's.
    """
    if spec is None or exact:
        return False
    if max_scale is not None and max_scale > spec.max_scale:
        raise ATSError(f"the head's max_scale {max_scale:g} exceeds the scale summary's {spec.max_scale:g} of "
                       f"{where}; train with --exact-loss or extract the features with a larger summary max_scale")
    return True


def token_ce(hidden: Tensor, scale: Tensor, labels: Tensor, logits_fn: LogitsFn, *, chunk_size: int = 1024,
             summary: Tensor | None = None) -> ScaledCE:
    """The per-token quantities of q = z * scale for N tokens: from their summary rows when given (the summary
    route), else from the logits recomputed from `hidden` in chunks (the exact route).

    Args:
        hidden: (N, H) the tokens' hidden states (unused on the summary route).
        scale: (N,) s > 0, the only input with a gradient.
        labels: (N,) next-token ids.
        logits_fn: the output layer, h (n, H) -> z (n, V).
        chunk_size: tokens per logits chunk (exact route).
        summary: (N, D) the tokens' scale summary rows, or None.

    Returns:
        `ScaledCE` of the N tokens.

    Raises:
        ATSError: if the summary rows do not match the tokens.
    """
    if summary is None:
        return scaled_cross_entropy(hidden, scale, labels, logits_fn, chunk_size)
    if summary.dim() != 2 or summary.shape[0] != scale.shape[0]:
        raise ATSError(f"expected summary rows ({scale.shape[0]}, D), got {tuple(summary.shape)}")
    return scaled_ce_from_summary(summary, scale)
