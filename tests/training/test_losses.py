"""Calibration losses: values and gradients against a naive (N, V) computation and, for the reference weighting,
against the authors' own formula computed independently on a batch with prompt and padding positions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ats.errors import ATSError
from ats.model.scaled_ce import scaled_cross_entropy
from ats.training.losses import calibration_loss

CASES = [("selective", "token"), ("selective", "reference"), ("none", "token"), ("full", "token"),
         ("top-label", "token")]


def make_case(N: int = 13, H: int = 8, V: int = 11, *, seed: int = 0, dtype=torch.float32, p_correct: float = 0.5):
    """Random hidden states, output layer, positive scales, and labels that are right about p_correct of the time."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype)
    scale = (0.3 + 2 * torch.rand(N, generator=g, dtype=dtype)).requires_grad_(True)
    z = hidden @ W.T
    random_labels = torch.randint(0, V, (N,), generator=g)
    labels = torch.where(torch.rand(N, generator=g) < p_correct, z.argmax(-1), random_labels)
    return hidden, W, scale, labels


def naive_loss(z, scale, labels, loss_type, alpha, weighting):
    """Materialise q = z * s and use torch's own cross-entropy; the reference weighting follows the authors' code."""
    q = z * scale[:, None]
    ce_y = F.cross_entropy(q, labels, reduction="none")
    ce_u = -F.log_softmax(q, -1).mean(-1)
    correct = z.argmax(-1) == labels
    if loss_type == "top-label":  # binary log loss of the top-1 probability (float64: 1 - p near p = 1)
        p_top = torch.softmax(q.double(), -1).max(-1).values
        return F.binary_cross_entropy(p_top, correct.double()).to(q.dtype)
    if loss_type == "none":
        return ce_y.mean()
    if loss_type == "full":
        return ((1 - alpha) * ce_y + alpha * ce_u).mean()
    if weighting == "token":
        per_token = torch.where(correct, (1 - alpha) * ce_y, alpha * ce_u)
        return per_token.mean()
    n = correct.numel()
    hard = ce_y[correct].mean() if correct.any() else torch.zeros(())
    smooth = ce_u[~correct].mean() if (~correct).any() else torch.zeros(())
    smooth_w = alpha * correct.sum() / n
    hard_w = (1 - alpha) * (~correct).sum() / n
    total = smooth_w + hard_w
    return hard * hard_w / total + smooth * smooth_w / total


