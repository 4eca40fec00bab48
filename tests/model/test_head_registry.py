"""The head registry: every configured head type is built by its registered class with the config's sizes, one
name cannot be taken twice, an unknown type is refused naming the known ones, and `tau_at` dispatches on the
`forward_at` capability (equal to gathering the full pass)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ats.errors import ATSError
from ats.model.heads import (
    HEAD_TYPES,
    ConstantHead,
    HeadConfig,
    LinearHead,
    MLPHead,
    TransformerHead,
    build_head,
    head_class,
    register_head,
    tau_at,
)


def test_every_head_type_is_built_by_its_registered_class():
    assert HEAD_TYPES == ("constant", "linear", "mlp", "transformer")  # the registry's names, read without torch
    classes = {"constant": ConstantHead, "linear": LinearHead, "mlp": MLPHead, "transformer": TransformerHead}
    for kind in HEAD_TYPES:
        config = HeadConfig(head_type=kind, hidden_size=64, mlp_hidden=24, intermediate_size=96, num_heads=2)
        head = build_head(config)
        assert type(head) is head_class(kind) is classes[kind]
        shapes = {n: tuple(p.shape) for n, p in head.named_parameters()}
        expected = {"constant": {"tau": (1,)},
                    "linear": {"proj.weight": (1, 64), "proj.bias": (1,)},
                    "mlp": {"fc.weight": (24, 64), "fc.bias": (24,), "proj.weight": (1, 24), "proj.bias": (1,)}}
        if kind in expected:
            assert shapes == expected[kind]
        else:  # the sizes reach the decoder layer: 2 heads of 32, SwiGLU width 96
            assert head.attn.n_heads == 2 and head.attn.head_dim == 32 and shapes["mlp.gate_proj.weight"] == (96, 64)
        out = head(torch.randn(2, 5, 64))
        assert out.shape == (2, 5) and torch.equal(out, torch.zeros(2, 5))  # identity at init


def test_a_name_is_registered_once_and_unknown_types_are_refused():
    with pytest.raises(ATSError, match="'linear' is already registered by LinearHead"):
        register_head("linear")(type("Other", (nn.Module,), {}))
    linear = head_class("linear")
    assert register_head("linear")(linear) is linear  # re-registering the same class is harmless
    with pytest.raises(ATSError, match=r"unknown head 'bayes' \(one of constant, linear, mlp, transformer\)"):
        build_head(SimpleNamespace(head_type="bayes"))


def test_tau_at_uses_forward_at_when_a_head_has_it():
    torch.manual_seed(0)
    hidden, mask = torch.randn(2, 7, 64), torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    index = torch.tensor([[1, 6], [3, 4]])
    for kind in ("linear", "transformer"):
        head = build_head(HeadConfig(head_type=kind, hidden_size=64))
        for p in head.parameters():  # away from identity, so the positions differ
            nn.init.normal_(p, std=0.1)
        full = head(hidden, mask).gather(1, index)
        assert hasattr(head, "forward_at") == (kind == "transformer")
        torch.testing.assert_close(tau_at(head, hidden, mask, index), full, rtol=1e-5, atol=1e-6)
