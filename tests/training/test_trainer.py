"""Training: a short run lowers the loss, moves confidence the right way, and resumes to identical weights."""

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from ats.calibrators.ats import ATSCalibrator
from ats.errors import ATSError
from ats.evaluation.token_eval import token_validator
from ats.training.checkpoint import latest_checkpoint
from ats.training.config import TrainingConfig
from ats.training.data import load_instructions, tokenize_instructions, train_val_split
from ats.training.features import extract_features
from ats.training.trainer import train_ats


@pytest.fixture(scope="module")
def stores(tiny_backbone, tokenizer, tmp_path_factory):
    records = load_instructions("alpaca_gpt4", limit=24, seed=0)
    examples = tokenize_instructions(tokenizer, records, max_length=80)[0]
    train, val = train_val_split(examples, val_fraction=0.25, seed=0)
    root = tmp_path_factory.mktemp("features")
    return (extract_features(tiny_backbone, train, root / "train", shard_sequences=8, progress=False),
            extract_features(tiny_backbone, val, root / "val", progress=False))


def _train(tiny_backbone, stores, head_type="linear", out_dir=None, resume=False, **options):
    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type=head_type)
    config = TrainingConfig(**{"lr": 3e-3, "epochs": 2, "batch_size": 4, "micro_batch_size": 2, **options})
    result = train_ats(cal, stores[0], tiny_backbone, config=config, validate=token_validator(stores[1], tiny_backbone),
                       out_dir=out_dir, resume=resume, progress=False)
    return cal, result


@pytest.mark.parametrize("head_type", ["linear", "transformer"])
def test_short_training_lowers_the_loss_and_val_ece(tiny_backbone, stores, head_type):
    cal, result = _train(tiny_backbone, stores, head_type=head_type, epochs=3)
    losses = [row["loss"] for row in result.history]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    # The random tiny model is almost always wrong and over-confident: ATS must lower its validation ECE.
    from ats.calibrators.base import Uncalibrated
    from ats.evaluation.metrics import summarize
    from ats.evaluation.token_eval import token_confidences

    conf = token_confidences(stores[1], tiny_backbone, {"none": Uncalibrated(), "ats": cal}, progress=False)
    before, after = summarize(*conf["none"])["ece"], summarize(*conf["ats"])["ece"]
    assert after < before
    assert result.epochs[-1]["ece"] == pytest.approx(after)
    assert (conf["none"][1] == conf["ats"][1]).all()  # correctness untouched


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from helpers import make_tiny_backbone, make_tiny_tokenizer
    from ats.calibrators.ats import ATSCalibrator
    from ats.training.features import FeatureStore
    from ats.training.config import TrainingConfig
    from ats.training.trainer import train_ats

    backbone = make_tiny_backbone(make_tiny_tokenizer())
    cal = ATSCalibrator.for_backbone(backbone, head_type="mlp")
    config = TrainingConfig(lr=3e-3, epochs=2, batch_size=4, micro_batch_size=2, save_every=1)
    kill = lambda step: os.kill(os.getpid(), signal.SIGKILL) if step == {kill_at} else None
    train_ats(cal, FeatureStore({features!r}), backbone, config=config, out_dir={out!r},
              resume={resume}, progress=False, on_step=kill)
