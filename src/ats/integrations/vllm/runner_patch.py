"""What vLLM does not tell a model and Thermometer needs: each scheduled token's request's prompt length, and a
refusal of prompt logprobs for exports that hold one temperature per prompt.

vLLM's model forward gets token ids and positions only. With prefix caching a fully cached prompt runs as a
one-token "prefill", preemption recomputes prompt + output as a prefill and chunked prefill splits prompts, so
nothing in a step's shapes says where a prompt ends. Both model runners know it (per request, in batch order):

- the V1 runner (`GPUModelRunner`, which vLLM's CPU runner extends; gone in vLLM 0.34):
  `input_batch.num_prompt_tokens`, with the step's `query_start_loc`; `_init_model_kwargs`, which every step (and
  every dummy run) calls after the inputs are prepared, is wrapped to hand the per-token lengths to the model;
- the V2 runner (`vllm.v1.worker.gpu`): `req_states.prompt_len`; a model may name its own `ModelState`
  (`get_model_state_cls`), whose `prepare_inputs` runs every step: `v2_model_state` extends the default one.

The model copies them into a buffer it owns (`ATSCalibratedForCausalLM.set_prompt_lens`), persistent so that CUDA
graphs replay on it. Prompt logprobs are refused in the front end (`InputProcessor._validate_params`, wrapped): a
causal layer cannot give rows before the prompt's end the temperature read there, which `ats serve` gives echoed
prompt tokens, nor the one lm-eval's `vllm` model would need (the context's end, inside its one prompt).

The front end's wrapper is installed by `register` (the plugin hook, in every vLLM process) for the versions
`compat.SUPPORTED` names; the V1 runner's by the calibrated model that needs it, when it is built (in the worker,
whose runner is building it), so that a vLLM process serving anything else never imports the runner for ats. Each
wrapper acts only for a calibrated model that asks for it (`needs_prompt_lens`) or an export whose record says so
(`per_prompt`), and is the original call otherwise.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import CONFIG_KEY

PROMPT_LOGPROBS_REFUSAL = ("prompt_logprobs: this export's calibrator (Thermometer) reads one temperature at the end "
                           "of the prompt, which rows of the prompt cannot see; ask for logprobs of generated "
                           "tokens, or score prompts with `ats lm-eval --model ats` or `ats serve`")


def per_prompt(model_config) -> bool:
    """Whether the model of `model_config` is an export holding one temperature per prompt."""
    record = getattr(model_config.hf_config, CONFIG_KEY, None)
    return isinstance(record, dict) and bool(record.get("per_prompt"))


def token_prompt_lens(query_start_loc: np.ndarray, prompt_lens: np.ndarray) -> torch.Tensor:
    """(N,) int32: each scheduled token's request's prompt length, from the step's query_start_loc (R + 1,) and the
    requests' prompt lengths (R,), in batch order."""
    counts = np.diff(query_start_loc)  # (R,)
    return torch.from_numpy(np.repeat(prompt_lens.astype(np.int32), counts))


def wrap_v1_runner() -> None:
    """Wrap the V1 runner's `_init_model_kwargs` to hand the model each token's prompt length (once per process;
    nothing on a vLLM without V1)."""
    from .surface import locate

    GPUModelRunner = locate("GPUModelRunner", required=False)  # noqa: N806 (vLLM 0.34 has only the V2 runner)
    if GPUModelRunner is None:
        return
    original = GPUModelRunner._init_model_kwargs
    if getattr(original, "_ats", False):
        return

    @functools.wraps(original)
    def _init_model_kwargs(self, num_reqs: int | None = None):
        model = self.get_model()
        if getattr(model, "needs_prompt_lens", False):
            n = self.input_batch.num_reqs if num_reqs is None else num_reqs
            if n > 0:
                model.set_prompt_lens(token_prompt_lens(self.query_start_loc.np[: n + 1],
                                                        self.input_batch.num_prompt_tokens[:n]))
        return original(self, num_reqs)

    _init_model_kwargs._ats = True
    GPUModelRunner._init_model_kwargs = _init_model_kwargs


def v2_model_state():
    """The V2 runner's default `ModelState`, extended to hand each step's per-token prompt lengths to the model."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    class PromptLensModelState(DefaultModelState):
        def prepare_inputs(self, input_batch, req_states):
            n = input_batch.num_reqs
            if n > 0:
                self.model.set_prompt_lens(token_prompt_lens(
                    input_batch.query_start_loc_np[: n + 1], req_states.prompt_len.np[input_batch.idx_mapping_np[:n]]))
            return super().prepare_inputs(input_batch, req_states)

    return PromptLensModelState


def _wrap_input_processor() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, "_ats", False):
        return

    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        if (isinstance(params, SamplingParams) and params.prompt_logprobs is not None
                and per_prompt(self.model_config)):
            raise VLLMValidationError(PROMPT_LOGPROBS_REFUSAL, parameter="prompt_logprobs")
        return original(self, params, supported_tasks)

    _validate_params._ats = True
    InputProcessor._validate_params = _validate_params


def install() -> None:
    """Wrap the front end's `_validate_params` (once per process): the plugin's part."""
    _wrap_input_processor()
