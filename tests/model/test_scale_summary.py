"""The scale summary against the exact route: values and gradients w.r.t. the scale, random logits of every spread,
logits of a tiny random model, the edge scales (near 0, max_scale), and bad input."""

import pytest
import torch

from ats.errors import ATSError
from ats.model.scale_summary import (
    ScaleSummarySpec,
    SummaryView,
    scaled_ce_from_summary,
    summarize_logits,
    summary_width,
)
from ats.model.scaled_ce import scaled_cross_entropy

SCALES = [1e-4, 1e-3, 0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0, 1.3, 2.0, 3.0, 4.5, 7.0, 9.99, 10.0]


def stable_reference(z: torch.Tensor, y: torch.Tensor, s: float) -> dict:
    """ce_label, ce_uniform, log_p_top and their d/ds, in float64, without the cancellation of lse - s z_top:
    G(s) = log(1 + sum_{j != top} exp(-s d_j)), d_j = z_top - z_j, computed as softplus(logsumexp(-s d))."""
    z = z.double()
    top = z.argmax(-1)
    z_top = z.max(-1).values
    d = (z_top[:, None] - z).scatter(1, top[:, None], float("inf"))  # (n, V), the top excluded
    a = -s * d
    lse = torch.logsumexp(a, -1)
    G = torch.nn.functional.softplus(lse)
    mean_d = (torch.softmax(a, -1) * torch.where(torch.isinf(d), 0.0, d)).sum(-1)
    dG = -mean_d * torch.sigmoid(lse)
    gap_y = z_top - z.gather(1, y[:, None])[:, 0]
    gap_u = z_top - z.mean(-1)
    return {"ce_label": (G + s * gap_y, dG + gap_y, gap_y), "ce_uniform": (G + s * gap_u, dG + gap_u, gap_u),
            "log_p_top": (-G, -dG, torch.zeros_like(G))}  # (value, d/ds, the constant term of d/ds)


def summary_values(rows: torch.Tensor, s: float) -> dict:
    """The three values and their d/ds from the summary at one scale for every token."""
    scale = torch.full((rows.shape[0],), s, dtype=torch.float64, requires_grad=True)
    out = scaled_ce_from_summary(rows, scale)
    result = {}
    for name in ("ce_label", "ce_uniform", "log_p_top"):
        value = getattr(out, name)
        (grad,) = torch.autograd.grad(value.sum(), scale, retain_graph=True)
        result[name] = (value.detach(), grad)
    return result


def assert_close_to_reference(z, y, rows, *, value_tol=1e-4, grad_tol=1e-4, grad_floor=1e-300):
    """Values within value_tol relative; d/ds within grad_tol of the size of its terms (|G'| + |gap|, at least
    grad_floor), so that a derivative crossing zero (the optimum of a token's CE) is judged on the scale of what
    cancels, and one vanishing exponentially (a tie at the top, s large) on an absolute scale."""
    for s in SCALES:
        ref = stable_reference(z, y, s)
        got = summary_values(rows, s)
        for name, (value, grad, gap) in ref.items():
            v, g = got[name]
            rel = ((v - value).abs() / value.abs().clamp(min=1e-300)).max().item()
            size = (grad - gap).abs() + gap.abs()  # |G'| + |gap|
            grel = ((g - grad).abs() / size.clamp(min=grad_floor)).max().item()
            assert rel < value_tol, (name, s, rel)
            assert grel < grad_tol, (name, s, grel)


