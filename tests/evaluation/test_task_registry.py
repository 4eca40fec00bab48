"""The task registry: a decorated class becomes a spec everywhere, parametric specs parse, limits and options are
looked up by spec or by registered name, and errors name the known specs."""

from __future__ import annotations

import json

import pytest

from ats.errors import ATSError
from ats.evaluation.tasks import REGISTRY, build_task, build_tasks, register_task
from ats.evaluation.tasks.multiple_choice import MultipleChoiceTask
from ats.evaluation.tasks.registry import known_specs


@pytest.fixture()
def toy_task():
    @register_task("toy")
    class Toy:
        def __init__(self, *, limit=None, seed=0, shots=5):
            self.limit, self.seed, self.shots = limit, seed, shots

    yield Toy
    del REGISTRY["toy"]


def test_a_registered_task_is_a_spec_everywhere(toy_task):
    assert "toy" in known_specs() and known_specs().index("toy") < known_specs().index("mc:PATH")
    task = build_task(" toy ", limit=3, seed=2, shots=1)
    assert isinstance(task, toy_task) and (task.limit, task.seed, task.shots) == (3, 2, 1)
    built = build_tasks(["toy", task], {"toy": 7}, task_options={"toy": {"shots": 0}})
    assert built[1] is task and (built[0].limit, built[0].shots) == (7, 0)
    with pytest.raises(ATSError, match="bad option"):
        build_task("toy", colour="red")
    with pytest.raises(ATSError, match="already registered"):
        register_task("toy")(type("Other", (), {}))


def test_parametric_specs_and_limits_by_registered_name(tmp_path):
    path = tmp_path / "quiz.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "choices": ["a", "b"], "answer": i % 2}) + "\n"
                            for i in range(6)))
    letters, likelihood = build_tasks([f"mc:{path}", f"mc:{path}:likelihood"], {"mc": 4})
    assert isinstance(letters, MultipleChoiceTask) and (letters.mode, likelihood.mode) == ("letters", "likelihood")
    assert letters.limit == likelihood.limit == 4
    assert build_tasks([f"mc:{path}"], {f"mc:{path}": 2, "mc": 4})[0].limit == 2  # the whole spec wins
    assert build_tasks([f"mc:{path}"], {"mmlu": 2})[0].limit is None
    with pytest.raises(ATSError, match="missing file path"):
        build_task("mc:")
    with pytest.raises(ATSError, match=r"unknown scoring mode 'likelyhood'; expected mc:PATH\[:letters\|likelihood\]"):
        build_task(f"mc:{path}:likelyhood")
    with pytest.raises(ATSError, match=r"unknown task 'mmlu:x'; known: mmlu, "):
        build_task("mmlu:x")
    with pytest.raises(ATSError, match="unknown task 'mc'"):
        build_task("mc")
    with pytest.raises(ATSError, match="non-empty string"):
        build_task("  ")
