"""Answer or abstain on vLLM's answers: the export carries the certified threshold of the calibrator's folder, and
`AnswerDecider` turns a response's calibrated logprobs into `ats serve`'s decision fields (hand-computed here; the
slow server test checks them on a real vLLM response)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from ats.calibrators import build_calibrator
from ats.errors import ATSError
from ats.evaluation.threshold import THRESHOLD_NAME, CertifiedThreshold
from ats.integrations.vllm import CALIBRATOR_FOLDER
from ats.integrations.vllm.abstain import AnswerDecider
from ats.integrations.vllm.export import export_for_vllm

from helpers import write_certificate

CERTIFIED = CertifiedThreshold(threshold=0.6, target_risk=0.2, delta=0.1, n=400, coverage=0.5, risk=0.12, bound=0.18)


def saved_with_threshold(folder, backbone, threshold: CertifiedThreshold | None = CERTIFIED, *,
                         temperature: float = 1.3):
    """A temperature-scaling calibrator saved in `folder`, with `threshold` written as `ats certify` writes it for
    that calibrator and `backbone`."""
    cal = build_calibrator("temperature")
    cal.temperature = temperature
    cal.save_pretrained(folder)
    if threshold is not None:
        write_certificate(folder, threshold, cal, backbone)
    return folder


def test_export_carries_the_threshold_and_refuses_a_changed_one(tiny_models, tmp_path):
    folder, backbone = tiny_models["llama"]
    cal = saved_with_threshold(tmp_path / "cal", backbone)
    out = export_for_vllm(str(folder), str(cal), tmp_path / "out")
    assert json.loads((out / CALIBRATOR_FOLDER / THRESHOLD_NAME).read_text()) == \
        json.loads((cal / THRESHOLD_NAME).read_text())
    decider = AnswerDecider.from_export(out)
    assert decider.threshold == CERTIFIED
    eos = backbone.tokenizer.eos_token_id
    assert {f"token_id:{eos}", backbone.tokenizer.eos_token} <= decider.end_tokens

    other = CertifiedThreshold(threshold=0.7, target_risk=0.1, delta=0.1, n=400, coverage=0.3, risk=0.05, bound=0.09)
    saved_with_threshold(tmp_path / "cal", backbone, other)
    with pytest.raises(ATSError, match="vLLM export"):
        export_for_vllm(str(folder), str(cal), tmp_path / "out")
    export_for_vllm(str(folder), str(cal), tmp_path / "out", overwrite=True)
    assert AnswerDecider.from_export(tmp_path / "out").threshold == other


def test_export_without_a_threshold_decides_nothing(tiny_models, tmp_path):
    folder, backbone = tiny_models["llama"]
    out = export_for_vllm(str(folder), str(saved_with_threshold(tmp_path / "cal", backbone, None)), tmp_path / "out")
    assert not (out / CALIBRATOR_FOLDER / THRESHOLD_NAME).exists()
    choice = {"finish_reason": "length", "logprobs": {"content": [{"token": "a", "logprob": -0.2}]}}
    assert AnswerDecider.from_export(out).decide(choice) == {"answer_confidence": pytest.approx(math.exp(-0.2))}


def test_export_and_decider_refuse_a_threshold_certified_for_another_calibrator(tiny_models, tmp_path):
    folder, backbone = tiny_models["llama"]
    cal = saved_with_threshold(tmp_path / "cal", backbone)
    write_certificate(cal, CERTIFIED, None, backbone)  # certified for the uncalibrated model
    with pytest.raises(ATSError, match=rf"{THRESHOLD_NAME}: field served.calibrator is None but the calibrator in use "
                                       r"has digest '[0-9a-f]{16}'"):
        export_for_vllm(str(folder), str(cal), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    out = export_for_vllm(str(folder), str(saved_with_threshold(tmp_path / "cal", backbone)), tmp_path / "out")
    other = saved_with_threshold(tmp_path / "other", backbone, temperature=2.0)  # certified for another temperature
    shutil.copyfile(other / THRESHOLD_NAME, out / CALIBRATOR_FOLDER / THRESHOLD_NAME)
    with pytest.raises(ATSError, match="field served.calibrator is '[0-9a-f]{16}' but the calibrator in use"):
        AnswerDecider.from_export(out)


def test_export_refuses_a_threshold_that_does_not_parse(tiny_models, tmp_path):
    folder, backbone = tiny_models["llama"]
    cal = saved_with_threshold(tmp_path / "cal", backbone)
    (cal / THRESHOLD_NAME).write_text(json.dumps({"tasks": {}}))
    with pytest.raises(ATSError, match=f"{THRESHOLD_NAME}: missing key 'threshold'"):
        export_for_vllm(str(folder), str(cal), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_decide_leaves_out_the_end_token_only_when_it_ended_the_answer():
    decider = AnswerDecider(CERTIFIED, frozenset({"<eos>", "token_id:2"}))
    content = [{"token": "Par", "logprob": -0.1}, {"token": "is", "logprob": -0.9},
               {"token": "<eos>", "logprob": -0.01}]
    # stopped by the end token: it is not part of the answer
    stopped = decider.decide({"finish_reason": "stop", "logprobs": {"content": content}})
    mean = (math.exp(-0.1) + math.exp(-0.9)) / 2  # 0.6558...
    assert stopped == {"answer_confidence": pytest.approx(mean, abs=1e-12), "answered": True, "threshold": 0.6,
                       "target_risk": 0.2, "delta": 0.1}
    # cut by the length limit (ignore_eos): every token counts, and the mean falls below the threshold
    cut = decider.decide({"finish_reason": "length", "logprobs": {"content": content[:2] + [
        {"token": "token_id:2", "logprob": -2.0}]}})
    assert cut["answer_confidence"] == pytest.approx((math.exp(-0.1) + math.exp(-0.9) + math.exp(-2.0)) / 3)
    assert cut["answered"] is False
    # the completions API's layout gives the same decision
    completion = {"finish_reason": "stop", "logprobs": {"tokens": ["Par", "is", "<eos>"],
                                                        "token_logprobs": [-0.1, -0.9, -0.01]}}
    assert decider.decide(completion) == stopped
    # an answer of the end token alone has no confidence: abstain
    empty = decider.decide({"finish_reason": "stop", "logprobs": {"content": content[2:]}})
    assert empty["answer_confidence"] is None and empty["answered"] is False


def test_decide_refuses_a_choice_without_logprobs():
    with pytest.raises(ATSError, match="logprobs=True"):
        AnswerDecider(CERTIFIED, frozenset()).decide({"finish_reason": "stop", "logprobs": None})


def test_a_probe_exports_its_temperature_and_not_its_threshold(tiny_models, tmp_path, caplog):
    """A probe's certified threshold is of its P(correct), which needs hidden states vLLM does not return: the export
    carries the probe (its token half, the temperature, is what vLLM applies) and leaves the threshold out."""
    import torch

    from ats.calibrators import load_calibrator
    from ats.calibrators.probe import VIEWS, CorrectnessProbe

    folder, backbone = tiny_models["llama"]
    probe = CorrectnessProbe(layers=[0], views=list(VIEWS), c=1.0, hidden_size=backbone.hidden_size,
                             base_model=backbone.name, revision=backbone.revision)
    d = len(VIEWS) * backbone.hidden_size + 1
    probe.set_weights(torch.ones(d), 0.0, torch.zeros(d), torch.ones(d))
    probe.temperature = 1.4
    probe.save_pretrained(tmp_path / "probe")
    write_certificate(tmp_path / "probe", CERTIFIED, probe, backbone)
    with caplog.at_level("WARNING"):
        out = export_for_vllm(str(folder), str(tmp_path / "probe"), tmp_path / "out")
    assert not (out / CALIBRATOR_FOLDER / THRESHOLD_NAME).exists()
    assert "reads hidden states of layers [0] that vLLM's responses do not carry" in caplog.text
    exported = load_calibrator(out / CALIBRATOR_FOLDER)
    z = torch.randn(3, backbone.vocab_size)
    torch.testing.assert_close(exported.apply(z), z / 1.4)
