"""The `ats` lm-eval model: uncalibrated it is lm-eval's `hf` model; with a head its log-likelihoods (multiple choice,
rolling) are those of `ats eval` and of Backbone.forward + Calibrator.apply; generate_until samples from the
calibrated distribution; embedded model names and saved baselines load; bad calibrators are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from ats.calibrators import build_calibrator, load_calibrator
from ats.calibrators.ats import ATSCalibrator
from ats.errors import ATSError
from ats.evaluation.tasks.multiple_choice import MultipleChoiceTask
from ats.generation import generate_calibrated
from ats.integrations.lm_eval_model import ATSLM, check_calibrator
from ats.model.backbone import _embedded_gguf, cache_folder

from lmeval_helpers import TASK, loglikelihoods, read_lines, rolling_loglikelihood


def choice_loglikelihood(backbone, calibrator, context: str, continuation: str) -> float:
    """Independently: sum of log softmax(calibrated logits) of the continuation's tokens after the context."""
    tok = backbone.tokenizer
    ctx, cont = tok(context).input_ids, tok(continuation, add_special_tokens=False).input_ids
    ids = torch.tensor([ctx + cont])
    hidden, _ = backbone.forward(ids[:, :-1])  # (1, T-1, H): position t predicts token t+1
    q = calibrator.apply(backbone.logits(hidden), hidden)  # (1, T-1, V)
    logp = torch.log_softmax(q, dim=-1)[0, len(ctx) - 1:]  # (len(cont), V), float32 as `ats eval` scores
    return float(logp.gather(1, torch.tensor(cont)[:, None]).sum())


def test_uncalibrated_ats_model_is_lm_evals_hf_model(lm_eval_runs):
    hf, none = read_lines(lm_eval_runs["hf"]), read_lines(lm_eval_runs["none"])
    assert len(hf) == len(none) == 40
    for a, b in zip(hf, none):
        assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"]
        assert a["filtered_resps"] == b["filtered_resps"]  # the same strings: bit-identical log-likelihoods
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    results = [json.loads(next(p.parent.glob("results_*.json")).read_text())["results"][TASK]
               for p in (lm_eval_runs["hf"], lm_eval_runs["none"])]
    assert results[0]["acc,none"] == results[1]["acc,none"]


def test_head_loglikelihoods_are_ats_scoring(lm_eval_runs, folder_backbone, head_dir, toy_task):
    calibrator = load_calibrator(head_dir, backbone=folder_backbone)
    rows = read_lines(lm_eval_runs["head"])
    lm_eval_lls = np.array([loglikelihoods(r) for r in rows])  # (N, 4)
    ours = np.array([[choice_loglikelihood(folder_backbone, calibrator, *pair.values())
                      for pair in r["arguments"].values()] for r in rows])
    np.testing.assert_allclose(lm_eval_lls, ours, rtol=0, atol=1e-5)
    uncalibrated = np.array([loglikelihoods(r) for r in read_lines(lm_eval_runs["none"])])
    assert np.abs(lm_eval_lls - uncalibrated).max() > 0.5  # the head does change the log-likelihoods

    # `ats eval`'s likelihood scoring of the same questions ("Q: {question}\nA:" + " {choice}"): same confidences
    result = MultipleChoiceTask(toy_task / f"{TASK}.jsonl", "likelihood").run(
        folder_backbone, {"ats": calibrator}, progress=False)["ats"]
    probs = torch.softmax(torch.tensor(lm_eval_lls), dim=1).numpy()
    np.testing.assert_allclose(probs.max(axis=1), result.confidence, rtol=0, atol=1e-5)
    assert (probs.argmax(axis=1) == result.extra["prediction"]).all()
    assert [r["acc"] for r in rows] == [float(c) for c in result.correct]


@pytest.fixture(scope="module")
def ats_lm(tiny_folder, head_dir) -> ATSLM:
    return ATSLM(pretrained=str(tiny_folder), calibrator=str(head_dir), device="cpu", batch_size=2)


