"""Thermometer baseline: Gamma prior, one temperature per prompt, argmax kept, fitting lowers NLL, save/load."""

import math
from types import SimpleNamespace

import pytest
import torch
from scipy import stats

from ats.calibrators import calibrator_class, load_calibrator
from ats.calibrators.base import Uncalibrated
from ats.calibrators.thermometer import Thermometer, gamma_neg_log_prior, prompt_positions, prompt_states
from ats.errors import ATSError
from ats.evaluation.evaluate import evaluate
from ats.evaluation.token_eval import token_confidences
from ats.model.labels import IGNORE_INDEX
from ats.training.data import load_instructions, tokenize_instructions
from ats.training.features import extract_features


@pytest.fixture(scope="module")
def store(tiny_backbone, tokenizer, tmp_path_factory):
    records = load_instructions("alpaca_gpt4", limit=16, seed=0)
    examples = tokenize_instructions(tokenizer, records, max_length=80)[0]
    return extract_features(tiny_backbone, examples, tmp_path_factory.mktemp("thermo") / "f", shard_sequences=8,
                            dtype="float32", progress=False)


def _nll(store, backbone, calibrator) -> float:
    """Mean NLL over all response tokens, the calibrator applied as token-level evaluation applies it."""
    total, n = 0.0, 0
    for hidden, labels in store.sequences():
        pos = (labels != IGNORE_INDEX).nonzero().squeeze(-1)
        z = backbone.logits(hidden[pos].float()).float()
        q = z if calibrator is None else calibrator.calibrate(z[None], hidden[None].float(), index=pos[None])[0]
        total += float(torch.nn.functional.cross_entropy(q, labels[pos], reduction="sum"))
        n += pos.numel()
    return total / n


def test_gamma_prior_matches_scipy():
    t = torch.tensor([0.05, 0.3, 1.0, 2.5, 7.0], dtype=torch.float64)
    for alpha, beta in [(1.25, 4.0), (2.0, 0.5), (0.7, 3.0)]:
        ours = gamma_neg_log_prior(t, alpha, beta)
        ref = -stats.gamma.logpdf(t.numpy(), a=alpha, scale=beta)
        assert ours.numpy() == pytest.approx(ref, rel=1e-10, abs=1e-10)
    # the default prior (shape 1.25, scale 4, as the authors' code) has its mode at T = 1
    grid = torch.linspace(0.2, 3.0, 2801, dtype=torch.float64)
    cal = Thermometer(hidden_size=4)
    assert float(grid[cal.prior(grid).argmin()]) == pytest.approx(1.0, abs=2e-3)


def test_prompt_positions_are_the_first_response_label():
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, 8, 9, 1], [-100] * 5])
    assert prompt_positions(labels).tolist() == [2, 1, -1]


def test_one_temperature_per_row_and_argmax_kept():
    torch.manual_seed(0)
    cal = Thermometer(hidden_size=8, mlp_hidden=16)
    cal.fitted = True
    with torch.no_grad():  # move away from the T = 1 start so that rows really differ
        cal.net.final.weight.fill_(1.0)
    hidden = torch.randn(3, 6, 8)
    logits = torch.randn(3, 4, 50) * 5
    index = torch.tensor([[1, 2, 3, 4], [0, 1, 2, 3], [2, 3, 4, 5]])
    q = cal.calibrate(logits, hidden, index=index)
    assert q.shape == logits.shape
    assert torch.equal(q.argmax(-1), logits.argmax(-1))
    ratio = logits / q  # T per (row, position)
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-5)  # constant across a row's tokens
    expected = cal.temperature(hidden[torch.arange(3), index[:, 0]])  # read from the first index position
    assert torch.allclose(ratio[:, 0, 0], expected, rtol=1e-5)
    assert not torch.allclose(expected, expected[:1].expand(3))  # different prompts, different temperatures
    # without index: the last real token per attention mask
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0]])
    q2 = cal.calibrate(torch.randn(3, 6, 50), hidden, attention_mask=mask)
    assert q2.shape == (3, 6, 50)
    # 2-D logits: each row its own prompt
    q3 = cal.calibrate(logits[:, 0], hidden[:, 0])
    assert torch.allclose(logits[:, 0] / q3, cal.temperature(hidden[:, 0])[:, None].expand(3, 50), rtol=1e-5)


def test_unfitted_and_fit_refused():
    cal = Thermometer(hidden_size=8)
    with pytest.raises(ATSError, match="not fitted"):
        cal.calibrate(torch.randn(2, 1, 5), torch.randn(2, 3, 8), index=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ATSError, match="needs the source's store"):
        cal.fit(lambda: iter([]))
    cal.fitted = True
    with pytest.raises(ATSError, match="hidden states"):
        cal.calibrate(torch.randn(2, 5))
    with pytest.raises(ATSError, match="prior_beta"):
        Thermometer(hidden_size=8, prior_beta=0.0)


