"""The runner's pieces: one rule for what a fingerprint records of a config, the fitting logits kept only through an
explicit `LogitReplay`."""

from __future__ import annotations

import torch

from ats.fingerprint import result_options
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig
from ats.workflows.feature_source import FeatureSource, LogitReplay
from ats.workflows.fingerprints import data_fingerprint, training_options
from ats.workflows.pipeline import prepare_features


def test_options_that_never_change_a_result_are_left_out_by_one_rule():
    training = TrainingConfig(save_every=5)
    assert "save_every" not in result_options(training) and "lr" in result_options(training)
    assert "exact_loss" not in training_options(training, None)
    assert "batch_tokens" not in data_fingerprint(DataConfig(limit=3))
    assert list(result_options(DataConfig(), leave_out=("seed",))) == ["source", "limit", "max_length", "pack",
                                                                      "val_fraction", "feature_dtype",
                                                                      "shard_sequences"]


def test_logits_are_replayed_only_through_an_explicit_replay(tiny_backbone, tmp_path):
    train, _ = prepare_features(tiny_backbone, tmp_path / "f", DataConfig(limit=8, max_length=48), progress=False)
    calls = []
    real = tiny_backbone.logits

    def counting(hidden):
        calls.append(len(hidden))
        return real(hidden)

    tiny_backbone.logits = counting
    try:
        plain = FeatureSource(tiny_backbone, train)
        first = [z for z, _ in plain.logit_chunks()]
        second = [z for z, _ in plain.logit_chunks()]
        assert len(calls) == 2 * len(first)  # no replay: every pass runs the output layer
        calls.clear()
        replay = LogitReplay()
        source = FeatureSource(tiny_backbone, train, replay=replay)
        again = [z for z, _ in source.logit_chunks()]
        assert replay.kept is not None and len(calls) == len(first)
        replayed = [z for z, _ in source.logit_chunks()]
        assert len(calls) == len(first)  # the second pass came from memory
        assert all(torch.equal(a, b) for a, b in zip(first + again, second + replayed, strict=True))
        small = FeatureSource(tiny_backbone, train, replay=LogitReplay(max_bytes=1))
        list(small.logit_chunks())
        assert small.replay.kept is None  # too large for the replay: passed through
    finally:
        del tiny_backbone.logits
