"""The research protocols of benchmarks/protocols/ are imported as the scripts import them: `protocols.<module>`, with
benchmarks/ first on sys.path."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
