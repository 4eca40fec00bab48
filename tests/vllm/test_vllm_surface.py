"""The check of the vLLM internals ats uses (`ats.integrations.vllm.surface`), on the installed vLLM: everything ats
imports from vLLM is in the table, the installed vLLM passes, and each kind of change (moved, renamed parameter, new
required parameter, missing field, changed source) is named in one line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ats.integrations.vllm as integration
from ats.errors import ATSError
from ats.integrations.vllm import compat, surface
from ats.integrations.vllm.serve import SERVER_MODULE
from ats.integrations.vllm.surface import INTERNALS, Internal, check, locate, problems

PACKAGE = Path(integration.__file__).parent


def _vllm_imports() -> set[str]:
    """"module:name" of every `from vllm... import name` in ats's vLLM integration."""
    found = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                found |= {f"{node.module}:{alias.name}" for alias in node.names}
    return found


def test_every_vllm_name_ats_imports_is_in_the_table():
    places = {place for internal in INTERNALS for place in internal.where}
    imports = _vllm_imports()
    assert "vllm.v1.worker.gpu.model_states.default:DefaultModelState" in imports  # the scan reads lazy imports
    missing = {name for name in imports
               if name not in places and not any(p.startswith(name + ".") for p in places)}
    assert not missing, f"vLLM names imported by ats but not checked by surface.INTERNALS: {sorted(missing)}"
    assert f"{SERVER_MODULE}:" in places  # the module ats serve runs with python -m


def test_the_installed_vllm_has_everything_ats_uses(capsys):
    assert problems() == []
    assert surface.main() == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"vLLM {compat.installed_version()}: the internals ats uses"
    assert out.count(": ok") == len(INTERNALS) + 1  # each internal found here, and the server options


def test_an_internal_that_moved_is_found_at_its_new_place():
    import vllm.entrypoints.launchers.cli_args as old_place  # vLLM 0.32's place; 0.33 moved it to entrypoints.common

    (internal,) = [i for i in INTERNALS if i.name == "make_arg_parser"]
    assert internal.where[1] == "vllm.entrypoints.launchers.cli_args:make_arg_parser"
    assert locate("make_arg_parser") is old_place.make_arg_parser
    assert check(internal) == ("vllm.entrypoints.launchers.cli_args:make_arg_parser", None)


@pytest.mark.parametrize("internal,problem", [
    (Internal(("vllm.nowhere:Thing",), "x"), "not found (ModuleNotFoundError: No module named 'vllm.nowhere')"),
    (Internal(("vllm.sampling_params:SamplingParams.nothing",), "x"),
     "not found (AttributeError: type object 'SamplingParams' has no attribute 'nothing')"),
    (Internal(("vllm.compilation.backends:set_model_tag",), "x", params=("tag", "label")), "no parameter 'label'"),
    (Internal(("vllm.compilation.backends:set_model_tag",), "x", params=("is_encoder",)),
     "a new required parameter 'tag'"),
    (Internal(("vllm.config:CacheConfig",), "x", fields=("sliding_window", "window_of_old")),
     "holds no 'window_of_old'"),
    (Internal(("vllm.envs:",), "x", reads=("VLLM_CPU_KVCACHE_SPACE", "VLLM_NO_SUCH_SETTING")),
     "its source no longer has 'VLLM_NO_SUCH_SETTING'"),
])
def test_each_kind_of_change_is_named(internal, problem):
    assert check(internal)[1] == problem
    (line,) = problems((internal,), options=False)
    assert line == f"{internal.where[0]}: {problem} (x)"


def test_fields_are_read_from_dataclasses_properties_and_assignments():
    # ModelConfig.hf_config: a dataclass field without a class attribute; runner_type: assigned in __post_init__;
    # InputProcessor.model_config: assigned in __init__
    for place, name in (("vllm.config:ModelConfig", "hf_config"), ("vllm.config:ModelConfig", "runner_type"),
                        ("vllm.v1.engine.input_processor:InputProcessor", "model_config")):
        assert check(Internal((place,), "x", fields=(name,)))[1] is None
    assert check(Internal(("vllm.config:ModelConfig",), "x", fields=("runner_types",)))[1] == "holds no 'runner_types'"


def test_optional_internals_may_be_absent_but_not_wrong():
    assert check(Internal(("vllm.v1.worker.no_v1_runner:Runner",), "x", optional=True)) == (None, None)
    assert check(Internal(("vllm.compilation.backends:set_model_tag",), "x", params=("label",), optional=True))[1] \
        == "no parameter 'label'"
    assert locate("GPUModelRunner", required=False) is not None  # vLLM 0.32 still has the V1 runner


def test_a_tried_version_is_refused_by_the_first_internal_it_moved(monkeypatch):
    monkeypatch.setenv(compat.ANY_VERSION_ENV, "1")
    assert compat.unavailable_reason("0.35.0") is None  # this vLLM's internals all check
    moved = (Internal(("vllm.sampling_params:SamplingParams",), "sees prompt logprobs", fields=("prompt_logprob",)),
             Internal(("vllm.nowhere:Thing",), "y"))
    monkeypatch.setattr(surface, "INTERNALS", INTERNALS + moved)
    reason = compat.unavailable_reason("0.35.0")
    assert reason == ("vLLM 0.35.0, tried with ATS_VLLM_ANY_VERSION=1, moved what ats uses: "
                      "vllm.sampling_params:SamplingParams: holds no 'prompt_logprob' (sees prompt logprobs) "
                      "(and 1 more: python -m ats.integrations.vllm.surface)")
    with pytest.raises(ATSError, match="moved what ats uses"):
        compat.check_version("0.35.0")
    monkeypatch.delenv(compat.ANY_VERSION_ENV)
    assert compat.unavailable_reason("0.35.0").startswith("vLLM 0.35.0 is installed;")


def test_locate_names_the_places_it_looked(monkeypatch):
    with pytest.raises(ValueError, match="'no_such_internal' is not in surface.INTERNALS"):
        locate("no_such_internal")
    monkeypatch.setattr(surface, "INTERNALS", INTERNALS + (Internal(("vllm.a:B", "vllm.c:B"), "does something"),))
    with pytest.raises(ATSError, match=r"^vLLM has no B at vllm\.a:B or vllm\.c:B \(does something\); "):
        locate("B")
    assert locate("B", required=False) is None
