"""Hidden states of inner decoder layers, captured during the backbone's ordinary forward passes.

A correctness probe (`ats.calibrators.probe`) reads several layers at a few positions of an answer; the rest of ats
reads only the final hidden state. Rather than asking the model for every layer's states at every token
(`output_hidden_states`, L x (B, T, H)), `LayerCapture` hooks only the chosen layers and keeps their outputs of the
last forward pass, which the caller reduces to the positions it needs at once.

    with LayerCapture(backbone.model, layers=(6, 13, 20, 27)) as capture:
        hidden, _ = backbone.forward(ids)        # the forward runs as before
        states = capture.take()                  # (B, T, L, H): layer l's output for each of the asked layers
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..errors import ATSError

N_CANDIDATES = 8  # the layers an answer set records for probes: eight, evenly spaced, the last one included


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (Llama, Qwen2, Gemma 3, ...: `base_model.layers`).

    Raises:
        ATSError: if the model has no such list.
    """
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ATSError(f"{type(model).__name__}: no decoder layer list (base_model.layers); probes cannot read it")
    return layers


def candidate_layers(n_layers: int, n: int = N_CANDIDATES) -> tuple[int, ...]:
    """`n` layer indices (0-based, the output of that decoder layer) evenly spaced over a model of `n_layers`
    layers, ending at the last: e.g. 28 layers -> (3, 6, 10, 13, 17, 20, 24, 27)."""
    if n_layers < 1:
        raise ATSError(f"n_layers must be positive, got {n_layers}")
    m = min(n, n_layers)
    return tuple(sorted({math.floor((k + 1) * n_layers / m + 0.5) - 1 for k in range(m)}))


class LayerCapture:
    """Forward hooks on chosen decoder layers; `take()` returns their outputs of the last forward, stacked.

    Args:
        model: the transformers causal LM.
        layers: decoder-layer indices (0-based; the layer's output, before the final norm for the last layer).
    """

    def __init__(self, model: nn.Module, layers: Sequence[int]) -> None:
        blocks = decoder_layers(model)
        bad = [layer for layer in layers if not 0 <= int(layer) < len(blocks)]
        if bad or not layers:
            raise ATSError(f"probe layers {list(layers)}: each must be in 0..{len(blocks) - 1}")
        self.layers = tuple(int(layer) for layer in layers)
        self._blocks = [blocks[layer] for layer in self.layers]
        self._outputs: dict[int, Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "LayerCapture":
        for slot, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._outputs.clear()

    def _hook(self, slot: int):
        def record(module, args, output) -> None:
            self._outputs[slot] = output[0] if isinstance(output, tuple) else output  # (B, T, H)
        return record

    def take(self, position: int | None = None) -> Tensor:
        """(B, T, L, H): the asked layers' outputs of the last forward pass (T: the tokens that pass ran); (B, L, H)
        at one `position` only (e.g. -1, the last one: nothing else is copied).

        Raises:
            ATSError: if no forward ran since the last take.
        """
        if len(self._outputs) != len(self._blocks):
            raise ATSError("LayerCapture.take: no forward pass ran through the captured layers")
        outputs = [self._outputs[slot] for slot in range(len(self._blocks))]  # L x (B, T, H)
        if position is not None:
            outputs = [o[:, position] for o in outputs]  # L x (B, H)
        self._outputs.clear()
        return torch.stack(outputs, dim=-2)


ANSWER_VIEWS = ("prompt_last", "answer_mean", "answer_last")  # what a probe reads per layer at an answer


def answer_views(states: Tensor, prompt_last: int, answer_len: int) -> Tensor:
    """(L, 3, H) float32: the `ANSWER_VIEWS` of one row's captured layers `states` (T, L, H): the prompt's last
    position (where the answer's first token is predicted), the mean and the last of the answer's own tokens
    (positions prompt_last + 1 ..); with no answer token, the prompt's last position for all three."""
    last = states[prompt_last].float()  # (L, H)
    if answer_len <= 0:
        return torch.stack([last, last, last], dim=1)
    answer = states[prompt_last + 1:prompt_last + 1 + answer_len].float()  # (A, L, H)
    return torch.stack([last, answer.mean(0), answer[-1]], dim=1)


class RunningAnswerViews:
    """The `ANSWER_VIEWS` of an answer being decoded, from the states (L, H) its tokens get as the decoder feeds them
    one by one, so a finished answer needs no second pass over prompt + answer. Memory stays O(L x H): a running sum
    and the last `tail` states, enough for a stop string to cut a few tokens off the end.

    Args:
        prompt_last: (L, H) the layers' outputs at the prompt's last position.
        tail: how many of the latest fed states are kept.
    """

    def __init__(self, prompt_last: Tensor, tail: int = 64) -> None:
        self.prompt_last = prompt_last.float()  # (L, H)
        self.total = torch.zeros_like(prompt_last, dtype=torch.float64)  # (L, H) sum over the fed tokens
        self.fed = 0
        self.recent: deque[Tensor] = deque(maxlen=tail)

    def add(self, state: Tensor) -> None:
        """Count the state (L, H) of the next answer token fed to the model."""
        state = state.float()
        self.total += state
        self.fed += 1
        self.recent.append(state)

    def views(self, answer_len: int) -> Tensor | None:
        """(L, 3, H) float32 as `answer_views` gives them for the answer's first `answer_len` tokens; None when
        their states are not all here (the last one not fed yet, or cut off further back than `tail`)."""
        if answer_len <= 0:
            return torch.stack([self.prompt_last] * 3, dim=1)
        cut = self.fed - answer_len  # tokens fed after the answer's last one (a stop string's)
        if cut < 0 or cut >= len(self.recent):
            return None
        kept = self.total - sum((s.double() for s in list(self.recent)[len(self.recent) - cut:]),
                                torch.zeros_like(self.total))
        return torch.stack([self.prompt_last, (kept / answer_len).float(), self.recent[-1 - cut]], dim=1)


@torch.no_grad()
def row_answer_views(backbone, layers: Sequence[int], prompt: Sequence[int], answer: Sequence[int]) -> Tensor:
    """(1, L, 3, H): `answer_views` of one prompt and its answer's tokens, by one forward pass over both (what a
    correctness probe reads of a generated answer); no layers: (1, 0, 3, H) without a pass."""
    if not layers:
        return torch.zeros(1, 0, len(ANSWER_VIEWS), backbone.hidden_size)
    ids = torch.tensor([list(prompt) + list(answer)], dtype=torch.long, device=backbone.device)
    with LayerCapture(backbone.model, layers) as capture:
        backbone.forward(ids)
        states = capture.take()[0]  # (T, L, H)
    return answer_views(states, len(prompt) - 1, len(answer))[None].cpu()