def test_rolling_loglikelihood_is_calibrated(ats_lm, folder_backbone, head_dir):
    calibrator = load_calibrator(head_dir, backbone=folder_backbone)
    texts = ["The quick brown fox jumps over the lazy dog.", "Calibration is about knowing what you know."]
    got = ats_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    for text, value in zip(texts, got):
        expected, n = rolling_loglikelihood(folder_backbone, calibrator, text)
        assert value == pytest.approx(expected, abs=1e-5 * n)  # 1e-5 per token (float32, batch of 2)


def _generate(lm, prompts: list[str], **gen_kwargs) -> list[str]:
    requests = [Instance("generate_until", {}, (p, gen_kwargs), i) for i, p in enumerate(prompts)]
    torch.manual_seed(0)
    return lm.generate_until(requests)


def test_generate_until_samples_from_the_calibrated_distribution(ats_lm, tiny_folder, folder_backbone, head_dir):
    prompts = ["Write one word about the sea and the wind:", "Hello"]  # longest first: lm-eval's batch order
    sampling = dict(until=["\n\n\n"], max_gen_toks=6, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    calibrated = _generate(ats_lm, prompts, **sampling)
    calibrator = load_calibrator(head_dir, backbone=folder_backbone)  # before seeding: building a head draws weights
    torch.manual_seed(0)
    expected = generate_calibrated(folder_backbone, calibrator, prompts, max_new_tokens=6, do_sample=True,
                                   temperature=1.0, chat_template=False, stop_strings=["\n\n\n"])
    assert calibrated == [g.text for g in expected]
    plain = ATSLM(pretrained=str(tiny_folder), calibrator="none", device="cpu", batch_size=2)
    assert _generate(plain, prompts, **sampling) != calibrated  # same seed, another distribution
    greedy = dict(until=["\n\n\n"], max_gen_toks=6, do_sample=False)
    assert _generate(plain, prompts, **greedy) == _generate(ats_lm, prompts, **greedy)  # s > 0 keeps the argmax


def test_generation_options_the_calibrated_decoding_ignores_are_refused(ats_lm):
    """hf's generate would apply repetition_penalty; the calibrated decoding cannot, so it says so instead of
    comparing another decoding."""
    with pytest.raises(ATSError, match=r"^gen_kwargs repetition_penalty=1\.3: not supported by the ats model's "
                                       r"calibrated decoding \(it honours do_sample, min_new_tokens, num_beams, "
                                       r"temperature, top_k, top_p\)$"):
        _generate(ats_lm, ["Hello"], until=["\n\n\n"], max_gen_toks=4, do_sample=False, repetition_penalty=1.3)


def test_saved_temperature_scaling_is_usable(tiny_folder, folder_backbone, tmp_path):
    tok = folder_backbone.tokenizer
    ids = torch.tensor([tok("A short text to fit one temperature on, nothing more than that.").input_ids])
    hidden, _ = folder_backbone.forward(ids)
    z = folder_backbone.logits(hidden)[0, :-1]  # (T-1, V)
    temperature = build_calibrator("temperature").fit(lambda: iter([(z, ids[0, 1:])]))
    assert abs(temperature.temperature - 1.0) > 0.05
    temperature.save_pretrained(tmp_path / "temperature")
    lm = ATSLM(pretrained=str(tiny_folder), calibrator=str(tmp_path / "temperature"), device="cpu")
    (value, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("Q: What is 2 plus 2?\nA:", " 4"), 0)])
    ctx, cont = tok("Q: What is 2 plus 2?\nA:").input_ids, tok(" 4", add_special_tokens=False).input_ids
    h, _ = folder_backbone.forward(torch.tensor([ctx + cont[:-1]]))
    logp = torch.log_softmax(folder_backbone.logits(h).double() / temperature.temperature, dim=-1)[0, len(ctx) - 1:]
    assert value == pytest.approx(float(logp.gather(1, torch.tensor(cont)[:, None]).sum()), abs=1e-5)
    # sampling: the calibrated scores z / T are what generate's own temperature T gives the uncalibrated model
    prompts = ["Once upon a time", "Hi"]
    sampled = _generate(lm, prompts, until=["\n\n\n"], max_gen_toks=5, do_sample=True, temperature=1.0, top_k=0)
    plain = HFLM(pretrained=str(tiny_folder), device="cpu")
    assert sampled == _generate(plain, prompts, until=["\n\n\n"], max_gen_toks=5, do_sample=True,
                                temperature=temperature.temperature, top_k=0)


