"""ats.model.numerics: the floored exponentials give torch's own results, also where most terms would be subnormal."""

from __future__ import annotations

import pytest
import torch

from ats.model.numerics import chosen_log_probs, exp_floor, logsumexp, softmax_


def peaked(dtype: torch.dtype, V: int = 4096) -> torch.Tensor:
    """Rows whose spread runs from ordinary to far below the subnormal range (like a confident next-token row)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, V, generator=g, dtype=torch.float64)
    x = x * torch.tensor([1.0, 10.0, 50.0, 200.0, 1000.0, 5000.0], dtype=torch.float64)[:, None]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logsumexp_equals_torch(dtype):
    x = peaked(dtype)
    expected = torch.logsumexp(x, dim=-1)
    torch.testing.assert_close(logsumexp(x, dim=-1), expected, rtol=0, atol=0)
    # any dim, batched shapes
    torch.testing.assert_close(logsumexp(x.T, dim=0), expected, rtol=0, atol=0)
    torch.testing.assert_close(logsumexp(torch.stack((x, 2 * x)), dim=-1),
                               torch.stack((expected, torch.logsumexp(2 * x, dim=-1))), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_in_place_equals_torch_and_has_no_subnormals(dtype):
    x = peaked(dtype)
    lse = torch.logsumexp(x, dim=-1)
    expected = (x - lse[:, None]).exp()  # the same formula, unfloored
    floor = torch.tensor(exp_floor(dtype), dtype=torch.float64).exp().item()
    assert (expected[expected > 0] < torch.finfo(dtype).tiny).any()  # the unfloored result does have subnormals
    p = softmax_(x.clone(), lse)
    torch.testing.assert_close(p, expected, rtol=0, atol=floor)  # only entries below the floor moved, up to it
    assert torch.equal(p[expected >= floor], expected[expected >= floor])
    assert (p >= torch.finfo(dtype).tiny).all()  # every entry normal (at least e^floor)
    assert float(p.min()) == pytest.approx(floor, rel=1e-5)
    torch.testing.assert_close(p, torch.softmax(x, dim=-1), rtol=1e-4, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chosen_log_probs_equal_log_softmax(dtype):
    z = peaked(dtype).reshape(2, 3, -1)  # (K, B, V)
    g = torch.Generator().manual_seed(1)
    scale = (torch.rand(2, 3, generator=g, dtype=torch.float64) * 4 + 0.05).to(dtype)  # (K, B), some > 1
    tokens = torch.randint(0, z.shape[-1], (2, 3), generator=g)
    tokens[0, 0] = z[0, 0].argmax()  # the top token too
    logp_z, logp_q = chosen_log_probs(z, scale, tokens)
    expected_z = torch.log_softmax(z.double(), -1).gather(-1, tokens[..., None])[..., 0]
    expected_q = torch.log_softmax(z.double() * scale.double()[..., None], -1).gather(-1, tokens[..., None])[..., 0]
    tol = dict(rtol=1e-6, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(logp_z.double(), expected_z, **tol)
    torch.testing.assert_close(logp_q.double(), expected_q, **tol)
