"""Thermometer in the `ats` lm-eval model: one temperature per request, read at the context's last token (the first
position predicting the continuation, where `ats eval` reads it) and applied to the continuation; a rolling window
is its own prompt. The log-likelihoods equal the calibrator's own `apply` on the backbone's logits and hidden states
of each request alone, in batches of mixed lengths, with rows that look alike but end elsewhere, and through a
shared prompt prefix."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from ats.calibrators import load_calibrator
from ats.integrations.lm_eval_model import ATSLM
from ats.integrations.prompt_ends import PromptEnd, PromptEnds

from helpers import random_thermometer
from lmeval_helpers import rolling_loglikelihood

SHARED = "The following are questions about capitals and numbers, each with one short answer. " * 3  # > 32 tokens


@pytest.fixture(scope="module")
def thermometer_dir(folder_backbone, tmp_path_factory):
    folder = tmp_path_factory.mktemp("thermometer") / "thermometer"
    random_thermometer(folder_backbone.hidden_size, 3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def thermometer(thermometer_dir, folder_backbone):
    return load_calibrator(thermometer_dir, backbone=folder_backbone)


def request_loglikelihood(backbone, calibrator, context: str, continuation: str) -> tuple[float, float]:
    """Independently, for one request alone: (the continuation's log-likelihood under `calibrator.apply` with the
    temperature read at the context's last token (`index` from there, as `ats eval` passes it), that temperature)."""
    tok = backbone.tokenizer
    ctx, cont = tok(context).input_ids, tok(continuation, add_special_tokens=False).input_ids
    hidden, _ = backbone.forward(torch.tensor([ctx + cont[:-1]]))  # (1, T, H): position t predicts token t+1
    e, T = len(ctx) - 1, hidden.shape[1]
    q = calibrator.apply(backbone.logits(hidden[:, e:]), hidden, index=torch.arange(e, T)[None])  # (1, T - e, V)
    logp = torch.log_softmax(q, dim=-1)[0]
    temperature = float(calibrator.temperature(hidden[:, e])[0])
    return float(logp.gather(1, torch.tensor(cont)[:, None]).sum()), temperature


def _loglikelihoods(lm, pairs) -> list[float]:
    return [v for v, _ in lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])]


PAIRS = [("Q: What is the capital of France?\nA:", " Paris"), ("Q: What is 2 plus 2?\nA:", " 4"),
         ("The capital", " of France is Paris"), ("The capital of", " France is Paris"),  # one row, two ends
         ("Hi", " there, how are you?"), ("Once upon a time there was a quick brown fox.", " It jumps.")]


def test_request_loglikelihoods_are_the_calibrators_own(folder_backbone, thermometer, tiny_folder, thermometer_dir):
    lm = ATSLM(pretrained=str(tiny_folder), calibrator=str(thermometer_dir), device="cpu", batch_size=4)
    got = _loglikelihoods(lm, PAIRS)
    want = [request_loglikelihood(folder_backbone, thermometer, *p) for p in PAIRS]
    assert got == pytest.approx([w for w, _ in want], abs=1e-4)
    temperatures = [t for _, t in want]
    assert max(temperatures) / min(temperatures) > 1.2  # the temperature varies by prompt
    assert temperatures[2] != temperatures[3]  # the row of both is scored with two temperatures
    plain = _loglikelihoods(ATSLM(pretrained=str(tiny_folder), calibrator="none", device="cpu", batch_size=4), PAIRS)
    assert max(abs(a - b) for a, b in zip(got, plain)) > 0.5


def test_batch_size_auto_probes_without_prompt_ends(folder_backbone, thermometer, tiny_folder, thermometer_dir):
    """HFLM's batch-size probe runs rows no request has (no prompt end): answered, and the numbers are the same."""
    lm = ATSLM(pretrained=str(tiny_folder), calibrator=str(thermometer_dir), device="cpu", batch_size="auto",
               max_batch_size=4, max_length=64)
    want = [request_loglikelihood(folder_backbone, thermometer, *p)[0] for p in PAIRS]
    assert _loglikelihoods(lm, PAIRS) == pytest.approx(want, abs=1e-4)


