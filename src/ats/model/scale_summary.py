"""A per-token summary of the logits from which every training loss of a scale `s` follows without the vocabulary.

Every objective of a calibration head (`ats.training.losses`) needs, per token with logits z (V,) and label y, only
`z_top = max z`, `z_y`, `mean_j z_j` and the function `F(s) = logsumexp_j(s z_j)` on `0 < s <= max_scale`
(`F'(s) = E_p[z]`, `F''(s) = Var_p[z]`, p = softmax(s z)). Writing `top` for argmax z, `z_2` for the largest logit
among the others, `gap2 = z_top - z_2 >= 0` and `e_j = z_2 - z_j >= 0` for j != top:

    F(s) = s z_top + G(s),   G(s) = softplus(L(s)) = log(1 + e^L(s)),   L(s) = -s gap2 + l(s),
    l(s) = log sum_{j != top} exp(-s e_j),   l'(s) = -E_r[e],   l''(s) = Var_r[e],   r = softmax_{j != top}(-s e).

`l` is smooth, convex and bounded (from log(V - 1) at s = 0 down to the log of the number of ties at z_2), with no
large term to cancel: an absolute error in `l` is a relative error in `e^L`, hence in `G`, also where `G` is tiny
(a confident token). The summary stores `l, l', l''` at the nodes `s_k = knee (rho^k - 1)`, k = 0..K (`s_0 = 0`,
`s_K = max_scale`): uniform in log(1 + s / knee), so the intervals are short at small s, where the whole vocabulary
moves (the flattening regime, the largest derivatives of `l`), and long at large s, where `l` is nearly constant.
Between nodes `l` is the quintic Hermite interpolant of the six numbers at the interval's ends; the losses and their
derivatives in s are those of that one piecewise polynomial (autograd through it), so gradients are exact to the
interpolant. The node values come from one pass over the vocabulary: the gaps e are binned (width 1/32) with the
power sums of their offsets from the bin centres up to the 4th, and every node is then a matrix product over the
bins (`_gap_bins`, `_node_moments`), so the cost does not grow with K. With G, per token:

    CE(q, y) = G + s (z_top - z_y),   CE(q, u) = G + s (z_top - mean z),   log p_top = -G.

A row (float32) holds the header `HEADER` (z_top, z_top - z_y, z_top - mean z, correct, gap2, max_scale, knee) and
then l(0) = log(V - 1) with the K increments l(s_k) - l(s_{k-1}) (stored as increments so that float32 rounding of
l ~ log V does not reach the derivative between close nodes), l' (K + 1) and l'' (K + 1): 7 + 3 (K + 1) numbers,
616 bytes at the default K = 48 (SmolLM2's fp16 hidden state is 1152 bytes).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..errors import ATSError
from .scaled_ce import ScaledCE

__all__ = ["SUMMARY_VERSION", "ScaleSummarySpec", "SummaryView", "scaled_ce_from_summary", "summarize_logits",
           "summary_width"]

SUMMARY_VERSION = 1
HEADER = ("z_top", "gap_y", "gap_mean", "correct", "gap2", "max_scale", "knee")
Z_TOP, GAP_Y, GAP_MEAN, CORRECT, GAP2, MAX_SCALE, KNEE = range(len(HEADER))
DEFAULT_INTERVALS = 48
DEFAULT_KNEE = 0.25
BIN_WIDTH = 1 / 32  # the width of the gap bins; a power of 2, so that e / w is as exact as e
ROWS_PER_PASS = 2  # tokens binned together: a row's buffers stay in cache (2.5x faster than 128 rows at once)


@dataclass(frozen=True)
class ScaleSummarySpec:
    """The summary's settings: everything that changes its numbers (recorded in meta.json and fingerprints).

    Attributes:
        max_scale: the largest scale the summary covers (the head's clamp on exp(tau)).
        intervals: K, the number of Hermite intervals on [0, max_scale].
        knee: the nodes are s_k = knee (rho^k - 1): about uniform below `knee`, geometric above.
        version: the summary's format version.
    """

    max_scale: float = 10.0
    intervals: int = DEFAULT_INTERVALS
    knee: float = DEFAULT_KNEE
    version: int = SUMMARY_VERSION

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_scale) and self.max_scale > 0):
            raise ATSError(f"scale summary: max_scale must be a positive number, got {self.max_scale!r}")
        if not (isinstance(self.intervals, int) and self.intervals >= 1):
            raise ATSError(f"scale summary: intervals must be an integer >= 1, got {self.intervals!r}")
        if not (math.isfinite(self.knee) and self.knee > 0):
            raise ATSError(f"scale summary: knee must be a positive number, got {self.knee!r}")

    @property
    def width(self) -> int:
        """D, the numbers per token."""
        return summary_width(self.intervals)

    def nodes(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The K + 1 nodes s_0 = 0 < ... < s_K = max_scale.

        Args:
            dtype: the result's dtype.

        Returns:
            (K + 1,) the nodes.
        """
        return _nodes(torch.tensor([self.max_scale], dtype=torch.float64),
                      torch.tensor([self.knee], dtype=torch.float64), self.intervals)[0].to(dtype)

    def describe(self) -> dict:
        """The settings as a JSON-ready dict (for meta.json and fingerprints)."""
        return asdict(self)


def summary_width(intervals: int) -> int:
    """D = len(HEADER) + 3 (K + 1), the numbers per token for K intervals."""
    return len(HEADER) + 3 * (intervals + 1)


def _intervals_of(width: int) -> int:
    """K from a row width D; ATSError if D is not a summary's width."""
    k = (width - len(HEADER)) // 3 - 1
    if k < 1 or summary_width(k) != width:
        raise ATSError(f"scale summary: a row has {width} numbers, which is not {len(HEADER)} + 3 (K + 1) for any "
                       f"K >= 1 (not a scale summary?)")
    return k


def _nodes(max_scale: Tensor, knee: Tensor, intervals: int) -> Tensor:
    """(n, K + 1) nodes knee (rho^k - 1) with rho^K = 1 + max_scale / knee, from (n,) max_scale and knee."""
    k = torch.arange(intervals + 1, dtype=max_scale.dtype, device=max_scale.device)  # (K + 1,)
    log_rho = torch.log1p(max_scale / knee) / intervals  # (n,)
    nodes = knee[:, None] * torch.expm1(log_rho[:, None] * k)  # (n, K + 1)
    nodes[:, -1] = max_scale  # exactly, whatever the rounding
    return nodes


@dataclass
class SummaryView:
    """Named (N,) columns of summary rows (N, D), for code that needs z_top, z_y, mean z or correctness."""

    rows: Tensor  # (N, D)

    @property
    def z_top(self) -> Tensor:
        """(N,) the largest logit."""
        return self.rows[:, Z_TOP]

    @property
    def z_label(self) -> Tensor:
        """(N,) the label's logit z_y."""
        return self.rows[:, Z_TOP] - self.rows[:, GAP_Y]

    @property
    def z_mean(self) -> Tensor:
        """(N,) the mean logit over the vocabulary."""
        return self.rows[:, Z_TOP] - self.rows[:, GAP_MEAN]

    @property
    def correct(self) -> Tensor:
        """(N,) bool: argmax z == y."""
        return self.rows[:, CORRECT] > 0.5

    @property
    def spec(self) -> ScaleSummarySpec:
        """The settings the rows were made with (read from the first row)."""
        return ScaleSummarySpec(max_scale=float(self.rows[0, MAX_SCALE]), intervals=_intervals_of(self.rows.shape[1]),
                                knee=float(self.rows[0, KNEE]))


def _check_logits(z: Tensor, labels: Tensor) -> None:
    """ATSError unless z is (n, V >= 2) finite-typed and labels (n,) long ids in [0, V)."""
    if z.dim() != 2 or labels.dim() != 1 or z.shape[0] != labels.shape[0]:
        raise ATSError(f"summarize_logits: expected z (n, V) and labels (n,), got {tuple(z.shape)} and "
                       f"{tuple(labels.shape)}")
    if z.shape[1] < 2:
        raise ATSError(f"summarize_logits: a vocabulary of {z.shape[1]} token(s) has no scale to calibrate")
    bad = (labels < 0) | (labels >= z.shape[1])
    if bool(bad.any()):
        raise ATSError(f"labels: id {int(labels[bad][0])} is outside the vocabulary [0, {z.shape[1]}) "
                       "(pass response tokens only)")


def _gap_bins(z: Tensor, top: Tensor, z_2: Tensor, bins: int) -> Tensor:
    """Power sums, per bin of the gaps e_j = z_2 - z_j (j != top), of the offsets from the bin's centre.

    One pass over the vocabulary: bins of width `BIN_WIDTH`; the top token goes to a discarded last bin.

    Args:
        z: (n, V) float32 or float64 logits.
        top: (n,) the index of each row's top token.
        z_2: (n,) each row's largest logit other than the top one.
        bins: B, more than the largest gap / `BIN_WIDTH`.

    Returns:
        (5, n, B) float64: per bin b, the sum over its tokens of delta^k, k = 0..4, delta = e - c_b in [-w/2, w/2],
        c_b = (b + 1/2) w.
    """
    n, V = z.shape
    inv = 1.0 / BIN_WIDTH
    x = torch.add(z_2[:, None] * inv, z, alpha=-inv)  # (n, V) e / w, >= 0 but at the top
    index = x.long()  # (n, V) the bin of each gap (x >= 0: truncation is floor)
    index.scatter_(1, top[:, None], bins)
    index += (torch.arange(n, device=z.device) * (bins + 1))[:, None]
    u = x.frac_().sub_(0.5).view(-1)  # (n V,) delta / w in [-1/2, 1/2)
    flat = index.view(-1)
    sums, power = [], torch.ones_like(u)
    for k in range(5):
        target = torch.zeros(n * (bins + 1), dtype=u.dtype, device=z.device)
        sums.append(target.scatter_add_(0, flat, power).view(n, bins + 1)[:, :bins].double() * BIN_WIDTH ** k)
        if k < 4:
            power = power * u if k else u
    return torch.stack(sums)


def _node_moments(mu: Tensor, centres: Tensor, nodes: Tensor) -> Tensor:
    """l, l', l'' (3, n, K + 1) float64 at the nodes from the gap bins of `_gap_bins`.

    Per bin, sum_j exp(-s e_j) = exp(-s c_b) sum_j exp(-s delta_j), the second factor's Taylor series to order 4:
    its truncation is below (s w / 2)^5 / 120 relative (8e-7 at s = 10, w = 1/32). S(s) = sum_b exp(-s c_b) P_b(s)
    and its two s-derivatives are three matrix products of the power sums with exp(-s c), c exp(-s c) and
    c^2 exp(-s c) over all nodes at once.

    Args:
        mu: (5, n, B) the power sums.
        centres: (B,) the bins' centres.
        nodes: (K + 1,) float64 nodes, s_0 = 0 included.

    Returns:
        (3, n, K + 1): log S, S'/S = -E_r[e], S''/S - (S'/S)^2 = Var_r[e] at each node.
    """
    weights = torch.exp(-centres[:, None] * nodes[None, :])  # (B, K + 1)
    c = centres[:, None]
    products = mu @ torch.cat([weights, c * weights, c * c * weights], dim=1)  # (5, n, 3 (K + 1))
    a0, a1, a2 = products.split(nodes.shape[0], dim=-1)  # (5, n, K + 1) each
    k = torch.arange(5, dtype=torch.float64, device=mu.device)[:, None]
    coef = (-nodes[None, :]) ** k / torch.exp(torch.lgamma(k + 1))  # (5, K + 1) (-s)^k / k!
    d_coef = -torch.cat([torch.zeros_like(coef[:1]), coef[:-1]])  # d/ds
    dd_coef = torch.cat([torch.zeros_like(coef[:2]), coef[:-2]])  # d^2/ds^2
    s0 = (coef[:, None] * a0).sum(0)  # (n, K + 1)
    s1 = (d_coef[:, None] * a0 - coef[:, None] * a1).sum(0) / s0
    s2 = (dd_coef[:, None] * a0 - 2 * d_coef[:, None] * a1 + coef[:, None] * a2).sum(0) / s0
    return torch.stack([s0.log(), s1, (s2 - s1 * s1).clamp(min=0)])


def summarize_logits(z: Tensor, labels: Tensor, *, max_scale: float, intervals: int = DEFAULT_INTERVALS,
                     knee: float = DEFAULT_KNEE) -> Tensor:
    """The scale summary of n tokens' logits: one row per token (see the module docstring for the layout).

    Reads the vocabulary a fixed number of times (max, second largest, one binning pass), whatever K.

    Args:
        z: (n, V) logits (any float dtype; computed in float32, or float64 if z is).
        labels: (n,) long next-token ids in [0, V).
        max_scale: the largest scale the summary must cover.
        intervals: K, the Hermite intervals (`ScaleSummarySpec.intervals`).
        knee: the node placement (`ScaleSummarySpec.knee`).

    Returns:
        (n, D) float32 rows, D = `summary_width(intervals)`.

    Raises:
        ATSError: on bad shapes, a vocabulary of one token, a label outside [0, V) or bad settings.
    """
    spec = ScaleSummarySpec(max_scale=float(max_scale), intervals=intervals, knee=float(knee))
    _check_logits(z, labels)
    n, V = z.shape
    rows = torch.empty(n, spec.width, dtype=torch.float32, device=z.device)
    if n == 0:
        return rows
    z = z if z.dtype == torch.float64 else z.float()
    labels = labels.to(z.device)
    z_top, top = z.max(-1)  # (n,) each; the exact route's argmax
    z_2 = z.topk(2, dim=-1).values[:, 1]  # (n,) the second largest value (= z_top on a tie)
    bins = int(float((z_2 - z.amin(-1)).amax()) / BIN_WIDTH) + 2  # B, for every row; the top token's bin is B
    mu = torch.cat([_gap_bins(z[a:a + ROWS_PER_PASS], top[a:a + ROWS_PER_PASS], z_2[a:a + ROWS_PER_PASS], bins)
                    for a in range(0, n, ROWS_PER_PASS)], dim=1)  # (5, n, B)
    centres = (torch.arange(bins, dtype=torch.float64, device=z.device) + 0.5) * BIN_WIDTH  # (B,)
    moments = _node_moments(mu, centres, spec.nodes())  # (3, n, K + 1)
    sum_e = -moments[1][:, 0] * (V - 1)  # (n,) sum_{j != top} e_j
    z_mean = (z_top.double() + (V - 1) * z_2.double() - sum_e) / V  # (n,)
    rows[:, Z_TOP] = z_top
    rows[:, GAP_Y] = z_top - z.gather(1, labels[:, None]).squeeze(1)
    rows[:, GAP_MEAN] = z_top.double() - z_mean
    rows[:, CORRECT] = (top == labels).float()
    rows[:, GAP2] = z_top - z_2
    rows[:, MAX_SCALE] = spec.max_scale
    rows[:, KNEE] = spec.knee
    moments[0] = torch.diff(moments[0], dim=1, prepend=torch.zeros_like(moments[0][:, :1]))  # l(0), increments
    base, K1 = len(HEADER), spec.intervals + 1
    for i in range(3):
        rows[:, base + i * K1: base + (i + 1) * K1] = moments[i]
    return rows


def _hermite5(t: Tensor, h: Tensor, f0: Tensor, d0: Tensor, c0: Tensor, f1: Tensor, d1: Tensor,
              c1: Tensor) -> Tensor:
    """The quintic Hermite interpolant at t in [0, 1] on an interval of length h, from the value, first and second
    derivative at both ends (all (N,))."""
    t2 = t * t
    t3 = t2 * t
    t4 = t3 * t
    t5 = t4 * t
    h00 = 1 - 10 * t3 + 15 * t4 - 6 * t5
    h10 = t - 6 * t3 + 8 * t4 - 3 * t5
    h20 = 0.5 * (t2 - 3 * t3 + 3 * t4 - t5)
    h21 = 0.5 * (t3 - 2 * t4 + t5)
    h11 = -4 * t3 + 7 * t4 - 3 * t5
    h01 = 10 * t3 - 15 * t4 + 6 * t5
    return f0 * h00 + h * d0 * h10 + h * h * c0 * h20 + f1 * h01 + h * d1 * h11 + h * h * c1 * h21


def summary_log_partition(summary: Tensor, scale: Tensor) -> Tensor:
    """G(s) = logsumexp(s z) - s z_top (N,) from summary rows, differentiable w.r.t. `scale` (computed in float64).

    Args:
        summary: (N, D) rows of `summarize_logits`.
        scale: (N,) scales in (0, max_scale].

    Returns:
        (N,) float64 G; its gradient w.r.t. `scale` is that of the piecewise quintic.

    Raises:
        ATSError: on mismatched shapes or a scale outside (0, max_scale].
    """
    if summary.dim() != 2 or scale.dim() != 1 or summary.shape[0] != scale.shape[0]:
        raise ATSError(f"scale summary: expected summary (N, D) and scale (N,), got {tuple(summary.shape)} and "
                       f"{tuple(scale.shape)}")
    K = _intervals_of(summary.shape[1])
    rows = summary.to(device=scale.device, dtype=torch.float64)
    s = scale.double()
    max_scale, knee = rows[:, MAX_SCALE], rows[:, KNEE]
    if bool(((s <= 0) | (s > max_scale * (1 + 1e-6))).any()):
        bad = ((s <= 0) | (s > max_scale * (1 + 1e-6))).nonzero()[0, 0]
        raise ATSError(f"scale summary: scale {float(s[bad]):.6g} is outside the summary's range (0, "
                       f"{float(max_scale[bad]):g}]; extract the features with a max_scale at least the head's")
    log_rho = torch.log1p(max_scale / knee) / K  # (N,)
    k = torch.floor(torch.log1p(s.detach() / knee) / log_rho).clamp_(0, K - 1).long()[:, None]  # (N, 1)
    nodes = _nodes(max_scale, knee, K)  # (N, K + 1)
    a, b = nodes.gather(1, k).squeeze(1), nodes.gather(1, k + 1).squeeze(1)  # (N,) each
    base, K1 = len(HEADER), K + 1

    def at(i: int, j: Tensor) -> Tensor:  # column block i (0: l, 1: l', 2: l''), node j (N, 1)
        block = ell_nodes if i == 0 else rows[:, base + i * K1:base + (i + 1) * K1]
        return block.gather(1, j).squeeze(1)

    ell_nodes = rows[:, base:base + K1].cumsum(1)  # (N, K + 1) l(s_k) from l(0) and the increments
    h = b - a
    ell = _hermite5((s - a) / h, h, at(0, k), at(1, k), at(2, k), at(0, k + 1), at(1, k + 1), at(2, k + 1))
    return torch.logaddexp(ell - s * rows[:, GAP2], torch.zeros_like(s))  # softplus(L), L = l - s gap2


def scaled_ce_from_summary(summary: Tensor, scale: Tensor) -> ScaledCE:
    """CE(q, y), CE(q, uniform), log p_top (N,) each and correctness (N,) of q = z * scale, from summary rows.

    The same fields and meanings as `ats.model.scaled_ce.scaled_cross_entropy`, without the vocabulary: any loss
    written against `ScaledCE` works unchanged.

    Args:
        summary: (N, D) rows of `summarize_logits`, no grad.
        scale: (N,) in (0, max_scale], with grad.

    Returns:
        `ScaledCE`: float results float32 (float64 if `scale` is), differentiable w.r.t. `scale`.

    Raises:
        ATSError: on mismatched shapes or a scale outside the summary's range.
    """
    G = summary_log_partition(summary, scale)  # (N,) float64
    rows = summary.to(device=scale.device, dtype=torch.float64)
    s = scale.double()
    out_dtype = torch.float64 if scale.dtype == torch.float64 else torch.float32
    return ScaledCE(
        ce_label=(G + s * rows[:, GAP_Y]).to(out_dtype),
        ce_uniform=(G + s * rows[:, GAP_MEAN]).to(out_dtype),
        log_p_top=(-G).to(out_dtype),
        correct=rows[:, CORRECT] > 0.5,
    )
