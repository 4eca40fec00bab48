"""run_ablations on the tiny model: every table, the JSON and the figure; the shared configuration is trained once."""

import json

import pytest

import ats.workflows.pipeline
from ats.errors import ATSError
from ats.training.config import TrainingConfig
from ats.training.data import load_instructions, tokenize_instructions
from ats.training.features import extract_features
from ats.workflows.ablate import ALPHAS, SHARED, ablation_plan, head_job, run_ablations, unique_runs


def test_plan_shares_the_default_configuration():
    plan = ablation_plan()
    assert [label for label, _ in plan["smoothing"]] == ["none", "full", "selective"]
    assert [label for label, _ in plan["alpha"]] == ["0.1", "0.3", "0.5", "0.7", "0.9"]
    assert [label for label, _ in plan["head"]] == ["constant", "linear", "mlp", "transformer"]
    shared = head_job(TrainingConfig(), **SHARED)
    assert all(any(job == shared for _, job in rows) for rows in plan.values())
    assert len(unique_runs(plan)) == 10 and len({r.name for r in unique_runs(plan)}) == 10
    assert list(ablation_plan("alpha")) == ["alpha"]
    with pytest.raises(ATSError, match="unknown"):
        ablation_plan(["depth"])


def test_heads_keep_the_names_and_options_of_earlier_runs():
    """A rerun reuses the heads of an earlier run only if each head's folder, method and training options are what
    they were (they enter its fingerprint)."""
    plan = ablation_plan(training=TrainingConfig(alpha=0.9, lr=1e-3))
    assert [job.name for _, job in plan["smoothing"]] == ["transformer-none", "transformer-full-a0.5",
                                                          "transformer-selective-a0.5"]
    assert plan["head"][0][1].name == "constant-selective-a0.5"
    none = plan["smoothing"][0][1]
    assert (none.folder, none.method, none.label, none.head_type) == ("heads/transformer-none", "ats", None,
                                                                      "transformer")
    assert none.training == TrainingConfig(loss_type="none", alpha=0.5, lr=1e-3)


@pytest.fixture(scope="module")
def stores(tiny_backbone, tokenizer, tmp_path_factory):
    records = load_instructions("alpaca_gpt4", limit=9, seed=1)
    examples = tokenize_instructions(tokenizer, records, max_length=64)[0]
    root = tmp_path_factory.mktemp("ablate-features")
    train = extract_features(tiny_backbone, examples[:6], root / "train", dtype="float32", progress=False)
    val = extract_features(tiny_backbone, examples[6:], root / "val", dtype="float32", progress=False)
    return train, val


def test_run_ablations_writes_tables_json_figure_and_reuses_heads(tiny_backbone, stores, tmp_path, monkeypatch):
    quiz = tmp_path / "quiz.jsonl"
    rows = [{"question": "Which is a colour?", "choices": ["red", "seven", "dog"], "answer": 0},
            {"question": "Pick the largest number.", "choices": ["1", "10", "100"], "answer": 2},
            {"question": "Is water wet?", "choices": ["yes", "no"], "answer": 0}]
    quiz.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trained = []
    real_train = ats.workflows.pipeline.train_ats

    def counting(calibrator, *args, **kwargs):
        config = kwargs["config"]
        trained.append(f"{calibrator.config_.head.head_type}/{config.loss_type}/{config.alpha:g}")
        return real_train(calibrator, *args, **kwargs)

    monkeypatch.setattr(ats.workflows.pipeline, "train_ats", counting)
    train, val = stores
    out = tmp_path / "ablations"
    training = TrainingConfig(lr=1e-3, epochs=1, batch_size=4, micro_batch_size=4)
    summary = run_ablations(tiny_backbone, train, val, out, tasks=[f"mc:{quiz}"], task_limit=3, training=training,
                            progress=False)

    # 12 table rows, 10 distinct configurations: the shared selective / 0.5 / transformer run is trained once
    assert len(trained) == 10 and len(set(trained)) == 10
    assert trained.count("transformer/selective/0.5") == 1
    assert sorted(p.name for p in (out / "heads").iterdir() if not p.name.endswith(".work")) == sorted(
        r.name for r in unique_runs(ablation_plan()))
    assert all(info["trained_now"] for info in summary["runs"].values())

    for ablation, labels in (("smoothing", ["none", "full", "selective"]),
                             ("alpha", [f"{a:g}" for a in ALPHAS]),
                             ("head", ["constant", "linear", "mlp", "transformer"])):
        text = (out / f"{ablation}.md").read_text()
        lines = [line for line in text.splitlines() if line.startswith("| ")]
        header, body = lines[0], lines[1:]
        assert "mc_quiz ECE" in header and "mc_quiz Brier" in header
        assert "val (token) ECE" in header and "val (token) Brier" in header
        assert [line.split("|")[1].strip() for line in body] == ["uncalibrated", *labels]
        assert all("-" not in line.split("|")[3] for line in body)  # every cell filled
    shared_rows = [line for ab in ("smoothing", "alpha", "head") for line in (out / f"{ab}.md").read_text().splitlines()
                   if "transformer-selective-a0.5" in line]
    assert len(shared_rows) == 3 and len({row.split("|", 2)[2] for row in shared_rows}) == 1  # identical numbers

    data = json.loads((out / "ablations.json").read_text())
    assert set(data["runs"]) == {r.name for r in unique_runs(ablation_plan())}
    assert set(data["results"]) == {"mc_quiz", "val_tokens"}
    for task in ("mc_quiz", "val_tokens"):
        assert set(data["results"][task]) == {"uncalibrated", *data["runs"]}
        assert all(0 <= m["ece"] <= 1 and 0 <= m["brier"] <= 1 for m in data["results"][task].values())
    assert data["results"]["mc_quiz"]["uncalibrated"]["n"] == 3
    assert data["results"]["val_tokens"]["uncalibrated"]["n"] == val.meta["response_tokens"]
    assert data["ablations"]["alpha"][2] == {"row": "0.5", "run": "transformer-selective-a0.5"}
    for suffix in ("png", "pdf"):
        assert (out / f"ece_vs_alpha.{suffix}").stat().st_size > 1000

    # a rerun reuses every head and gives the same numbers
    trained.clear()
    again = run_ablations(tiny_backbone, train, val, out, tasks=[f"mc:{quiz}"], task_limit=3, training=training,
                          ablations=("alpha",), progress=False)
    assert trained == [] and not any(info["trained_now"] for info in again["runs"].values())
    assert set(again["runs"]) == {f"transformer-selective-a{a:g}" for a in ALPHAS}
    assert again["results"]["mc_quiz"]["transformer-selective-a0.3"] == data["results"]["mc_quiz"][
        "transformer-selective-a0.3"]