def test_rows_that_look_alike_but_end_elsewhere_run_apart():
    """Rows [5, 6, 7] split 2 + 2 and 3 + 1, and [5, 6, 7, 0] (the same ids once right-padded with zeros): three
    prompt ends for one key, so three runs; the same request twice and another row share the first."""
    requests = [(None, [5, 6], [7, 8]), (None, [5, 6, 7], [8]), (None, [5, 6, 7], [0, 9]), (None, [1, 2], [3]),
                (None, [5, 6], [7, 9])]
    runs = PromptEnds.layers(requests, max_length=100, rolling=False)
    assert [indices for indices, _ in runs] == [[0, 3, 4], [1], [2]]
    assert [(e.length, e.at) for e in (ends[(5, 6, 7)] for _, ends in runs)] == [(3, 1), (3, 2), (4, 2)]
    (_, ends), = PromptEnds.layers(requests[:1], max_length=2, rolling=True)  # truncated on the left to 2 tokens
    assert ends == {(6, 7): PromptEnd(length=2, at=1, whole=True)}


def test_rolling_loglikelihood_reads_the_whole_row(folder_backbone, thermometer, tiny_folder, thermometer_dir):
    lm = ATSLM(pretrained=str(tiny_folder), calibrator=str(thermometer_dir), device="cpu", batch_size=2)
    texts = ["The quick brown fox jumps over the lazy dog.", "Calibration is about knowing what you know, mostly."]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    for text, value in zip(texts, got):  # the temperature read at each window's last token
        assert value == pytest.approx(rolling_loglikelihood(folder_backbone, thermometer, text)[0], abs=1e-4)


def test_shared_prefix_keeps_each_requests_temperature(folder_backbone, thermometer, tiny_folder, thermometer_dir):
    """Requests sharing a long prefix run on its cached encoding; two continuations sharing their first word make
    the shared prefix reach past the context's end, where the temperature is still read."""
    pairs = [(SHARED + "Q: What is the capital of Italy?\nA:", " Rome is the capital"),
             (SHARED + "Q: What is the capital of Italy?\nA:", " Rome, of course"),
             (SHARED + "Q: What is 3 plus 4?\nA:", " 7"), (SHARED + "Q: Which city is in Spain?\nA:", " Madrid")]
    shared = ATSLM(pretrained=str(tiny_folder), calibrator=str(thermometer_dir), device="cpu", batch_size=4)
    want = [request_loglikelihood(folder_backbone, thermometer, *p)[0] for p in pairs]
    assert _loglikelihoods(shared, pairs[:2]) == pytest.approx(want[:2], abs=1e-4)  # prefix: context + " Rome"
    assert _loglikelihoods(shared, pairs) == pytest.approx(want, abs=1e-4)  # prefix: SHARED + "Q: Wh..."
    assert shared.prefixes.rows_served == shared.prefixes.rows_seen == 2 + len(pairs)  # every row ran on a prefix
    whole = ATSLM(pretrained=str(tiny_folder), calibrator=str(thermometer_dir), device="cpu", batch_size=4,
                  prefix_cache=0)
    assert _loglikelihoods(whole, pairs) == pytest.approx(want, abs=1e-4)


def test_generate_until_samples_with_the_prompts_temperature(folder_backbone, thermometer, tiny_folder,
                                                             thermometer_dir):
    from ats.generation import generate_calibrated

    lm = ATSLM(pretrained=str(tiny_folder), calibrator=str(thermometer_dir), device="cpu", batch_size=2)
    prompts = ["Write one word about the sea and the wind:", "Hello"]  # longest first: lm-eval's batch order
    kwargs = dict(until=["\n\n\n"], max_gen_toks=6, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    torch.manual_seed(0)
    got = lm.generate_until([Instance("generate_until", {}, (p, kwargs), i) for i, p in enumerate(prompts)])
    torch.manual_seed(0)
    want = generate_calibrated(folder_backbone, thermometer, prompts, max_new_tokens=6, do_sample=True,
                               temperature=1.0, chat_template=False, stop_strings=["\n\n\n"])
    assert got == [g.text for g in want]