@pytest.mark.parametrize("loss_type,weighting", CASES)
@pytest.mark.parametrize("alpha", [0.5, 0.2])
def test_matches_naive_value_and_grad(loss_type, weighting, alpha):
    hidden, W, scale, labels = make_case(seed=1)
    out = calibration_loss(hidden, scale, labels, lambda h: h @ W.T, loss_type=loss_type, alpha=alpha,
                           weighting=weighting, chunk_size=4)
    (grad,) = torch.autograd.grad(out.loss, scale)

    scale2 = scale.detach().clone().requires_grad_(True)
    expected = naive_loss(hidden @ W.T, scale2, labels, loss_type, alpha, weighting)
    (expected_grad,) = torch.autograd.grad(expected, scale2)

    assert 0 < out.n_correct < out.n_tokens == 13  # both groups present
    assert out.n_correct == int(((hidden @ W.T).argmax(-1) == labels).sum())
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_hand_computed_two_tokens_three_classes():
    # scale 1 everywhere, so q = z.
    # token 1: z = [0, 0, ln 2], y = 2 -> correct. softmax = [1, 1, 2] / 4.
    #   CE(q, y) = ln 4 - ln 2 = ln 2 = 0.693147
    #   CE(q, u) = ln 4 - (ln 2) / 3 = 1.386294 - 0.231049 = 1.155245
    #   dCE_y/ds = E_p[z] - z_y = (2/4) ln 2 - ln 2 = -ln 2 / 2 = -0.346574
    # token 2: z = [ln 3, 0, 0], y = 1 -> wrong (argmax 0). sum exp = 3 + 1 + 1 = 5.
    #   CE(q, y) = ln 5 - 0 = 1.609438
    #   CE(q, u) = ln 5 - (ln 3) / 3 = 1.609438 - 0.366204 = 1.243234
    #   dCE_u/ds = E_p[z] - mean z = (3/5) ln 3 - (ln 3) / 3 = (4/15) ln 3 = 0.292962
    ln2, ln3, ln5 = math.log(2), math.log(3), math.log(5)
    z = torch.tensor([[0.0, 0.0, ln2], [ln3, 0.0, 0.0]])
    labels = torch.tensor([2, 1])
    hidden = torch.eye(2)  # logits_fn(h) = h @ z picks each token's row
    fn = lambda h: h @ z  # noqa: E731

    def run(**kw):
        scale = torch.ones(2, requires_grad=True)
        out = calibration_loss(hidden, scale, labels, fn, **kw)
        out.loss.backward()
        return out, scale.grad

    # selective, token: mean(0.5 * ln 2, 0.5 * 1.243234) = 0.25 * (0.693147 + 1.243234) = 0.484095
    out, grad = run(loss_type="selective", alpha=0.5, weighting="token")
    assert out.n_correct == 1 and out.n_tokens == 2
    assert out.loss.item() == pytest.approx(0.25 * (ln2 + ln5 - ln3 / 3), abs=1e-6)
    assert out.loss.item() == pytest.approx(0.484095, abs=1e-6)
    # grad = [0.25 * -0.346574, 0.25 * 0.292962] = [-0.086643, 0.073241]
    torch.testing.assert_close(grad, torch.tensor([0.25 * -ln2 / 2, 0.25 * 4 / 15 * ln3]))

    # selective, reference: n_c = n_w = 1 -> w_c = 0.5 * 0.5 = w_w = 0.25, normalised to 0.5 each:
    # 0.5 * 0.693147 + 0.5 * 1.243234 = 0.968190
    out, _ = run(loss_type="selective", alpha=0.5, weighting="reference")
    assert out.loss.item() == pytest.approx(0.968190, abs=1e-6)

    # none: (0.693147 + 1.609438) / 2 = 1.151293
    out, _ = run(loss_type="none")
    assert out.loss.item() == pytest.approx(1.151293, abs=1e-6)
    assert out.nll == pytest.approx(1.151293, abs=1e-6)

    # full, alpha 0.5: token 1 0.5 * (0.693147 + 1.155245) = 0.924196; token 2 0.5 * (1.609438 + 1.243234) = 1.426336
    # mean = 1.175266
    out, _ = run(loss_type="full", alpha=0.5)
    assert out.loss.item() == pytest.approx(1.175266, abs=1e-6)


