"""A saved `ats eval` folder as the playground shows it: each method's metrics per task (ECE with its bootstrap
interval), which served calibrator each method is (by digest, never by name), and one method's reliability diagram
at a time, drawn from the per-example results (`tasks/<task>.json`) by `evaluation.plots`.

    EVAL/results.json          task -> method -> metrics (`ece`, `ece_ci` when bootstrapped, `n`, `accuracy`, ...)
    EVAL/tasks/<task>.json     per-example confidence / correct of every method, with each calibrator's digest
"""

from __future__ import annotations

import io
from pathlib import Path

from ..errors import ATSError
from ..evaluation.plots import STYLE, make_reliability_figure
from ..evaluation.report import TASK_LABELS
from ..io import read_json

SHOWN_METRICS = ("n", "accuracy", "mean_confidence", "ece", "ece_ci", "brier", "auroc")


class SavedEvaluation:
    """The results of one `ats eval` folder, read once at start-up (a bad folder fails before the model loads).

    Args:
        folder: the folder `ats eval --out` wrote.

    Raises:
        ATSError: naming the folder or file, if results.json is missing or not task -> method -> metrics.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        path = self.folder / "results.json"
        if not path.is_file():
            raise ATSError(f"--eval {folder}: no results.json there (the folder `ats eval --out` writes)")
        results = read_json(path)
        if not isinstance(results, dict) or not all(isinstance(m, dict) for m in results.values()):
            raise ATSError(f"{path}: expected task -> method -> metrics")
        self.results: dict[str, dict[str, dict]] = results
        self.digests: dict[str, str] = {}  # method -> calibrator digest (from the task files)
        for task in results:
            task_file = self.folder / "tasks" / f"{task}.json"
            if task_file.is_file():
                for method, entry in (read_json(task_file).get("methods") or {}).items():
                    if isinstance(entry, dict) and entry.get("digest"):
                        self.digests.setdefault(method, entry["digest"])
        self._png: dict[tuple[str, str], bytes] = {}

    @property
    def methods(self) -> list[str]:
        """Every method of any task, in first-seen order."""
        return list(dict.fromkeys(m for by_method in self.results.values() for m in by_method))

    def method_of(self, digest: str | None) -> str | None:
        """The method whose calibrator has `digest`, or None (this evaluation did not include it)."""
        return next((m for m, d in self.digests.items() if digest is not None and d == digest), None)

    def describe(self) -> dict:
        """{"folder", "methods", "tasks": [{"task", "label", "metrics": {method: the shown metrics}}]} for the
        page."""
        tasks = [{"task": task, "label": TASK_LABELS.get(task, task),
                  "metrics": {m: {k: v for k, v in metrics.items() if k in SHOWN_METRICS}
                              for m, metrics in by_method.items() if isinstance(metrics, dict)}}
                 for task, by_method in self.results.items()]
        return {"folder": str(self.folder), "methods": self.methods, "tasks": tasks}

    def reliability_png(self, task: str, method: str) -> bytes:
        """One method's reliability diagram on one task (PNG, dpi 100), from the per-example results; cached.

        Raises:
            ATSError: if the task or the method has no per-example results here.
        """
        key = (task, method)
        if key not in self._png:
            path = self.folder / "tasks" / f"{task}.json"
            if task not in self.results or not path.is_file():
                raise ATSError(f"task {task!r}: no per-example results in {self.folder / 'tasks'}")
            entry = (read_json(path).get("methods") or {}).get(method)
            if not isinstance(entry, dict) or "confidence" not in entry or "correct" not in entry:
                raise ATSError(f"method {method!r}: not in {path}")
            import matplotlib

            fig = make_reliability_figure({method: (entry["confidence"], entry["correct"])},
                                          title=TASK_LABELS.get(task, task))
            buffer = io.BytesIO()
            with matplotlib.rc_context(STYLE):
                fig.savefig(buffer, format="png", dpi=100)
            self._png[key] = buffer.getvalue()
        return self._png[key]
