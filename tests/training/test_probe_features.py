"""What an answer set keeps for correctness probes: the captured layers' states at the model's own answer, checked
against an independent route (the model's own `output_hidden_states` on the whole row, without the prefix cache),
and the answered row of a multiple-choice question against the uncalibrated scoring."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ats.evaluation.answers import build_answer_set
from ats.evaluation.tasks import build_task
from ats.evaluation.tasks.nq_open import NQOpenTask
from ats.model.layers import LayerCapture, RunningAnswerViews, answer_views, candidate_layers
from ats.training.answers import PROBE_VIEWS, score_answers

from helpers import make_tiny_backbone

QUESTIONS = [("What color is the sky?", ["blue", "green", "red"], 0), ("2+2?", ["3", "4"], 1),
             ("Capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
             ("Largest planet?", ["Mars", "Jupiter", "Venus"], 1), ("Fastest animal?", ["cheetah", "snail"], 0)]


@pytest.fixture(scope="module")
def model3(tokenizer):
    return make_tiny_backbone(tokenizer, tie_word_embeddings=False, output_scale=60.0, layers=3)


@pytest.fixture()
def mc_file(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    return path


def reference_views(backbone, ids: list[int], prompt_last: int, answer_len: int) -> torch.Tensor:
    """(L=3, 3, H) by the model's own hidden-state outputs on the whole row: layers 0 and 1 are hidden_states[1]
    and [2]; the last layer's output is the final hidden state before the final norm, checked through the norm."""
    with torch.no_grad():
        out = backbone.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    layers = torch.stack([out.hidden_states[1][0], out.hidden_states[2][0]], dim=1)  # (T, 2, H)
    span = slice(prompt_last + 1, prompt_last + 1 + answer_len)
    pick = [layers[prompt_last], layers[span].mean(0), layers[span][-1]] if answer_len else [layers[prompt_last]] * 3
    return torch.stack(pick, dim=1)  # (2, 3, H)


def test_candidate_layers_are_evenly_spaced_and_end_at_the_last():
    assert candidate_layers(28) == (3, 6, 10, 13, 17, 20, 24, 27)
    assert candidate_layers(30) == (3, 7, 10, 14, 18, 22, 25, 29)  # 22.5 rounds up
    assert candidate_layers(3) == (0, 1, 2)


def test_running_views_equal_the_views_of_the_stacked_states_and_say_when_they_cannot():
    """Views kept while decoding (a running sum and a tail) equal `answer_views` of all states stacked, for the
    whole answer, for an answer a stop string cut a few tokens short of what was fed, and with no answer; None when
    the answer's last token was not fed yet or was cut off beyond the tail."""
    g = torch.Generator().manual_seed(0)
    states = torch.randn(11, 2, 5, generator=g)  # (T, L, H): the prompt's last position, then 10 fed tokens
    running = RunningAnswerViews(states[0], tail=4)
    for state in states[1:]:
        running.add(state)
    for answer_len in (10, 8, 7, 0):
        torch.testing.assert_close(running.views(answer_len), answer_views(states, 0, answer_len))
    assert running.views(11) is None  # its last token not fed
    assert running.views(6) is None  # 4 fed tokens cut: the answer's last state left the tail


def test_the_last_captured_layer_through_the_final_norm_is_the_final_hidden_state(model3, tokenizer):
    ids = torch.tensor([tokenizer("the sky is blue and").input_ids])
    with LayerCapture(model3.model, (2,)) as capture:
        hidden, _ = model3.forward(ids)
        last = capture.take()[:, :, 0]  # (1, T, H)
    torch.testing.assert_close(model3.model.base_model.norm(last), hidden)


@pytest.mark.parametrize("mode", ["letters", "likelihood"])
def test_multiple_choice_probe_views_equal_the_models_own_hidden_states(model3, mc_file, mode):
    task = build_task(f"mc:{mc_file}:{mode}")
    answers = build_answer_set(model3, task, dtype="float32", probe_layers=(0, 1, 2), progress=False)
    t = answers.tensors
    assert t["probe"].shape == (len(QUESTIONS), 3, len(PROBE_VIEWS), model3.hidden_size)
    assert answers.meta["probe_layers"] == [0, 1, 2] and answers.meta["probe_views"] == list(PROBE_VIEWS)
    _, correct = score_answers(None, answers, model3.logits, exact=True)
    for q in range(len(QUESTIONS)):
        row = int(t["probe_row"][q])
        assert int(t["row_question"][row]) == q
        n = int(t["row_offsets"][row + 1] - t["row_offsets"][row])
        if answers.kind == "letters":
            ids = task.groups(model3.tokenizer)[0].items[q].ids
            prompt_last, answer_len = n - 1, 0
        else:
            item = task.groups(model3.tokenizer)[0].items[q]
            slot = row - int((t["row_question"] == q).nonzero()[0])
            ids = item.context + item.choices[slot]
            prompt_last, answer_len = len(item.context) - 1, len(item.choices[slot])
            assert (slot == QUESTIONS[q][2]) == bool(correct[q])  # the answered row is the model's own answer
        assert len(ids) == n
        torch.testing.assert_close(t["probe"][q, :2], reference_views(model3, ids, prompt_last, answer_len),
                                   atol=1e-5, rtol=1e-4)


def test_free_form_probe_views_cover_the_greedy_answer_tokens(model3, tmp_path, monkeypatch):
    (tmp_path / "qa_pool").mkdir()
    rows = [{"question": f"what is item number {i}", "answers": [f"item {i}"]} for i in range(7)]
    (tmp_path / "qa_pool" / "nq_open.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("ATS_DATA_DIR", str(tmp_path))
    task = NQOpenTask(limit=5, n_shots=2, max_new_tokens=5, batch_size=3)
    answers = build_answer_set(model3, task, dtype="float32", probe_layers=(0, 1, 2), batch_size=2, progress=False)
    t = answers.tensors
    prefix_ids, prompts = task.prompts(model3.tokenizer)
    for q, prompt in enumerate(prompts):
        row = int(t["probe_row"][q])
        start, end = int(t["row_offsets"][row]), int(t["row_offsets"][row + 1])
        answer_len = end - start - len(prompt)
        positions = t["pos_in_row"][t["pos_row"] == row]
        assert answer_len == positions.numel()  # the scored positions are the answer's tokens
        ids = prompt + t["pos_target"][t["pos_row"] == row].tolist()
        torch.testing.assert_close(t["probe"][q, :2], reference_views(model3, ids, len(prompt) - 1, answer_len),
                                   atol=1e-5, rtol=1e-4)
    assert len(prompts) == 5
    sub = answers.subset([1, 3])
    np.testing.assert_array_equal(sub.tensors["probe"].numpy(), t["probe"][[1, 3]].numpy())
    assert [int(sub.tensors["row_question"][r]) for r in sub.tensors["probe_row"]] == [0, 1]