def test_fitting_lowers_nll_and_round_trips(store, tiny_backbone, tmp_path):
    cal = Thermometer(hidden_size=tiny_backbone.hidden_size, mlp_hidden=32, epochs=6, lr=1e-2, batch_size=4)
    before = _nll(store, tiny_backbone, None)
    cal.fit_sequences(store, tiny_backbone.logits)
    after = _nll(store, tiny_backbone, cal)
    assert len(cal.history) == 6 and all(math.isfinite(h["loss"]) for h in cal.history)
    assert cal.history[-1]["nll"] < cal.history[0]["nll"]
    assert after < before - 0.05, (before, after)

    # token-level evaluation applies it through the generic path
    out = token_confidences(store, tiny_backbone, {"thermometer": cal}, progress=False)
    conf, correct = out["thermometer"]
    assert conf.shape == correct.shape == (store.meta["response_tokens"],)

    # and a task applies it through evaluate() (index = the answer position)
    quiz = tmp_path / "quiz.jsonl"
    quiz.write_text('{"question": "Which is a colour?", "choices": ["red", "seven"], "answer": 0}\n'
                    '{"question": "Pick the largest number.", "choices": ["1", "100"], "answer": 1}\n')
    results = evaluate(tiny_backbone, {"none": Uncalibrated(), "thermometer": cal}, [f"mc:{quiz}"], tmp_path / "eval",
                       n_bins=5, progress=False)
    assert results["mc_quiz"]["thermometer"]["n"] == 2
    assert results["mc_quiz"]["thermometer"]["accuracy"] == results["mc_quiz"]["none"]["accuracy"]

    cal.save_pretrained(tmp_path / "thermo")
    for loaded in (load_calibrator(tmp_path / "thermo"), Thermometer.from_pretrained(tmp_path / "thermo")):
        assert isinstance(loaded, Thermometer) and loaded.config() == cal.config()
        hidden, labels = next(store.sequences())
        pos = (labels != IGNORE_INDEX).nonzero().squeeze(-1)[None]
        z = tiny_backbone.logits(hidden.float())[None]
        torch.testing.assert_close(loaded.calibrate(z, hidden[None].float(), index=pos),
                                   cal.calibrate(z, hidden[None].float(), index=pos))
    assert calibrator_class("thermometer") is Thermometer
    loaded.check_backbone(tiny_backbone)
    with pytest.raises(ATSError, match="hidden size"):
        Thermometer(hidden_size=tiny_backbone.hidden_size + 1).check_backbone(tiny_backbone)


def test_sequence_ids_and_prompt_states_align_with_the_sequences(store):
    ids = store.response_sequence_ids()
    prompts = prompt_states(store)
    for i, (hidden, labels) in enumerate(store.sequences()):
        pos = (labels != IGNORE_INDEX).nonzero().squeeze(-1)
        assert int((ids == i).sum()) == pos.numel()
        torch.testing.assert_close(prompts[i], hidden[pos[0]].float())
    subset = store._token_subset(40, 0)
    torch.testing.assert_close(store.response_sequence_ids(max_tokens=40), ids[subset])
    all_hidden = torch.cat([h for h, _ in store.response_tokens()])
    torch.testing.assert_close(torch.cat([h for h, _ in store.response_tokens(max_tokens=40)]), all_hidden[subset])


def test_fit_on_the_summary_lowers_nll_like_fit_on_sequences(store, tiny_backbone):
    before = _nll(store, tiny_backbone, None)
    fitted = {}
    summary = SimpleNamespace(summary=store.response_summary(), sequence_ids=store.response_sequence_ids(),
                              store=store)
    for route in ("sequences", "summary"):
        cal = Thermometer(hidden_size=tiny_backbone.hidden_size, mlp_hidden=32, epochs=6, lr=1e-2, batch_size=4)
        if route == "summary":
            cal.fit(summary)
        else:
            cal.fit(SimpleNamespace(summary=None, store=store, logits_fn=tiny_backbone.logits))
        fitted[route] = _nll(store, tiny_backbone, cal)
        assert len(cal.history) == 6 and cal.history[-1]["nll"] < cal.history[0]["nll"]
    assert fitted["summary"] < before - 0.05, (before, fitted)
    assert fitted["summary"] == pytest.approx(fitted["sequences"], abs=0.05)
    with pytest.raises(ATSError, match="summary rows but sequence_ids"):
        Thermometer(hidden_size=tiny_backbone.hidden_size).fit(
            SimpleNamespace(summary=summary.summary, sequence_ids=torch.zeros(3, dtype=torch.long), store=store))