def test_gradcheck_float64():
    hidden, W, scale, labels = make_case(N=7, H=5, V=6, seed=2, dtype=torch.float64)
    scale = scale.detach().requires_grad_(True)
    fn = lambda h: h @ W.T  # noqa: E731

    def both(s):
        out = scaled_cross_entropy(hidden, s, labels, fn, chunk_size=3)
        return out.ce_label, out.ce_uniform, out.log_p_top

    assert torch.autograd.gradcheck(both, (scale,), eps=1e-6, atol=1e-7)
    for loss_type, weighting in CASES:
        f = lambda s: calibration_loss(hidden, s, labels, fn, loss_type=loss_type, weighting=weighting,  # noqa: E731
                                       chunk_size=2).loss
        assert torch.autograd.gradcheck(f, (scale,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_type,weighting", CASES)
def test_chunk_invariance_and_bounded_chunks(loss_type, weighting):
    N = 10
    hidden, W, scale, labels = make_case(N=N, seed=3)
    results = []
    for chunk in (1, 3, N, 4 * N):
        calls = []

        def fn(h):
            calls.append(h.shape[0])
            return h @ W.T

        s = scale.detach().clone().requires_grad_(True)
        out = calibration_loss(hidden, s, labels, fn, loss_type=loss_type, weighting=weighting, chunk_size=chunk)
        n_forward_calls = len(calls)
        out.loss.backward()
        assert len(calls) == n_forward_calls == math.ceil(N / chunk)  # backward never recomputes logits
        assert max(calls) <= chunk
        results.append((out.loss.detach(), s.grad))
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("weighting", ["token", "reference"])
def test_selective_gradient_step_moves_confidence_the_right_way(weighting):
    hidden, W, scale, labels = make_case(N=40, V=20, seed=4)
    z = hidden @ W.T
    correct = z.argmax(-1) == labels
    assert correct.any() and (~correct).any()
    out = calibration_loss(hidden, scale, labels, lambda h: h @ W.T, weighting=weighting)
    out.loss.backward()
    with torch.no_grad():
        new_scale = scale - 0.5 * scale.grad
        assert (new_scale > 0).all()
        before = torch.softmax(z * scale[:, None], -1).max(-1).values
        after = torch.softmax(z * new_scale[:, None], -1).max(-1).values
    assert (after[correct] > before[correct]).all()  # sharper where the model is right
    assert (after[~correct] < before[~correct]).all()  # flatter where it is wrong


def test_half_precision_inputs_compute_in_float32():
    hidden, W, scale, labels = make_case(seed=5)
    out16 = calibration_loss(hidden.bfloat16(), scale, labels, lambda h: h @ W.T.bfloat16())
    out32 = calibration_loss(hidden.bfloat16().float(), scale, labels,
                             lambda h: (h.bfloat16() @ W.T.bfloat16()).float())
    assert out16.loss.dtype == torch.float32
    torch.testing.assert_close(out16.loss, out32.loss)
    out16.loss.backward()
    assert scale.grad is not None and torch.isfinite(scale.grad).all()


def test_empty_groups_and_empty_input_give_no_nan():
    hidden, W, scale, labels = make_case(N=6, seed=6)
    z = hidden @ W.T
    fn = lambda h: h @ W.T  # noqa: E731
    all_right = z.argmax(-1)
    all_wrong = (all_right + 1) % W.shape[0]
    for y in (all_right, all_wrong):
        for weighting in ("token", "reference"):
            for alpha in (0.0, 0.5, 1.0):
                s = scale.detach().clone().requires_grad_(True)
                out = calibration_loss(hidden, s, y, fn, weighting=weighting, alpha=alpha)
                out.loss.backward()
                assert torch.isfinite(out.loss) and torch.isfinite(s.grad).all()
    # the reference weighting has no loss when one group is empty (as in the authors' code)
    out = calibration_loss(hidden, scale, all_right, fn, weighting="reference")
    assert out.loss.item() == 0.0 and out.n_correct == 6
    # token weighting still sharpens an all-correct batch
    out = calibration_loss(hidden, scale, all_right, fn, weighting="token")
    assert out.loss.item() > 0

    s = torch.ones(0, requires_grad=True)
    out = calibration_loss(torch.zeros(0, 8), s, torch.zeros(0, dtype=torch.long), fn)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.n_tokens == 0


def test_bad_arguments_raise_atserror():
    hidden, W, scale, labels = make_case(seed=7)
    fn = lambda h: h @ W.T  # noqa: E731
    with pytest.raises(ATSError, match="'smooth'"):
        calibration_loss(hidden, scale, labels, fn, loss_type="smooth")
    with pytest.raises(ATSError, match="'sample'"):
        calibration_loss(hidden, scale, labels, fn, weighting="sample")
    with pytest.raises(ATSError, match="1.5"):
        calibration_loss(hidden, scale, labels, fn, alpha=1.5)
    with pytest.raises(ATSError, match="-0.1"):
        calibration_loss(hidden, scale, labels, fn, alpha=-0.1)
    with pytest.raises(ATSError, match="chunk_size"):
        calibration_loss(hidden, scale, labels, fn, chunk_size=0)
    with pytest.raises(ATSError, match="-100"):
        calibration_loss(hidden, scale, torch.full_like(labels, -100), fn)
    with pytest.raises(ATSError, match="shape|expected"):
        calibration_loss(hidden, scale[:-1], labels, fn)


def official_selective_smoothing(logits, labels, alpha):
    """The authors' `SelectiveSmoothingLoss(label_smoothing_type="uniform", label_smoothing=1.0,
    weighted_average=True)` written out on flattened shifted positions (N_all, V), labels with -100 on prompt and
    padding positions (their collator never drops them): -100 never equals the argmax, so those positions are
    "wrong", and torch's CrossEntropyLoss gives them 0."""
    correct = logits.argmax(-1) == labels
    hard = F.cross_entropy(logits[correct], labels[correct], reduction="none")
    smooth = F.cross_entropy(logits[~correct], labels[~correct], reduction="none", label_smoothing=1.0)
    smooth_weight = alpha * correct.sum() / correct.numel()
    hard_weight = (1 - alpha) * (~correct).sum() / correct.numel()
    total = smooth_weight + hard_weight
    return (hard * hard_weight / total).mean() + (smooth * smooth_weight / total).mean()


@pytest.mark.parametrize("alpha", [0.5, 0.2, 0.9])
def test_reference_weighting_is_the_official_loss_with_prompt_and_padding(alpha):
    # a batch of 3 sequences padded to T = 9: prompt positions, response positions, padding (labels -100 except on
    # the response), shifted as the official model does (position t predicts token t + 1: T - 1 positions per row)
    B, T, H, V = 3, 9, 6, 10
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, T - 1, H, generator=g)
    W = torch.randn(V, H, generator=g)
    z = hidden @ W.T  # (B, T-1, V)
    labels = torch.full((B, T - 1), -100)
    spans = [(2, 7), (3, 5), (1, 8)]  # response positions [a, b) of each row; the rest is prompt or padding
    for row, (a, b) in enumerate(spans):
        right = torch.rand(b - a, generator=g) < 0.5
        labels[row, a:b] = torch.where(right, z[row, a:b].argmax(-1), torch.randint(0, V, (b - a,), generator=g))
    scale_full = 0.5 + torch.rand(B, T - 1, generator=g)
    select = labels != -100
    n = int(select.sum())
    ignored = B * (T - 1) - n
    assert ignored > 0 and 0 < int((z.argmax(-1) == labels)[select].sum()) < n

    scale = scale_full[select].clone().requires_grad_(True)
    ours = calibration_loss(hidden[select], scale, labels[select], lambda h: h @ W.T, loss_type="selective",
                            alpha=alpha, weighting="reference", ignored=ignored, chunk_size=4)
    (grad,) = torch.autograd.grad(ours.loss, scale)

    full = scale_full.clone().requires_grad_(True)
    official = official_selective_smoothing((z * full[..., None]).reshape(-1, V), labels.reshape(-1), alpha)
    (official_grad,) = torch.autograd.grad(official, full)
    torch.testing.assert_close(ours.loss, official, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, official_grad[select], rtol=1e-4, atol=1e-6)
    assert official_grad[~select].abs().max() == 0  # -100 positions carry no gradient in the official loss either

    # dropping the -100 positions first (ignored=0) changes the loss: the effective alpha is not the same
    dropped = calibration_loss(hidden[select], scale_full[select], labels[select], lambda h: h @ W.T,
                               loss_type="selective", alpha=alpha, weighting="reference")
    assert abs(dropped.loss.item() - official.item()) > 1e-3


def test_top_label_loss_is_minimised_at_the_calibrated_confidence():
    # ten tokens with the same realistic logits (a Gaussian vocabulary, the top token 1 nat above the rest), the top
    # token right 6 times out of 10: the log loss of the top-1 confidence (a proper scoring rule) is minimised where
    # the calibrated top-1 probability is 0.6; the selective loss's optimum is far below it (its pull towards uniform
    # on wrong tokens outweighs the pull towards the label on right ones)
    V = 8192  # a small real vocabulary; both optima hold at SmolLM2's 49152 too (0.601, 0.195), 7x slower
    z = torch.randn(1, V, generator=torch.Generator().manual_seed(0)).repeat(10, 1) * 2
    z[:, 0] = z.max() + 1.0
    labels = torch.where(torch.arange(10) < 6, 0, 1)
    hidden = torch.eye(10)
    fn = lambda h: h @ z  # noqa: E731
    scales = torch.linspace(0.05, 4.0, 400)

    def optimum(loss_type):
        losses = [calibration_loss(hidden, s.repeat(10), labels, fn, loss_type=loss_type).loss.item() for s in scales]
        return torch.softmax(z[0] * scales[int(torch.tensor(losses).argmin())], -1)[0].item()

    assert optimum("top-label") == pytest.approx(0.6, abs=0.01)
    assert optimum("selective") < 0.3
