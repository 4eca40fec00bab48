"""Test doubles shared by several test files: calibrators with a known, hand-checkable effect, and the tiny random
Llama most tests run on (`make_tiny_backbone`, also importable from conftest) with an ATS head away from identity
(`calibrator_for`)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ats.calibrators.ats import ATSCalibrator
from ats.calibrators.base import Calibrator
from ats.model.backbone import Backbone


class HalfTemperature(Calibrator):
    """Logits / 2: softer confidences, same argmax."""

    name = "half"

    def fit(self, chunks):
        return self

    def calibrate(self, logits, hidden=None, *, attention_mask=None, index=None):
        return logits / 2


class SquareConfidence(Calibrator):
    """A binning-style calibrator: maps a top-1 confidence c to c**2."""

    name = "square"
    maps_confidence = True

    def fit(self, chunks):
        return self

    def calibrate_confidence(self, confidence):
        return confidence ** 2


def make_tiny_backbone(tokenizer, *, hidden_size: int = 64, layers: int = 2, seed: int = 0,
                       name: str = "tiny-llama", tie_word_embeddings: bool = True,
                       output_scale: float = 8.0) -> Backbone:
    """A random Llama with SmolLM2's vocabulary, small enough for millisecond forward passes. Tied embeddings make it
    repeat its input; untied with `output_scale` about 60 it writes varied text with top-1 probabilities of 0.3-0.9."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    # Sharpen the random model a little so that its top-1 confidence is not uniformly tiny.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(output_scale)
    return Backbone(model=model, tokenizer=tokenizer, name=name, revision=f"seed{seed}")


def calibrator_for(backbone, head_type: str = "transformer", seed: int = 0) -> ATSCalibrator:
    """A head away from identity: random final projection, so tau varies by token (about -1..1)."""
    torch.manual_seed(seed)
    calibrator = ATSCalibrator.for_backbone(backbone, head_type=head_type)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        proj = calibrator.head.proj
        proj.weight.copy_(0.1 * torch.randn(proj.weight.shape, generator=g))
        proj.bias.fill_(0.1)
    calibrator.head.eval()
    return calibrator


def perturbed_ats(backbone, std: float = 0.3, seed: int = 0):
    """A real ATS calibrator whose head's final projection is random (normal, `std`), so tau varies by token."""
    import torch

    from ats.calibrators.ats import ATSCalibrator

    ats = ATSCalibrator.for_backbone(backbone)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in ats.head.proj.parameters():
            p.normal_(0, std)
    return ats
