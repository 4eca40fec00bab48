"""Calibrated generation: one decoding core (`Decoder`) for the Python API, `ats generate`, lm-eval's generate_until
and `ats serve`, with any calibrator; per-token calibrated confidence, streaming."""

from .api import CalibratedGeneration, encode_prompts, format_prompts, generate_calibrated
from .calibration import DecodingCalibration, calibration_mode
from .decoder import Decoder, Row, eos_ids
from .sampling import SamplingParams
from .stream import StreamToken, colorize, print_stream
from .text import TextTracker, first_stop, tokens_covering

__all__ = ["CalibratedGeneration", "Decoder", "DecodingCalibration", "Row", "SamplingParams", "StreamToken",
           "TextTracker", "calibration_mode", "colorize", "encode_prompts", "eos_ids", "first_stop", "format_prompts",
           "generate_calibrated", "print_stream", "tokens_covering"]
