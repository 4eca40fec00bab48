"""The variant registry: groups registered once by decorated functions, read by the plans and the workflows."""

from __future__ import annotations

import pytest

from ats.errors import ATSError
from ats.training.config import TrainingConfig
from ats.workflows.plans import EvidencePlan
from ats.workflows.variants import ABLATIONS, HeadRun, Row, Variant, names, register_variants, rows, variant


def test_the_evidence_groups_are_the_old_tables():
    assert names("selected") == ("ats", "ats-top-label", "selective-temperature", "selective-linear")
    assert names("tradeoff") == ("selective-a0.1", "selective-a0.3", "selective-a0.7", "selective-a0.9", "nll")
    assert EvidencePlan().selected == names("selected") and EvidencePlan().tradeoff == names("tradeoff")
    top = variant("selected", "ats-top-label")
    assert (top.method, top.options, top.label) == ("ats", {"loss_type": "top-label"}, "ats-top-label")
    control = variant("selected", "selective-linear")
    assert (control.method, control.head_type, control.options) == ("selective-linear", None, {})
    assert variant("tradeoff", "selective-a0.3").options == {"alpha": 0.3}
    assert variant("tradeoff", "nll").training(TrainingConfig(), lr=0.01) == TrainingConfig(loss_type="none", lr=0.01)


def test_the_ablation_groups_name_their_heads_as_before():
    assert ABLATIONS == ("smoothing", "alpha", "head")
    assert [r.label for r in rows("smoothing")] == ["none", "full", "selective"]
    assert [r.variant.name for r in rows("smoothing")] == ["transformer-none", "transformer-full-a0.5",
                                                           "transformer-selective-a0.5"]
    assert [r.variant.name for r in rows("head")][0] == "constant-selective-a0.5"
    shared = HeadRun().variant
    assert shared.label is None and shared.method == "ats"  # heads record the method "ats", as before the registry
    assert shared.training(TrainingConfig(alpha=0.9)) == TrainingConfig(loss_type="selective", alpha=0.5)


def test_unknown_names_and_groups_are_one_line_errors():
    with pytest.raises(ATSError, match=r"tradeoff: unknown variant 'nl'; known: selective-a0.1, .*nll"):
        variant("tradeoff", "nl")
    with pytest.raises(ATSError, match="unknown variant group 'depth'"):
        rows("depth")
    with pytest.raises(ATSError, match="already registered"):
        register_variants("selected")(lambda: [Variant("x")])


def test_a_registered_group_is_read_everywhere():
    @register_variants("test-group")
    def group():
        return [Variant("a"), Row("B", Variant("b", head_type="linear"))]

    assert [(r.label, r.variant.name) for r in rows("test-group")] == [("a", "a"), ("B", "b")]
    assert "test-group" not in ABLATIONS
