"""One rule for what a head method builds: `train_head` and `check_before_loading` read the same preset, so a rerun
with the options that trained a head is accepted and one with other options is refused, before the model loads."""

from __future__ import annotations

import json

import pytest

from ats.errors import ATSError
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig
from ats.workflows.pipeline import check_before_loading, head_preset, prepare_features, train_head


def test_head_preset_precedence():
    assert head_preset("selective-temperature") == {"head_type": "constant", "method": "selective-temperature"}
    assert head_preset("selective-temperature", "linear")["head_type"] == "linear"  # explicit beats the preset
    assert head_preset("ats", None, "ats-top-label") == {"method": "ats-top-label"}
    with pytest.raises(ATSError):
        head_preset("no-such-method")


def test_a_rerun_is_checked_against_what_training_built(tiny_backbone, tmp_path):
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps({"instruction": f"Name a word with {i} letters.", "input": "",
                                             "output": "word " * (i + 2)}) + "\n" for i in range(8)))
    data = DataConfig(source=str(data_file), max_length=48, val_fraction=0.25)
    train, val = prepare_features(tiny_backbone, tmp_path / "features", data, progress=False)
    training = TrainingConfig(epochs=1, batch_size=2, micro_batch_size=2, lr=1e-3)
    head = train_head(tiny_backbone, train, None, tmp_path / "head", method="selective-temperature",
                      head_type="linear", training=training, progress=False)
    assert head.config_.head.head_type == "linear" and head.config_.method == "selective-temperature"
    # the same options: accepted (the explicit head type beat the preset in training, and does here too)
    check_before_loading(tmp_path / "features", tmp_path / "head", data, head_type="linear",
                         method="selective-temperature", training=training)
    with pytest.raises(ATSError, match="head"):  # the preset's own head type is not what was trained
        check_before_loading(tmp_path / "features", tmp_path / "head", data, method="selective-temperature",
                             training=training)
    with pytest.raises(ATSError):
        check_before_loading(tmp_path / "features", tmp_path / "head", data, head_type="linear",
                             method="selective-temperature", training=TrainingConfig(epochs=2, batch_size=2,
                                                                                     micro_batch_size=2, lr=1e-3))


def test_the_check_before_loading_is_fit_heads_fingerprint(tiny_backbone, tmp_path):
    from ats.fingerprint import stored_fingerprint

    data = DataConfig(limit=8, max_length=48, val_fraction=0.25)
    train, _ = prepare_features(tiny_backbone, tmp_path / "features", data, progress=False)
    training = TrainingConfig(epochs=1, batch_size=2, micro_batch_size=2, lr=1e-3)
    train_head(tiny_backbone, train, None, tmp_path / "head", head_type="mlp", max_scale=5.0, training=training,
               progress=False)
    # options that never change a result (save_every, batch_tokens) are accepted, as fit_head reuses the head
    check_before_loading(tmp_path / "features", tmp_path / "head", data.replace(batch_tokens=99), head_type="mlp",
                         max_scale=5.0, training=training.replace(save_every=3))
    # the refusal names what differs in the head's own fingerprint, as fit_head's does
    with pytest.raises(ATSError, match=r"head: head made with other options: head.head_type 'mlp' -> 'linear', "
                                       r"max_scale 5.0 -> 10.0; rerun with --overwrite"):
        check_before_loading(tmp_path / "features", tmp_path / "head", data, head_type="linear", training=training)
    head = stored_fingerprint(tmp_path / "head")
    (tmp_path / "head" / "fingerprint.json").write_text(json.dumps({**head, "library_version": "0.0.1"}))
    with pytest.raises(ATSError, match=r"library_version '0.0.1' -> "):  # refused before loading, as fit_head would
        check_before_loading(tmp_path / "features", tmp_path / "head", data, head_type="mlp", max_scale=5.0,
                             training=training)