def random_logits(n=48, V=3000, seed=0):
    """Logits of every spread: nearly flat (std 0.01) to very sharp (std 10), some with a planted far top."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 1, n)[:, None]
    z = torch.randn(n, V, generator=g) * spread
    z[::4, :2] += 15 * torch.rand(len(z[::4]), 2, generator=g)  # an isolated top (and second) far above the rest
    z[1::5, 7] = z[1::5].max(-1).values  # exact ties at the top
    y = torch.randint(0, V, (n,), generator=g)
    y[::2] = z[::2].argmax(-1)  # half of the tokens correct
    return z.float(), y


def test_summary_matches_the_exact_values_and_gradients_on_random_logits():
    z, y = random_logits()
    rows = summarize_logits(z, y, max_scale=10.0)
    assert rows.shape == (len(y), summary_width(ScaleSummarySpec().intervals)) and rows.dtype == torch.float32
    assert_close_to_reference(z, y, rows, grad_tol=1e-3, grad_floor=1e-3)  # std up to 10, planted tops, ties
    view = SummaryView(rows)
    assert torch.equal(view.correct, z.argmax(-1) == y)
    assert torch.allclose(view.z_label, z.gather(1, y[:, None])[:, 0], atol=1e-5)
    assert torch.allclose(view.z_mean, z.mean(-1), atol=1e-5) and view.spec == ScaleSummarySpec()


def test_rows_do_not_depend_on_how_the_logits_are_split_among_chunks_and_threads(monkeypatch):
    from ats.model import scale_summary

    z, y = random_logits()
    threads = torch.get_num_threads()
    runs = {}
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for row_elements in (1, 1 << 17, 1 << 30):  # 1: one chunk per thread; 1 << 30: all rows at once
                monkeypatch.setattr(scale_summary, "ROW_ELEMENTS", row_elements)
                runs[n_threads, row_elements] = summarize_logits(z, y, max_scale=10.0)
    finally:
        torch.set_num_threads(threads)
    for (n_threads, _), rows in runs.items():  # each row is binned alone, in vocabulary order: the same bits
        assert torch.equal(rows, runs[n_threads, 1 << 30])
    # across thread counts only the matrix product over the bins may round differently
    torch.testing.assert_close(runs[2, 1], runs[1, 1], rtol=1e-6, atol=1e-7)


def test_summary_matches_the_exact_route_on_a_tiny_model(tiny_backbone):
    torch.manual_seed(0)
    hidden = torch.randn(40, tiny_backbone.hidden_size)
    z = tiny_backbone.logits(hidden).detach().float()  # (40, V) realistic-shaped logits of a random Llama
    y = torch.randint(0, z.shape[1], (40,))
    y[::3] = z[::3].argmax(-1)
    rows = summarize_logits(z, y, max_scale=10.0)
    assert_close_to_reference(z, y, rows)
    for s in (0.05, 1.0, 10.0):  # and the project's exact route itself, in float64, where it has no cancellation
        scale = torch.full((40,), s, dtype=torch.float64)
        exact = scaled_cross_entropy(z.double(), scale, y, lambda h: h)
        got = scaled_ce_from_summary(rows, scale)
        assert torch.allclose(got.ce_uniform, exact.ce_uniform, rtol=1e-5, atol=1e-7)
        assert torch.allclose(got.ce_label, exact.ce_label, rtol=1e-5, atol=1e-7)
        assert torch.equal(got.correct, exact.correct)


def test_ties_far_tops_and_two_token_vocabularies_match_the_reference():
    """The cases the binning meets at its edges: an exact tie at the top (correct only for the first maximum, as the
    exact route's argmax), a top hundreds of nats above the rest (the reference gap is not z_top - z_2 but a bin
    edge below it), a second logit within a bin of the top, and V = 2."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 500, generator=g) * 3
    z[0, [10, 20]] = 30.0  # a tie: label the second maximum
    z[1, [10, 20]] = 30.0  # a tie: label the first maximum
    z[2, 5] = 400.0  # far above the rest: exp(-s (z_top - z_j)) underflows float64 at s = 10
    z[3, 5], z[3, 6] = 12.0, 12.0 - 1e-3  # the second logit in the top's bin
    z[4, 5], z[4, 6] = 12.0, 12.0 - 1 / 64  # the second logit exactly one bin width below
    y = torch.tensor([20, 10, 5, 6, 5, 0])
    rows = summarize_logits(z, y, max_scale=10.0)
    assert SummaryView(rows).correct.tolist() == (z.argmax(-1) == y).tolist() == [False, True, True, False, True,
                                                                                   False]
    assert_close_to_reference(z, y, rows, grad_tol=1e-3, grad_floor=1e-3)  # as for the random logits above
    z2, y2 = torch.tensor([[0.0, 2.0], [1.0, 1.0], [3.0, -1.0]]), torch.tensor([1, 1, 1])
    rows2 = summarize_logits(z2, y2, max_scale=10.0)
    assert SummaryView(rows2).correct.tolist() == [True, False, False]
    assert_close_to_reference(z2, y2, rows2, grad_tol=1e-3, grad_floor=1e-3)  # a tie: d/ds is 0, here ~1e-7


def test_float32_scale_gives_float32_results_with_gradients():
    z, y = random_logits(n=8, V=500)
    rows = summarize_logits(z, y, max_scale=5.0, intervals=8)
    scale = torch.full((8,), 2.0, requires_grad=True)
    out = scaled_ce_from_summary(rows, scale)
    assert out.ce_label.dtype == torch.float32 and out.correct.dtype == torch.bool
    (out.ce_label.sum() + out.log_p_top.sum()).backward()
    assert scale.grad is not None and torch.isfinite(scale.grad).all()


def test_other_settings_change_the_rows_and_are_read_back():
    z, y = random_logits(n=4, V=300)
    rows = summarize_logits(z, y, max_scale=4.0, intervals=12, knee=0.5)
    assert SummaryView(rows).spec == ScaleSummarySpec(max_scale=4.0, intervals=12, knee=0.5)
    assert ScaleSummarySpec(max_scale=4.0, intervals=12, knee=0.5).nodes()[-1].item() == 4.0
    assert ScaleSummarySpec().describe() == {"max_scale": 10.0, "intervals": 48, "knee": 0.25, "version": 1}
    assert ScaleSummarySpec().width * 4 < 1152  # smaller than SmolLM2's fp16 hidden state


def test_bad_input_is_one_line_errors():
    z, y = random_logits(n=4, V=300)
    rows = summarize_logits(z, y, max_scale=4.0, intervals=8)
    with pytest.raises(ATSError, match=r"scale 5 is outside the summary's range \[0, 4\]"):
        scaled_ce_from_summary(rows, torch.full((4,), 5.0))
    with pytest.raises(ATSError, match="outside the summary's range"):
        scaled_ce_from_summary(rows, torch.full((4,), -0.5))  # 0 is allowed: tests/model/test_scale_summary_underflow
    with pytest.raises(ATSError, match="id 300 is outside the vocabulary"):
        summarize_logits(z, torch.full((4,), 300), max_scale=4.0)
    with pytest.raises(ATSError, match="not a scale summary"):
        scaled_ce_from_summary(rows[:, :-1], torch.ones(4))
    with pytest.raises(ATSError, match="expected summary"):
        scaled_ce_from_summary(rows, torch.ones(3))
    with pytest.raises(ATSError, match="intervals must be an integer >= 1"):
        ScaleSummarySpec(intervals=0)
