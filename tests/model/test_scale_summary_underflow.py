"""A scale that underflows to exactly 0 (exp(tau) for a very negative tau) is the summary's first node, the uniform
distribution: the summary route gives the exact route's loss and gradient there instead of refusing."""

from __future__ import annotations

import math

import pytest
import torch

from ats.errors import ATSError
from ats.model.scale_summary import scaled_ce_from_summary, summarize_logits


def test_zero_scale_is_the_uniform_distribution():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 300, generator=g, dtype=torch.float64) * 3  # (N, V)
    labels = torch.randint(0, 300, (5,), generator=g)
    summary = summarize_logits(z.float(), labels, max_scale=10.0)
    s = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    out = scaled_ce_from_summary(summary, s)
    assert torch.allclose(out.ce_label.double(), torch.full((5,), math.log(300), dtype=torch.float64), rtol=1e-5)
    out.ce_label.sum().backward()
    # by hand: d/ds [logsumexp(s z) - s z_y] at s = 0 is mean(z) - z_y
    expected = z.mean(dim=1) - z[torch.arange(5), labels]
    assert torch.allclose(s.grad, expected, rtol=1e-3, atol=1e-4)
    with pytest.raises(ATSError, match=r"range \[0, 10\]"):
        scaled_ce_from_summary(summary, torch.full((5,), -1e-3, dtype=torch.float64))
