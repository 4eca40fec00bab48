"""The real embedded models (SmolLM2, Gemma 3 270M): load offline from their GGUF wheels; logits == the output layer
of the final hidden state; a second load reads the cached model folder."""

import shutil

import pytest
import torch

from ats.errors import ATSError
from ats.model.backbone import load_backbone


def test_smollm2_hidden_states_give_the_models_logits(smollm2):
    assert (smollm2.hidden_size, smollm2.vocab_size) == (576, 49152)
    assert smollm2.is_chat and not any(p.requires_grad for p in smollm2.model.parameters())
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    hidden, _ = smollm2.forward(ids)
    reference = smollm2.model(input_ids=ids, output_hidden_states=True)
    # hidden_states[-1] is after the final norm; logits are h @ W.T (tied embeddings), checked independently
    torch.testing.assert_close(hidden, reference.hidden_states[-1])
    torch.testing.assert_close(hidden @ smollm2.model.get_input_embeddings().weight.T, reference.logits,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(smollm2.logits(hidden), reference.logits)


def test_cached_gguf_load_reuses_a_plain_model_folder(smollm2):
    import json

    from ats.model.backbone import _embedded_gguf, cache_folder

    folder = cache_folder(_embedded_gguf("smollm2-135m-instruct"))
    weights = folder / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = load_backbone("smollm2-135m-instruct")
    # read from the cached folder (not dequantized again into it): the model's source is that folder
    assert again.model.config._name_or_path == str(folder) and weights.stat().st_mtime_ns == before
    assert again.revision == smollm2.revision
    torch.testing.assert_close(again.output_weight, smollm2.output_weight)
    # an ordinary model folder: no trace of the GGUF quantisation that other tools (lm-eval) would refuse
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())


@pytest.mark.slow
def test_gemma3_270m_hidden_states_give_the_models_logits():
    """The embedded base Gemma 3 270M: sizes, no chat template needed, h (B, T, H) and h @ W^T == the model's logits
    (Gemma's logits carry no soft-capping in this release)."""
    gemma = load_backbone("gemma3-270m")
    assert gemma.hidden_size == 640 and gemma.vocab_size == gemma.model.config.vocab_size == 262144
    assert not any(p.requires_grad for p in gemma.model.parameters())
    ids = gemma.tokenizer(["The capital of France is", "Two plus two"], return_tensors="pt", padding=True)
    hidden, _ = gemma.forward(ids.input_ids, ids.attention_mask)
    assert hidden.shape == (2, ids.input_ids.shape[1], 640)
    reference = gemma.model(input_ids=ids.input_ids, attention_mask=ids.attention_mask)
    logits = hidden @ gemma.model.get_output_embeddings().weight.T  # computed here, not by the backbone
    mask = ids.attention_mask.bool()
    torch.testing.assert_close(logits[mask], reference.logits[mask], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(gemma.logits(hidden)[mask], reference.logits[mask], atol=1e-3, rtol=1e-4)
    assert gemma.model.config._name_or_path != "gemma3-270m"  # a local folder: nothing came from the Hub


def test_unknown_inputs_are_refused(tmp_path):
    with pytest.raises(ATSError, match=r"missing\.gguf: no such file or folder \(and not an embedded model"):
        load_backbone(str(tmp_path / "missing.gguf"))
    with pytest.raises(ATSError, match=r"^/no/such/model: no such file or folder"):  # not sent to the Hub as an id
        load_backbone("/no/such/model")
    with pytest.raises(ATSError, match=r"^device 'gpu7': not a device \(cpu, cuda, cuda:1, mps, \.\.\.\)$"):
        load_backbone("smollm2-135m-instruct", device="gpu7")  # before anything loads
    (tmp_path / "empty").mkdir()
    with pytest.raises(ATSError, match="no config.json"):
        load_backbone(str(tmp_path / "empty"))
    with pytest.raises(ATSError, match="dtype"):
        load_backbone("smollm2-135m-instruct", dtype="float8")


def test_broken_model_folders_are_one_line(tmp_path, tiny_backbone):
    """A model folder saved here, then broken as users break them: each load fails in one line naming the folder
    and what is wrong."""
    import json

    good = tmp_path / "good"
    tiny_backbone.model.save_pretrained(good)
    tiny_backbone.tokenizer.save_pretrained(good)
    assert load_backbone(str(good)).vocab_size == tiny_backbone.vocab_size
    with pytest.raises(ATSError, match=r"config\.json: a file, not a model folder or a \.gguf file$"):
        load_backbone(str(good / "config.json"))

    typed = tmp_path / "typed"
    shutil.copytree(good, typed)
    config = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    with pytest.raises(ATSError) as err:
        load_backbone(str(typed))
    assert str(err.value).startswith(f"{typed}: cannot load the model (") and "hidden_size" in str(err.value)
    assert "'abc'" in str(err.value) and "\n" not in str(err.value)

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    with pytest.raises(ATSError, match=r"truncated: cannot load the model \(.*header"):
        load_backbone(str(truncated))


def test_a_local_folder_is_the_same_model_however_its_path_is_written(tmp_path, tiny_backbone, monkeypatch):
    """A calibrator made on `art/model` from one folder applies to the same folder named absolutely, or relatively
    from another folder (the record holds the absolute path)."""
    from helpers import calibrator_for

    folder = tmp_path / "art" / "model"
    tiny_backbone.model.save_pretrained(folder)
    tiny_backbone.tokenizer.save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    relative = load_backbone("art/model")
    assert relative.name == str(folder.resolve())
    calibrator = calibrator_for(relative, head_type="linear")
    assert calibrator.config_.base_model == str(folder.resolve())
    monkeypatch.chdir(tmp_path / "art")
    for written in ("model", "./model/", str(folder), "../art/model"):
        calibrator.check_backbone(load_backbone(written))  # no ATSError
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    with pytest.raises(ATSError, match="calibrator was trained for base model"):
        calibrator.check_backbone(load_backbone(str(other)))
