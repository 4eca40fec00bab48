"""Shared prompt prefixes (few-shot examples) are found among lm-eval's requests and encoded once; the
log-likelihoods through them are lm-eval's `hf` ones and the calibrated ones of a whole forward, to float32
rounding."""

from __future__ import annotations

import json

import numpy as np
import pytest
from lm_eval.tasks import TaskManager

from ats.integrations.lm_eval_model import ATSLM
from ats.integrations.prefix_sharing import find_shared_prefixes

from lmeval_helpers import loglikelihoods, toy_rows

FEWSHOT = "ats_toy_fewshot"


def test_shared_prefixes_are_the_longest_prefix_of_each_run_of_neighbours():
    a, b = list(range(40)), [7] * 40
    rows = [a + [1, 2], a + [1, 3], a + [5], b + [9], b + [9, 1], [3] * 50, [3] * 50, a[:10] + [0] * 40]
    assert sorted(find_shared_prefixes(rows, min_tokens=32)) == sorted([tuple(a), tuple(b + [9])])
    # 41 tokens: a + [5] no longer joins the run of a + [1, ...]
    assert sorted(find_shared_prefixes(rows, min_tokens=41)) == sorted([tuple(a + [1]), tuple(b + [9])])
    assert find_shared_prefixes([[1] * 40, [1] * 40], min_tokens=32) == []  # one row twice: nothing to share


@pytest.fixture(scope="module")
def fewshot_task(tmp_path_factory):
    """A 3-shot task whose ~70-token description and examples every question shares."""
    folder = tmp_path_factory.mktemp("fewshot")
    rows = toy_rows(16)
    for split, part in (("test", rows[4:]), ("dev", rows[:4])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    description = "The following are arithmetic questions, each followed by four answers of which one is right. " * 3
    (folder / f"{FEWSHOT}.yaml").write_text(
        f"task: {FEWSHOT}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'test.jsonl'}\n"
        f"    dev: {folder / 'dev.jsonl'}\ntest_split: test\nfewshot_split: dev\nfewshot_config:\n  sampler: first_n\n"
        f"num_fewshot: 3\ndescription: \"{description}\\n\\n\"\noutput_type: multiple_choice\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    return TaskManager(include_path=str(folder), include_defaults=False)


def _lls(lm, tasks) -> np.ndarray:
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=[FEWSHOT], task_manager=tasks, log_samples=True,
                                  verbosity="ERROR")
    return np.array([loglikelihoods(s) for s in sorted(out["samples"][FEWSHOT], key=lambda s: s["doc_id"])])


def test_few_shot_requests_reuse_the_prefix_and_keep_the_numbers(fewshot_task, tiny_folder, head_dir):
    from lm_eval.models.huggingface import HFLM

    common = dict(pretrained=str(tiny_folder), device="cpu", batch_size=3)
    hf = _lls(HFLM(**common), fewshot_task)
    whole = ATSLM(calibrator="none", prefix_cache=0, **common)
    shared = ATSLM(calibrator="none", **common)
    np.testing.assert_array_equal(_lls(whole, fewshot_task), hf)  # no reuse: HFLM's call, bit for bit
    np.testing.assert_allclose(_lls(shared, fewshot_task), hf, rtol=1e-6, atol=1e-5)
    assert shared.prefixes.rows_served == shared.prefixes.rows_seen >= 12  # every batch row ran on the prefix
    head_whole = _lls(ATSLM(calibrator=str(head_dir), prefix_cache=0, **common), fewshot_task)
    head_shared = _lls(ATSLM(calibrator=str(head_dir), **common), fewshot_task)
    np.testing.assert_allclose(head_shared, head_whole, rtol=1e-6, atol=1e-5)
    assert np.abs(head_shared - hf).max() > 0.5


def test_a_prefix_reaching_into_the_continuations_is_scored_from_the_contexts_end(tiny_folder, head_dir):
    """Two answers that share their first word make the shared prefix reach past the context's end: the
    continuations are still scored from there (before the fix their first positions read zeros: 2.5 nats off)."""
    from lm_eval.api.instance import Instance

    shared = "The following are questions about capitals and numbers, each with one short answer. " * 3
    question = shared + "Q: What is the capital of Italy?\nA:"
    requests = [Instance("loglikelihood", {}, (question, answer), i)
                for i, answer in enumerate([" Rome is the capital", " Rome, of course"])]
    for calibrator in ("none", str(head_dir)):
        common = dict(pretrained=str(tiny_folder), calibrator=calibrator, device="cpu", batch_size=2)
        lm = ATSLM(**common)
        got = [v for v, _ in lm.loglikelihood(requests)]
        assert lm.prefixes.rows_served == 2
        want = [v for v, _ in ATSLM(prefix_cache=0, **common).loglikelihood(requests)]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
