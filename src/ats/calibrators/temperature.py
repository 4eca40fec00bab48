"""Temperature scaling (Guo et al. 2017): one temperature T for every token, fitted by NLL; q = z / T.

The fit never holds all logits: it runs exact Newton steps on s = 1/T, one pass over the chunks per step. Per token
the loss is logsumexp(s z) - s z_y, so dL/ds = E_p[z] - z_y and d2L/ds2 = Var_p[z] >= 0 (p = softmax(s z)); the loss
is convex in s, and a bracket [lo, hi] on the root of dL/ds guards every step (bisection when Newton leaves it).

Two routes give the same Newton steps: the source's scale summary (per token the loss is G(s) + s (z_top - z_y), G
from the summary's piecewise quintic, no pass over the vocabulary at all) when it has one, else the logit chunks
(exact, one full-vocabulary pass per step). The summary covers 0 < s <= its max_scale (T >= 1 / max_scale, 0.1 by
default); an optimum beyond it is fitted on the chunks instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import check_positive_float
from ..config import ConfigMixin, option
from ..errors import ATSError
from ..model.scale_summary import SummaryView, scaled_ce_from_summary
from ._fitting import iter_chunks
from .base import Calibrator, LogitChunks

S_MIN, S_MAX = 1e-2, 1e2  # 1/T stays in [0.01, 100]: T in [0.01, 100]


def _work_dtype(logits: Tensor) -> Tensor:
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def nll_derivatives(chunks: LogitChunks, s: float) -> tuple[float, float, float, int]:
    """Mean NLL, dNLL/ds and d2NLL/ds2 at inverse temperature s over all tokens, in one pass.

    Args:
        chunks: a `LogitChunks` callable yielding logits (N, V) and labels (N,).
        s: the inverse temperature 1/T.

    Returns:
        (mean NLL, mean dNLL/ds, mean d2NLL/ds2, number of tokens).

    Raises:
        ATSError: if a chunk is malformed or there is no fitting token.
    """
    loss = grad = hess = 0.0
    n = 0
    for logits, labels in iter_chunks(chunks):
        z = _work_dtype(logits)  # (N, V)
        sz = z * s
        logp = torch.log_softmax(sz, dim=-1)
        p = logp.exp()
        z_y = z.gather(1, labels[:, None]).squeeze(1)  # (N,)
        mean_z = (p * z).sum(-1)  # (N,) E_p[z]
        var_z = (p * (z - mean_z[:, None]).square()).sum(-1)  # (N,) Var_p[z], centred for accuracy
        loss += float(-logp.gather(1, labels[:, None]).sum(dtype=torch.float64))
        grad += float((mean_z - z_y).sum(dtype=torch.float64))
        hess += float(var_z.sum(dtype=torch.float64))
        n += labels.numel()
    if n == 0:
        raise ATSError("chunks: no fitting tokens (every chunk was empty)")
    return loss / n, grad / n, hess / n, n


def summary_derivatives(summary: Tensor, s: float) -> tuple[float, float]:
    """Mean dNLL/ds and d2NLL/ds2 at inverse temperature s, from scale summary rows (in float64).

    Per token NLL(s) = CE(s z, y) = G(s) + s (z_top - z_y) (`scaled_ce_from_summary`); its derivatives are those of
    the summary's piecewise quintic, by autograd.

    Args:
        summary: (N, D) summary rows (float64 saves a conversion per call).
        s: the inverse temperature 1/T, in (0, max_scale].

    Returns:
        (mean dNLL/ds, mean d2NLL/ds2).
    """
    s_t = torch.tensor(float(s), dtype=torch.float64, requires_grad=True)
    loss = scaled_ce_from_summary(summary, s_t.expand(summary.shape[0])).ce_label.mean()
    (grad,) = torch.autograd.grad(loss, s_t, create_graph=True)
    (hess,) = torch.autograd.grad(grad, s_t)
    return float(grad.detach()), float(hess)


@dataclass
class TemperatureConfig(ConfigMixin):
    """Temperature scaling's options: the Newton steps' budget and tolerance."""

    max_passes: int = option(20, "the most Newton steps (each one pass over the chunks)", low=1)
    tol: float = option(1e-4, "stop when a step (or the bracket) is within this relative tolerance", low=0,
                        low_open=True)


class TemperatureScaling(Calibrator):
    """One temperature for every token: q = z / T, T fitted by NLL with guarded Newton steps on 1/T.

    Options: `TemperatureConfig` (max_passes, tol), keyword-only.
    """

    name = "temperature"
    Config = TemperatureConfig
    fits_on_summary = True
    fitted_keys = ("temperature",)
    fitted_attributes = ("temperature",)
    temperature: float | None = None  # T, once fitted
    passes_: int = 0  # Newton steps of the last fit

    def _fit(self, source) -> None:
        """Fit T by NLL (see the module docstring; T stays in [0.01, 100]): from the source's scale summary when it has
        one and the optimum lies within it, else on its logit chunks (one pass per Newton step). `passes_` counts the
        Newton steps.

        Raises:
            ATSError: if a chunk is malformed, there is no fitting token, or the summary is not summary rows.
        """
        summary = source.summary
        if summary is None or not self._fit_summary(summary):
            chunks = source.logit_chunks
            self._newton(lambda s: nll_derivatives(chunks, s)[1:3])

    def _fit_summary(self, summary: Tensor) -> bool:
        """Newton's steps from scale summary rows (N, D); False (self unchanged) when the optimum lies beyond the
        summary's range (1/T > max_scale), where only the chunks can fit it."""
        if summary.dim() != 2 or summary.shape[0] == 0:
            raise ATSError(f"temperature scaling: expected scale summary rows (N, D), N > 0, got "
                           f"{tuple(summary.shape)}")
        rows = summary.double()
        upper = min(S_MAX, SummaryView(rows).spec.max_scale)
        if summary_derivatives(rows, upper)[0] < 0:  # the loss still falls at the summary's largest scale
            return False
        self._newton(lambda s: summary_derivatives(rows, s), upper=upper)
        return True

    def _newton(self, derivatives, upper: float = S_MAX) -> "TemperatureScaling":
        """Guarded Newton on s = 1/T in [S_MIN, upper]; `derivatives(s)` -> (dNLL/ds, d2NLL/ds2)."""
        lo, hi = S_MIN, upper  # the optimum of the convex loss lies in [lo, hi] (clamped to the range)
        s = 1.0 if lo < 1.0 < hi else math.sqrt(lo * hi)
        for passes in range(1, self.max_passes + 1):
            grad, hess = derivatives(s)
            if grad > 0:
                hi = s  # loss increases with s here: optimum is below
            elif grad < 0:
                lo = s
            else:
                break
            step = grad / hess if hess > 0 else math.inf
            new = s - step
            if not (lo < new < hi):  # Newton left the bracket (or hess == 0): bisect instead
                new = math.sqrt(lo * hi)  # geometric midpoint: s is a scale
            if abs(new - s) <= self.tol * max(s, 1.0) or hi - lo <= self.tol * lo:
                s = new
                break
            s = new
        self.passes_ = passes
        self.temperature = 1.0 / s
        return self

    def calibrate(self, logits: Tensor, hidden: Tensor | None = None, *, attention_mask: Tensor | None = None,
                  index: Tensor | None = None) -> Tensor:
        """logits / T, same shape and dtype; `ATSError` if not fitted.

        Same arguments as `Calibrator.calibrate`; only `logits`, (B, K, V) or (N, V), is read.
        """
        self.check_fitted()
        return logits / self.temperature

    def restore(self, fitted: dict, tensors: dict[str, Tensor]) -> None:
        """Set the saved temperature.

        Raises:
            ATSError: if it is missing or not a positive number.
        """
        self.temperature = check_positive_float("temperature", fitted.get("temperature"))
