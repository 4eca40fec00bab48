"""The real embedded SmolLM2: loads offline from its GGUF wheel; logits == output layer of the final hidden state."""

import pytest
import torch

from ats.errors import ATSError
from ats.model.backbone import EMBEDDED_MODELS, load_backbone


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
    assert weights.stat().st_mtime_ns == before  # loaded from the cache, not dequantized again
    assert again.revision == smollm2.revision
    torch.testing.assert_close(again.output_weight, smollm2.output_weight)
    # an ordinary model folder: no trace of the GGUF quantisation that other tools (lm-eval) would refuse
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())


def test_unknown_inputs_are_refused(tmp_path):
    with pytest.raises(ATSError, match="GGUF file not found"):
        load_backbone(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ATSError, match="no config.json"):
        load_backbone(str(tmp_path / "empty"))
    with pytest.raises(ATSError, match="dtype"):
        load_backbone("smollm2-135m-instruct", dtype="float8")
    assert "gemma3-270m" in EMBEDDED_MODELS
