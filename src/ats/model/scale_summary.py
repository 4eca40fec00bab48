"""A per-token summary of the logits from which every training loss of a scale `s` follows without the vocabulary.

Every objective of a calibration head (`ats.training.losses`) needs, per token with logits z (V,) and label y, only
`z_top = max z`, `z_y`, `mean_j z_j` and the function `F(s) = logsumexp_j(s z_j)` on `0 < s <= max_scale`
(`F'(s) = E_p[z]`, `F''(s) = Var_p[z]`, p = softmax(s z)). Writing `top` for argmax z, `d_j = z_top - z_j >= 0`
for the gaps, `g2 >= 0` for a reference gap no larger than the smallest gap of the others (z_top - z_2, z_2 the
largest logit among the others) and `e_j = d_j - g2 >= 0` for j != top:

    F(s) = s z_top + G(s),   G(s) = softplus(L(s)) = log(1 + e^L(s)),   L(s) = -s g2 + l(s),
    l(s) = log sum_{j != top} exp(-s e_j),   l'(s) = -E_r[e],   l''(s) = Var_r[e],   r = softmax_{j != top}(-s e).

`l` is smooth, convex and bounded (from log(V - 1) at s = 0 down to about -s (z_top - z_2 - g2) >= -s w at large s,
w the bin width below), with no large term to cancel: an absolute error in `l` is a relative error in `e^L`, hence in
`G`, also where `G` is tiny (a confident token). The summary stores `l, l', l''` at the nodes
`s_k = knee (rho^k - 1)`, k = 0..K (`s_0 = 0`, `s_K = max_scale`): uniform in log(1 + s / knee), so the intervals
are short at small s, where the whole vocabulary moves (the flattening regime, the largest derivatives of `l`), and
long at large s, where `l` is nearly constant. Between nodes `l` is the quintic Hermite interpolant of the six
numbers at the interval's ends; the losses and their derivatives in s are those of that one piecewise polynomial
(autograd through it), so gradients are exact to the interpolant.

The node values come from one pass over the vocabulary after its max and min: the gaps d are binned (width w = 1/64)
with the power sums of their offsets within the bin up to the 3rd (`_gap_bins`, four scatter-adds, no sort and no
second-largest search); the top token (d = 0) is then taken out of the first bin, `g2` is the start of the first bin
still occupied (so g2 <= z_top - z_2 < g2 + w), and every node is a matrix product over the bins
(`_node_moments`), so the cost does not grow with K. With G, per token:

    CE(q, y) = G + s (z_top - z_y),   CE(q, u) = G + s (z_top - mean z),   log p_top = -G.

A row (float32) holds the header `HEADER` (z_top, z_top - z_y, z_top - mean z, correct, g2, max_scale, knee) and
then l(0) = log(V - 1) with the K increments l(s_k) - l(s_{k-1}) (stored as increments so that float32 rounding of
l ~ log V does not reach the derivative between close nodes), l' (K + 1) and l'' (K + 1): 7 + 3 (K + 1) numbers,
616 bytes at the default K = 48 (SmolLM2's fp16 hidden state is 1152 bytes). Rows made before the reference gap was
a bin edge (g2 = z_top - z_2 exactly, `l` relative to z_2) describe the same `G` in the same layout and are read the
same way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..errors import ATSError
from .heads.config import MAX_SCALE as DEFAULT_MAX_SCALE
from .scaled_ce import ScaledCE

__all__ = ["SUMMARY_VERSION", "ScaleSummarySpec", "SummaryView", "scaled_ce_from_summary", "summarize_logits",
           "summary_width"]

SUMMARY_VERSION = 1
HEADER = ("z_top", "gap_y", "gap_mean", "correct", "gap2", "max_scale", "knee")  # gap2: g2
Z_TOP, GAP_Y, GAP_MEAN, CORRECT, GAP2, MAX_SCALE, KNEE = range(len(HEADER))
DEFAULT_INTERVALS = 48
DEFAULT_KNEE = 0.25
BIN_WIDTH = 1 / 64  # the width of the gap bins; a power of 2, so that d / w is as exact as d
MOMENTS = 4  # power sums per bin: t^0 .. t^3 (truncation (s w / 2)^4 / 4!, 1.6e-6 at s = 10)
ROW_ELEMENTS = 1 << 17  # logits binned together on a CPU (2 rows of SmolLM2): their buffers stay in cache


@dataclass(frozen=True)
class ScaleSummarySpec:
    """The summary's settings: everything that changes its numbers (recorded in meta.json and fingerprints).

    Attributes:
        max_scale: the largest scale the summary covers (the head's clamp on exp(tau)).
        intervals: K, the number of Hermite intervals on [0, max_scale].
        knee: the nodes are s_k = knee (rho^k - 1): about uniform below `knee`, geometric above.
        version: the summary's format version.
    """

    max_scale: float = DEFAULT_MAX_SCALE
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

    def nodes(self, dtype: torch.dtype = torch.float64, device=None) -> Tensor:
        """The K + 1 nodes s_0 = 0 < ... < s_K = max_scale.

        Args:
            dtype: the result's dtype.
            device: the result's device (default the CPU).

        Returns:
            (K + 1,) the nodes.
        """
        return _nodes(torch.tensor([self.max_scale], dtype=torch.float64, device=device),
                      torch.tensor([self.knee], dtype=torch.float64, device=device),
                      self.intervals)[0].to(dtype)

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


def _gap_bins(z: Tensor, z_top: Tensor, out: Tensor, width: float, work: tuple[Tensor, Tensor, Tensor]) -> None:
    """Add, per bin of the gaps d_j = z_top - z_j (every j, the top token included), the power sums of the offsets
    from the bin's left edge into `out`.

    One pass over the vocabulary, no sort and no second largest: bin b holds b w <= d < (b + 1) w.

    Args:
        z: (n, V) float32 or float64 logits.
        z_top: (n,) each row's largest logit.
        out: (M, n, B) zeros in z's dtype, B more than the largest gap / `width`; receives, per bin b, the sum over
            its tokens of (delta / w)^k, delta = d - b w in [0, w), k = 0 .. M - 1.
        width: w, the bins' width (a power of 2, so that d / w is as exact as d).
        work: buffers of at least n * V elements: (z's dtype, long, z's dtype). Reused across calls: a fresh
            multi-megabyte buffer per call costs more in page faults than the pass that fills it.
    """
    n, V = z.shape
    x, index, power = (buffer[:n * V].view(n, V) for buffer in work)
    inv = 1.0 / width
    torch.add(z_top[:, None] * inv, z, alpha=-inv, out=x)  # (n, V) d / w >= 0 (0 at the top)
    index.copy_(x)  # (n, V) the bin of each gap (x >= 0: truncation is floor)
    u = x.frac_()  # (n, V) delta / w in [0, 1)
    out[0].scatter_add_(1, index, torch.ones(1, dtype=z.dtype, device=z.device).expand_as(u))
    out[1].scatter_add_(1, index, u)
    power.copy_(u)
    for k in range(2, out.shape[0]):
        power.mul_(u)
        out[k].scatter_add_(1, index, power)


def _node_moments(raw: Tensor, centres: Tensor, nodes: Tensor, width: float) -> Tensor:
    """l, l', l'' (3, n, K + 1) float64 at the nodes from the power sums of the gap bins (`_gap_bins`).

    Per bin, sum_j exp(-s e_j) = exp(-s c_b) sum_j exp(-s delta_j), delta_j = e_j - c_b in [-w/2, w/2) (c_b the
    centre), the second factor's Taylor series to order M - 1: its truncation is below (s w / 2)^M / M! relative. The
    sums of delta^k follow from those of the offsets from the left edge, t = delta / w + 1/2 in [0, 1), by the
    binomial expansion delta^k = w^k sum_i C(k, i) (-1/2)^(k - i) t^i, folded into the Taylor coefficients. S(s) =
    sum_b exp(-s c_b) P_b(s) and its two s-derivatives are three matrix products of the power sums with
    exp(-s c), c exp(-s c) and c^2 exp(-s c) over all nodes at once.

    Args:
        raw: (M, n, B) per bin the sums of t^i, i = 0 .. M - 1.
        centres: (B,) the bins' centres.
        nodes: (K + 1,) float64 nodes, s_0 = 0 included.
        width: w.

    Returns:
        (3, n, K + 1): log S, S'/S = -E_r[e], S''/S - (S'/S)^2 = Var_r[e] at each node.
    """
    M = raw.shape[0]
    weights = torch.exp(-centres[:, None] * nodes[None, :])  # (B, K + 1)
    c = centres[:, None]
    products = raw.double() @ torch.cat([weights, c * weights, c * c * weights], dim=1)  # (M, n, 3 (K + 1))
    a0, a1, a2 = products.split(nodes.shape[0], dim=-1)  # (M, n, K + 1) each
    k = torch.arange(M, dtype=torch.float64, device=raw.device)[:, None]
    coef = (-nodes[None, :]) ** k / torch.exp(torch.lgamma(k + 1))  # (M, K + 1) (-s)^k / k!: sums of delta^k
    d_coef = -torch.cat([torch.zeros_like(coef[:1]), coef[:-1]])  # d/ds
    dd_coef = torch.cat([torch.zeros_like(coef[:2]), coef[:-2]])  # d^2/ds^2
    binomial = torch.tensor([[math.comb(j, i) * (-0.5) ** (j - i) * width ** j if i <= j else 0.0 for j in range(M)]
                             for i in range(M)], dtype=torch.float64, device=raw.device)  # (M, M) t^i -> delta^j
    coef, d_coef, dd_coef = binomial @ coef, binomial @ d_coef, binomial @ dd_coef  # now on the sums of t^i
    s0 = (coef[:, None] * a0).sum(0)  # (n, K + 1)
    s1 = (d_coef[:, None] * a0 - coef[:, None] * a1).sum(0) / s0
    s2 = (dd_coef[:, None] * a0 - 2 * d_coef[:, None] * a1 + coef[:, None] * a2).sum(0) / s0
    return torch.stack([s0.log(), s1, (s2 - s1 * s1).clamp(min=0)])


def summarize_logits(z: Tensor, labels: Tensor, *, max_scale: float, intervals: int = DEFAULT_INTERVALS,
                     knee: float = DEFAULT_KNEE) -> Tensor:
    """The scale summary of n tokens' logits: one row per token (see the module docstring for the layout).

    Reads the vocabulary a fixed number of times (max, min, one binning pass), whatever K.

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
    z_top = z.amax(-1)  # (n,)
    # B, for every row: every gap's bin is at most B - 2, so bin B - 1 stays empty (the shift below reads it)
    bins = int(float((z_top - z.amin(-1)).amax()) / BIN_WIDTH) + 2
    # rows binned together: on a CPU few enough for the buffers to stay in cache, but one per thread at least
    # (scatter_add splits its rows among the threads: one row of Qwen's 151,936 logits at a time used one core)
    step = min(n, max(torch.get_num_threads(), ROW_ELEMENTS // V)) if z.device.type == "cpu" else n
    raw = torch.zeros(MOMENTS, n, bins, dtype=z.dtype, device=z.device)  # (M, n, B)
    work = (torch.empty(step * V, dtype=z.dtype, device=z.device), torch.empty(step * V, dtype=torch.long,
            device=z.device), torch.empty(step * V, dtype=z.dtype, device=z.device))
    for a in range(0, n, step):
        _gap_bins(z[a:a + step], z_top[a:a + step], raw[:, a:a + step], BIN_WIDTH, work)
    raw[0, :, 0] -= 1  # the top token: d = 0, offset 0 (adds nothing to the higher sums)
    first = (raw[0] > 0.5).to(torch.int8).argmax(-1)  # (n,) the first occupied bin of the others: g2 = first * w
    shift = torch.arange(bins, device=z.device)[None, :] + first[:, None]  # (n, B)
    raw = raw.gather(2, shift.clamp(max=bins - 1).expand(MOMENTS, n, bins))  # bin `first` -> 0; zeros past the end
    centres = (torch.arange(bins, dtype=torch.float64, device=z.device) + 0.5) * BIN_WIDTH  # (B,) e = d - g2
    moments = _node_moments(raw, centres, spec.nodes(device=z.device), BIN_WIDTH)  # (3, n, K + 1)
    g2 = first.double() * BIN_WIDTH  # (n,)
    sum_d = (g2 - moments[1][:, 0]) * (V - 1)  # (n,) sum_{j != top} d_j = sum (g2 + e_j)
    z_label = z.gather(1, labels[:, None]).squeeze(1)  # (n,)
    correct = z_label == z_top  # the label is an argmax; with another logit within w of it, check the first one
    near = correct & (first == 0)
    if bool(near.any()):
        correct[near] = z[near].argmax(-1) == labels[near]  # the exact route's argmax: the first maximum
    rows[:, Z_TOP] = z_top
    rows[:, GAP_Y] = z_top - z_label
    rows[:, GAP_MEAN] = sum_d / V  # z_top - mean z
    rows[:, CORRECT] = correct.float()
    rows[:, GAP2] = g2
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
        scale: (N,) scales in [0, max_scale] (0: exp(tau) underflowed; the distribution is uniform).

    Returns:
        (N,) float64 G; its gradient w.r.t. `scale` is that of the piecewise quintic.

    Raises:
        ATSError: on mismatched shapes or a scale outside [0, max_scale].
    """
    if summary.dim() != 2 or scale.dim() != 1 or summary.shape[0] != scale.shape[0]:
        raise ATSError(f"scale summary: expected summary (N, D) and scale (N,), got {tuple(summary.shape)} and "
                       f"{tuple(scale.shape)}")
    K = _intervals_of(summary.shape[1])
    rows = summary.to(device=scale.device, dtype=torch.float64)
    s = scale.double()
    max_scale, knee = rows[:, MAX_SCALE], rows[:, KNEE]
    outside = (s < 0) | (s > max_scale * (1 + 1e-6))  # s = 0 (exp(tau) underflowing) is the first node: uniform
    if bool(outside.any()):
        bad = outside.nonzero()[0, 0]
        raise ATSError(f"scale summary: scale {float(s[bad]):.6g} is outside the summary's range [0, "
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
