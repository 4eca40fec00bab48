"""Heads saved before the training path became one (issue 31; `ats train` of commit 9ab0767 on the tiny model folder
and the tiny data, their JSON records kept in tests/fixtures/saved_by_9ab0767/) are reused by a rerun with the same
options and refused, naming the option, with other options: by the checks `ats train` runs before any model loads,
which decide reuse by the same fingerprints as the training steps."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from ats.errors import ATSError
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig
from ats.workflows.answer_methods import check_answer_head
from ats.workflows.answer_pool import AnswerPool
from ats.workflows.pipeline import check_before_loading

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "saved_by_9ab0767"
# what `ats train --on answers --pool-size 3 --mmlu-pool 0 --epochs 1 --batch-size 4 --micro-batch-size 4` asks for
POOL = AnswerPool(pool_size=3, mmlu_per_subject=0)
ANSWERS = TrainingConfig(loss_type="answer-log", epochs=1, batch_size=4, micro_batch_size=4)


@pytest.mark.parametrize("run, spec, pool", [("thermometer", "thermometer", POOL), ("linear", "linear", POOL),
                                             ("tokens-term", "linear+tokens", replace(POOL, token_weight=0.5))])
def test_answer_heads_saved_before_are_reused_with_their_options_and_refused_with_others(tmp_path, run, spec, pool):
    out = tmp_path / run
    shutil.copytree(FIXTURES / run, out)
    features = tmp_path / "features"
    (features / "train").mkdir(parents=True)

    def check(**changes):
        asked = {"spec": spec, "training": ANSWERS, "pool": pool, **changes}
        return check_answer_head(out, max_scale=10.0, token_features=features, overwrite=False, **asked)

    assert check() is True
    for changes, named in (({"training": ANSWERS.replace(lr=3e-3)}, "training.lr 0.001 -> 0.003"),
                           ({"training": ANSWERS.replace(epochs=2)}, "training.epochs 1 -> 2"),
                           ({"training": ANSWERS.replace(loss_type="answer-brier")}, "training.loss_type"),
                           ({"spec": "mlp" if spec != "thermometer" else "linear"}, "head")):
        with pytest.raises(ATSError, match=f"head made with other options: .*{named}"):
            check(**changes)
    if spec.endswith("+tokens"):
        with pytest.raises(ATSError, match="training.token_weight 0.5 -> 1.0"):
            check(pool=POOL)
    assert check_answer_head(out, spec=spec, training=ANSWERS.replace(lr=3e-3), pool=pool, max_scale=10.0,
                             token_features=features, overwrite=True) is False  # --overwrite retrains


def test_an_instruction_head_saved_before_is_reused_with_its_options_and_refused_with_others(tmp_path):
    """`ats train --data alpaca_gpt4 --limit 8 --max-length 48 --epochs 1 --batch-size 2 --micro-batch-size 2
    --head linear` of 9ab0767, asked again."""
    shutil.copytree(FIXTURES / "tokens", tmp_path / "run")
    features, head = tmp_path / "run" / "features", tmp_path / "run" / "head"
    data = DataConfig(limit=8, max_length=48)
    training = TrainingConfig(epochs=1, batch_size=2, micro_batch_size=2)

    def check(**changes):
        asked = {"data": data, "head_type": "linear", "training": training, **changes}
        check_before_loading(features, head, max_scale=10.0, **asked)

    check()
    for changes, named in (({"training": training.replace(lr=1e-2)}, "training.lr None -> 0.01"),
                           ({"head_type": "mlp"}, "head.head_type 'linear' -> 'mlp'"),
                           ({"data": data.replace(limit=9)}, "data")):
        with pytest.raises(ATSError, match=f"made with other options: .*{named}"):
            check(**changes)
