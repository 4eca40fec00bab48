"""A planted per-token temperature: labels drawn from softmax(z * exp(tau*(h))) with tau* a known function of h.

A per-token head trained with plain cross-entropy (a proper scoring rule) must recover tau*; the global control (one
temperature for every token) cannot, whatever it is trained to. This is the property ATS relies on, shown where the
answer is known.
"""

import torch

from ats.model.heads import HeadConfig, build_head
from ats.training.losses import calibration_loss

H, V = 16, 50


def planted(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    tau_true = 0.7 * hidden[:, 0]  # the temperature varies per token, from 1/e^1.4 to e^1.4 around 1
    labels = torch.multinomial(torch.softmax((hidden @ W.T) * tau_true.exp()[:, None], -1), 1, generator=g)[:, 0]
    return hidden, labels, tau_true


W = torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 3 / H ** 0.5


def train(head_type: str, hidden, labels, steps: int = 150) -> torch.nn.Module:
    torch.manual_seed(0)
    head = build_head(HeadConfig(head_type=head_type, hidden_size=H))
    optimizer = torch.optim.Adam(head.parameters(), lr=0.1)
    for _ in range(steps):
        tau = head(hidden[None])[0]  # (N,)
        loss = calibration_loss(hidden, tau.exp(), labels, lambda h: h @ W.T, loss_type="none").loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def test_a_per_token_head_recovers_a_planted_temperature_and_a_global_one_cannot():
    hidden, labels, _ = planted(2500, seed=1)
    test_hidden, test_labels, tau_true = planted(1000, seed=2)
    fn = lambda h: h @ W.T  # noqa: E731
    linear, constant = train("linear", hidden, labels), train("constant", hidden, labels)
    with torch.no_grad():
        tau_linear = linear(test_hidden[None])[0]
        tau_constant = constant(test_hidden[None])[0]
        nll = {name: calibration_loss(test_hidden, tau.exp(), test_labels, fn, loss_type="none").nll
               for name, tau in (("linear", tau_linear), ("constant", tau_constant), ("true", tau_true))}
    assert torch.corrcoef(torch.stack([tau_linear, tau_true]))[0, 1] > 0.97
    assert (tau_linear - tau_true).abs().mean() < 0.12
    # the best single temperature is still far from the per-token truth, and predicts worse
    assert tau_constant.std() < 1e-6 and (tau_constant - tau_true).abs().mean() > 0.4
    assert nll["linear"] < nll["constant"] - 0.02 and abs(nll["linear"] - nll["true"]) < 0.01