def test_embedded_name_loads_the_folder_lm_evals_hf_model_loads(smollm2, tmp_path):
    folder = cache_folder(_embedded_gguf("smollm2-135m-instruct"))
    request = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0)]
    hf_value = HFLM(pretrained=str(folder), device="cpu").loglikelihood(request)
    head = ATSCalibrator.for_backbone(smollm2, head_type="linear")
    with torch.no_grad():
        head.head.proj.weight.copy_(0.01 * torch.randn(head.head.proj.weight.shape,
                                                       generator=torch.Generator().manual_seed(0)))
    head.save_pretrained(tmp_path / "head")
    lm = ATSLM(pretrained="smollm2-135m-instruct", calibrator=str(tmp_path / "head"), device="cpu")
    assert (lm.backbone.name, lm.backbone.revision) == ("smollm2-135m-instruct", smollm2.revision)
    assert lm.pretrained == str(folder)
    (value, _), = lm.loglikelihood(request)
    expected = choice_loglikelihood(smollm2, head, "The capital of France is", " Paris")
    assert value == pytest.approx(expected, abs=1e-4)
    assert abs(value - hf_value[0][0]) > 1e-3  # the head moved it
    lm.calibrator = None  # the same loaded model, uncalibrated: lm-eval's hf number
    assert lm.loglikelihood(request) == hf_value


def test_calibrators_that_give_no_log_likelihoods_are_refused(tmp_path, tiny_folder, tiny_backbone):
    with pytest.raises(ATSError, match="fit it first"):
        check_calibrator("temperature")
    with pytest.raises(ATSError, match="no such calibrator folder"):
        check_calibrator(str(tmp_path / "missing"))
    histogram = build_calibrator("histogram").fit(lambda: iter([(torch.randn(64, 8), torch.randint(0, 8, (64,)))]))
    histogram.save_pretrained(tmp_path / "histogram")
    with pytest.raises(ATSError, match="maps the top-1 confidence, not the logits"):
        ATSLM(pretrained=str(tiny_folder), calibrator=str(tmp_path / "histogram"), device="cpu")
    assert check_calibrator("none") is None and check_calibrator(None) is None
    other = ATSCalibrator.for_backbone(tiny_backbone)  # a head for another model (name "tiny-llama")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ATSError, match="trained for base model 'tiny-llama'"):
        ATSLM(pretrained=str(tiny_folder), calibrator=str(tmp_path / "other"), device="cpu")


def test_check_calibrator_reads_capabilities_and_the_papers_layout(tmp_path, tiny_backbone):
    """The paper's released layout (and its conversion) is an ATS-family head: accepted; Thermometer (a prompt's
    temperature, read where each request's context ends) too; binning methods are refused by their capability
    flags, not by their class."""
    import json

    from ats.calibrators.thermometer import Thermometer

    official = tmp_path / "official"
    official.mkdir()
    (official / "config.json").write_text(json.dumps({"calibration_type": "transformer", "in_features": 64,
                                                      "intermediate_size": 128, "num_attention_heads": 4}))
    assert check_calibrator(str(official)) == official
    (tmp_path / "converted").mkdir()
    (tmp_path / "converted" / "calibrator_config.json").write_text(json.dumps({"type": "ats-official"}))
    assert check_calibrator(str(tmp_path / "converted")) == tmp_path / "converted"
    thermometer = Thermometer(hidden_size=tiny_backbone.hidden_size)
    assert check_calibrator(thermometer) is thermometer
    assert check_calibrator(ATSCalibrator.for_backbone(tiny_backbone)) is not None
