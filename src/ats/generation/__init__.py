"""Calibrated generation: transformers' `generate` with the ATS head inside, per-token calibrated confidence."""

from .api import CalibratedGeneration, encode_prompts, eos_ids, format_prompts, generate_calibrated, tokens_covering
from .processor import CalibrationProcessor
from .stream import StreamToken, colorize, print_stream

__all__ = ["CalibratedGeneration", "CalibrationProcessor", "StreamToken", "colorize", "encode_prompts", "eos_ids",
           "format_prompts", "generate_calibrated", "print_stream", "tokens_covering"]
