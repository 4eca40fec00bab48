"""Calibrated generation: transformers' `generate` with the ATS head inside, per-token calibrated confidence."""

from .api import CalibratedGeneration, encode_prompts, format_prompts, generate_calibrated
from .processor import CalibrationProcessor
from .stream import StreamToken, colorize, print_stream

__all__ = ["CalibratedGeneration", "CalibrationProcessor", "StreamToken", "colorize", "encode_prompts",
           "format_prompts", "generate_calibrated", "print_stream"]
