"""Feature cache: hidden states equal a direct forward, shards resume, checksums catch corruption."""

import json

import pytest
import torch

from ats.errors import ATSError
from ats.model.labels import IGNORE_INDEX
from ats.training.data import load_instructions, tokenize_instructions
from ats.training.features import FeatureStore, extract_features


@pytest.fixture(scope="module")
def examples(tokenizer):
    records = load_instructions("alpaca_gpt4", limit=12, seed=0)
    return tokenize_instructions(tokenizer, records, max_length=96)[0]


def test_cached_hidden_states_match_a_direct_forward(tiny_backbone, examples, tmp_path):
    store = extract_features(tiny_backbone, examples, tmp_path / "f", shard_sequences=5, batch_tokens=300,
                             dtype="float32", progress=False)
    assert store.n_shards == 3 and len(store) == len(examples)
    assert store.meta["response_tokens"] == sum(sum(y != IGNORE_INDEX for y in e.labels) for e in examples)
    seen = 0
    for shard in range(store.n_shards):
        tensors = store.load_shard(shard)
        offsets = tensors["offsets"].tolist()
        for i, (a, b) in zip(tensors["example_index"].tolist(), zip(offsets[:-1], offsets[1:])):
            ids = torch.tensor([examples[i].input_ids])
            direct, _ = tiny_backbone.forward(ids)
            torch.testing.assert_close(tensors["hidden"][a:b], direct[0], atol=1e-5, rtol=1e-5)
            assert tensors["labels"][a:b].tolist() == examples[i].labels
            seen += 1
    assert seen == len(examples)
    # token chunks carry exactly the response tokens, and logits recomputed from h are the model's
    hidden, labels = next(store.response_tokens(chunk_tokens=7))
    assert hidden.shape == (7, tiny_backbone.hidden_size) and (labels != IGNORE_INDEX).all()
    logits, labels2 = next(store.logit_chunks(tiny_backbone.logits, chunk_tokens=7)())
    torch.testing.assert_close(logits, tiny_backbone.logits(hidden))
    assert torch.is_grad_enabled()  # a suspended chunk generator must not leave grad mode off for its consumer


def test_extraction_resumes_without_recomputing_finished_shards(tiny_backbone, examples, tmp_path):
    out = tmp_path / "f"
    extract_features(tiny_backbone, examples, out, shard_sequences=5, shards=[0, 1], progress=False)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    assert not (out / "meta.json").exists()  # unfinished: no meta until every shard is there
    store = extract_features(tiny_backbone, examples, out, shard_sequences=5, progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    assert all(after[name] == mtime for name, mtime in before.items()) and len(after) == 3
    assert len(store) == len(examples)


def test_corrupt_shard_is_refused(tiny_backbone, examples, tmp_path):
    store = extract_features(tiny_backbone, examples, tmp_path / "f", shard_sequences=50, progress=False)
    path = tmp_path / "f" / "shard-00000.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ATSError, match="checksum mismatch"):
        list(FeatureStore(tmp_path / "f").sequences())
    with pytest.raises(ATSError, match="float16, bfloat16 or float32"):
        extract_features(tiny_backbone, examples, tmp_path / "g", dtype="int8", progress=False)
    del store


def test_features_of_another_backbone_are_refused(tiny_backbone, examples, tmp_path, tokenizer):
    from helpers import make_tiny_backbone

    store = extract_features(tiny_backbone, examples[:3], tmp_path / "f", progress=False)
    other = make_tiny_backbone(tokenizer, seed=1)
    with pytest.raises(ATSError, match="revision"):
        store.check_backbone(other)


KILLED_EXTRACTION = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from helpers import make_tiny_backbone, make_tiny_tokenizer
from ats.training.data import load_instructions, tokenize_instructions
import ats.training.features as features

tokenizer = make_tiny_tokenizer()
backbone = make_tiny_backbone(tokenizer)
examples = tokenize_instructions(tokenizer, load_instructions("alpaca_gpt4", limit=12, seed=0), max_length=96)[0]
real_write_json = features.write_json
def write_json_then_die(path, obj):  # SIGKILL right after the second shard is finished
    real_write_json(path, obj)
    if Path(path).name == "shard-00001.json":
        os.kill(os.getpid(), signal.SIGKILL)
features.write_json = write_json_then_die
features.extract_features(backbone, examples, {out!r}, shard_sequences=5, progress=False)
"""


def test_sigkilled_extraction_resumes_without_recomputing(tiny_backbone, examples, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "f"
    script = KILLED_EXTRACTION.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), out=str(out))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    assert sorted(finished) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert not (out / "meta.json").exists() and not list(out.glob(".*tmp"))  # nothing half-written
    store = extract_features(tiny_backbone, examples, out, shard_sequences=5, progress=False)
    assert all((out / name).stat().st_mtime_ns == mtime for name, mtime in finished.items())
    assert sorted(i for k in range(store.n_shards) for i in store.load_shard(k)["example_index"].tolist()) == \
        list(range(len(examples)))


def test_paths_in_configs_cannot_escape_the_folder(tiny_backbone, tokenizer, tmp_path):
    examples = tokenize_instructions(tokenizer, load_instructions("alpaca_gpt4", limit=3), max_length=48)[0]
    extract_features(tiny_backbone, examples, tmp_path / "f", progress=False)
    outside = tmp_path / "secret.safetensors"
    (tmp_path / "f" / "shard-00000.safetensors").rename(outside)
    meta = json.loads((tmp_path / "f" / "meta.json").read_text())
    meta["shards"][0]["file"] = "../secret.safetensors"
    (tmp_path / "f" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ATSError, match="shard file missing"):  # resolved inside the folder, never outside it
        list(FeatureStore(tmp_path / "f").sequences())
