"""Two real processes on CPU (torchrun, gloo): sharded extraction covers each example once, and data-parallel
training gives the head of one process with the same global batch (cached and online features).

Tolerance: 1e-5 absolute on every head weight. The two runs differ only in the order of float additions
(per-rank accumulation + DDP's all-reduce mean vs one process's accumulation).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ats.calibrators.ats import ATSCalibrator
from ats.evaluation.token_eval import token_validator
from ats.training.config import TrainingConfig
from ats.training.data import DataConfig, prepare_examples
from ats.training.features import FeatureStore, extract_features
from ats.training.trainer import micro_per_epoch, train_ats
from ats.workflows.pipeline import online_features

TOL = 1e-5
# 21 train sequences in shards of 5 -> micro-batches of 2: 3+3+3+3+1 = 13 per epoch; a step takes 4 (2 per rank),
# so each epoch ends with a partial step of 1 micro-batch that only rank 0 holds (rank 1 contributes zeros).
OPTIONS = dict(limit=26, max_length=80, val_fraction=0.2, shard_sequences=5, batch_tokens=300, feature_dtype="float32")
CONFIG = dict(lr=3e-3, epochs=2, batch_size=8, micro_batch_size=2, seed=0, save_every=1)

WORKER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from helpers import make_tiny_backbone, make_tiny_tokenizer
    from ats.calibrators.ats import ATSCalibrator
    from ats.training.distributed import init_distributed
    from ats.evaluation.token_eval import token_validator
    from ats.training.data import DataConfig
    from ats.workflows.pipeline import online_features, prepare_features
    from ats.training.config import TrainingConfig
    from ats.training.trainer import train_ats

    root = Path({root!r})
    dist = init_distributed()
    assert dist.distributed and dist.world_size == 2, dist
    backbone = make_tiny_backbone(make_tiny_tokenizer())
    options = DataConfig(**{options!r})
    sources = {{"cached": prepare_features(backbone, root / "features", options, progress=False, dist=dist),
               "online": online_features(backbone, options)}}
    for mode, (train, val) in sources.items():
        cal = ATSCalibrator.for_backbone(backbone, head_type="transformer")
        result = train_ats(cal, train, backbone, config=TrainingConfig(**{config!r}),
                           validate=token_validator(val, backbone, dist),
                           out_dir=root / ("work-" + mode), progress=False, dist=dist)
        if dist.is_main:
            cal.save_pretrained(root / ("head-" + mode))
            (root / ("history-" + mode + ".json")).write_text(json.dumps({{"steps": result.history,
                                                                           "epochs": result.epochs}}))
""")


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    script = root / "worker.py"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script.write_text(WORKER.format(tests=tests, root=str(root), options=OPTIONS, config=CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run"]  # torchrun, without relying on PATH
    proc = subprocess.run([*launcher, "--standalone", "--nproc_per_node", "2", str(script)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root


@pytest.fixture(scope="module")
def examples(tiny_backbone):
    train, val, _ = prepare_examples(tiny_backbone.tokenizer, DataConfig(**OPTIONS))
    return train, val


def test_sharded_extraction_covers_every_example_once(two_process_run, examples, tiny_backbone, tmp_path):
    train, val = examples
    for split, part in (("train", train), ("val", val)):
        store = FeatureStore(two_process_run / "features" / split)
        seen = torch.cat([store.load_shard(k)["example_index"] for k in range(store.n_shards)]).tolist()
        assert sorted(seen) == list(range(len(part)))  # all examples, none twice
        assert len(store) == len(part) and store.meta["split"] == split
    # the shards the two ranks wrote are those one process writes
    train_store = FeatureStore(two_process_run / "features" / "train")
    assert train_store.n_shards == 5 and micro_per_epoch(train_store, TrainingConfig(**CONFIG)) == 13
    single = extract_features(tiny_backbone, train, tmp_path / "single", shard_sequences=OPTIONS["shard_sequences"],
                              batch_tokens=OPTIONS["batch_tokens"], dtype="float32", progress=False)
    for k in range(single.n_shards):
        a, b = single.load_shard(k), train_store.load_shard(k)
        assert a.keys() == b.keys()
        for key in a:  # indices and lengths exactly; floats to rounding (thread counts pick other matmul kernels)
            exact = not a[key].is_floating_point()
            torch.testing.assert_close(a[key], b[key], rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


def _single_process(tiny_backbone, train, val):
    cal = ATSCalibrator.for_backbone(tiny_backbone, head_type="transformer")
    result = train_ats(cal, train, tiny_backbone, config=TrainingConfig(**CONFIG),
                       validate=token_validator(val, tiny_backbone), progress=False)
    return cal, result


def _assert_same_run(root: Path, mode: str, cal, result):
    other = ATSCalibrator.from_pretrained(root / f"head-{mode}")
    for name, a in cal.head.state_dict().items():
        b = other.head.state_dict()[name]
        assert (a - b).abs().max().item() <= TOL, name
    history = json.loads((root / f"history-{mode}.json").read_text())
    assert len(history["steps"]) == len(result.history) == 2 * 4  # 3 full steps and the partial one per epoch
    for x, y in zip(history["steps"], result.history):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5) and x["lr"] == pytest.approx(y["lr"])
    for x, y in zip(history["epochs"], result.epochs):  # validation ECE over both ranks' tokens
        assert x["ece"] == pytest.approx(y["ece"], abs=1e-5) and x["accuracy"] == pytest.approx(y["accuracy"])
    # only the main process wrote checkpoints, and it wrote them
    assert (root / f"work-{mode}" / "checkpoints" / "latest.json").exists()


def test_two_processes_train_the_head_of_one_cached(two_process_run, tiny_backbone):
    train = FeatureStore(two_process_run / "features" / "train")
    val = FeatureStore(two_process_run / "features" / "val")
    cal, result = _single_process(tiny_backbone, train, val)
    fresh = ATSCalibrator.for_backbone(tiny_backbone, head_type="transformer")  # the same initialisation
    moved = {name: (p - fresh.head.state_dict()[name]).abs().max().item() for name, p in cal.head.state_dict().items()}
    assert min(moved.values()) > 0, moved  # every parameter, the zero-initialised final projection included, moved
    _assert_same_run(two_process_run, "cached", cal, result)


def test_two_processes_train_the_head_of_one_online(two_process_run, tiny_backbone):
    train, val = online_features(tiny_backbone, DataConfig(**OPTIONS))
    cal, result = _single_process(tiny_backbone, train, val)
    _assert_same_run(two_process_run, "online", cal, result)
    # online features give the head trained from a float32 cache (same micro-batches; forward batching differs)
    cached = ATSCalibrator.from_pretrained(two_process_run / "head-cached")
    for name, a in cal.head.state_dict().items():
        assert (a - cached.head.state_dict()[name]).abs().max().item() <= 1e-4, name