""")


@pytest.mark.slow  # two fresh processes killed mid-run (about 11 s)
def test_sigkilled_training_resumes_to_identical_weights(tiny_backbone, stores, tmp_path):
    """A real process killed with SIGKILL mid-run, resumed with resume=True, ends with the uninterrupted weights."""
    reference, result = _train(tiny_backbone, stores, head_type="mlp", save_every=1)
    out = tmp_path / "run"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for kill_at, resume in ((2, False), (7, True)):  # global steps: epoch 0 is 1..4, epoch 1 is 6..9
        script = KILLED_RUN.format(tests=tests, features=str(stores[0].directory), out=str(out),
                                   kill_at=kill_at, resume=resume)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert latest_checkpoint(out).name.startswith("epoch")
    resumed, _ = _train(tiny_backbone, stores, head_type="mlp", out_dir=out, resume=True, save_every=1)
    for a, b in zip(reference.head.state_dict().values(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_training_options(tiny_backbone, stores):
    with pytest.raises(ATSError, match="multiple of micro_batch_size"):
        TrainingConfig(batch_size=5, micro_batch_size=2)
    with pytest.raises(ATSError, match="lr: expected a number > 0, got 0"):
        TrainingConfig(lr=0)
    with pytest.raises(ATSError, match=r"alpha: expected a value in \[0.0, 1.0\], got 1.5"):
        TrainingConfig(alpha=1.5)
    with pytest.raises(ATSError, match="loss_type: unknown value 'smooth'"):
        TrainingConfig(loss_type="smooth")
    with pytest.raises(ATSError, match="epochs: expected an integer, got 1.5"):
        TrainingConfig(epochs=1.5)


def test_non_finite_loss_stops_with_place_and_keeps_checkpoint(tokenizer, tmp_path):
    """A backbone whose output layer yields NaN logits: training by the exact route (which recomputes the logits;
    the scale summary was taken before the corruption) stops at once and says where."""
    from helpers import make_tiny_backbone

    backbone = make_tiny_backbone(tokenizer, seed=3)
    examples = tokenize_instructions(tokenizer, load_instructions("alpaca_gpt4", limit=6), max_length=48)[0]
    store = extract_features(backbone, examples, tmp_path / "f", progress=False)
    with torch.no_grad():
        backbone.model.lm_head.weight[5] = float("nan")  # logits are recomputed from h: NaN appears in the loss
    cal = ATSCalibrator.for_backbone(backbone, head_type="linear")
    with pytest.raises(ATSError, match=r"non-finite loss nan at epoch 0, step 0"):
        train_ats(cal, store, backbone, config=TrainingConfig(batch_size=2, micro_batch_size=2, exact_loss=True),
                  out_dir=tmp_path / "r", progress=False)
    assert latest_checkpoint(tmp_path / "r") is None  # nothing half-written in place of a good checkpoint


def test_automatic_learning_rate_follows_the_number_of_steps(tiny_backbone, stores):
    from ats.training.config import auto_lr

    assert auto_lr(13000) == pytest.approx(5e-5)  # the paper's lr at the paper's ~13k steps
    assert auto_lr(650) == pytest.approx(1e-3) and auto_lr(20) == 3e-3 and auto_lr(10**6) == 5e-5
    cal, _ = _train(tiny_backbone, stores, lr=None, epochs=1)
    record = cal.config_.training
    steps = record["optimizer_steps"]
    assert record["lr_automatic"] and record["lr"] == pytest.approx(auto_lr(steps)) and steps == 5
    cal, _ = _train(tiny_backbone, stores, lr=2e-3, epochs=1)
    assert not cal.config_.training["lr_automatic"] and cal.config_.training["lr"] == 2e-3


def test_training_leaves_the_global_rng_alone_and_is_reproducible(tiny_backbone, stores):
    """The trainer neither seeds nor draws from torch's global RNG, and two runs (the global RNG in different states)
    end with bit-identical weights."""
    torch.manual_seed(123)
    expected_next = torch.rand(3)  # what the global RNG gives next from this state
    torch.manual_seed(123)
    first, _ = _train(tiny_backbone, stores, head_type="transformer", epochs=1)
    assert torch.equal(torch.rand(3), expected_next)
    torch.manual_seed(999)
    second, _ = _train(tiny_backbone, stores, head_type="transformer", epochs=1)
    for a, b in zip(first.head.state_dict().values(), second.head.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resume_with_no_checkpoint_says_it_starts_afresh(tiny_backbone, stores, tmp_path, caplog):
    """--resume into a folder without a checkpoint (a mistyped OUT, say) trains from the start, and says so."""
    with caplog.at_level(logging.INFO, logger="ats"):
        _, result = _train(tiny_backbone, stores, out_dir=tmp_path / "fresh", resume=True, epochs=1)
    assert f"nothing to resume in {tmp_path / 'fresh'} (no checkpoint): training from the start" in caplog.text
    assert result.history and result.history[0]["step"] == 1
