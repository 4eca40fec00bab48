"""The alignment protocol (benchmarks/protocols/alignment.py) on two tiny backbones."""

from protocols.alignment import run_alignment

from ats.training.config import TrainingConfig
from ats.training.data import DataConfig

from helpers import make_tiny_backbone


def test_run_alignment_compares_backbones(tiny_backbone, tokenizer, tmp_path):
    quiz = tmp_path / "quiz.jsonl"
    quiz.write_text('{"question": "Which is a colour?", "choices": ["red", "seven"], "answer": 0}\n')
    other = make_tiny_backbone(tokenizer, hidden_size=32, seed=3, name="tiny-base")
    summary = run_alignment([tiny_backbone, other], tmp_path / "align", tasks=[f"mc:{quiz}"],
                            data=DataConfig(limit=8, max_length=64, val_fraction=0.25),
                            training=TrainingConfig(lr=1e-3, epochs=1, batch_size=2, micro_batch_size=2),
                            progress=False)
    assert list(summary["results"]) == ["tiny-llama", "tiny-base"]
    for per_model in summary["results"].values():
        assert set(per_model) == {"mc_quiz", "val_tokens"}
        assert set(per_model["mc_quiz"]) == {"uncalibrated", "ats"}
    lines = [line for line in (tmp_path / "align" / "alignment.md").read_text().splitlines() if line.startswith("| ")]
    assert [tuple(c.strip() for c in line.split("|")[1:3]) for line in lines[1:]] == [
        ("tiny-llama", "uncalibrated"), ("tiny-llama", "ats"), ("tiny-base", "uncalibrated"), ("tiny-base", "ats")]
    assert (tmp_path / "align" / "alignment.json").is_file()
