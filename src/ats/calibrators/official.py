"""The paper's released heads: the layout of the authors' code (Johnathan-Xie/adaptive-temperature-scaling,
`src/llmtuner/model/calibration/`) read into our transformer head, number for number (docs/official_heads.md).

    folder/config.json                    calibration_type, in_features, intermediate_size, num_attention_heads,
                                          num_key_value_heads, feature_key, normalize_logits, base_model_name_or_path
    folder/calibration_head.safetensors   transformer.self_attn.{q,k,v,o}_proj.weight,
                                          transformer.mlp.{gate,up,down}_proj.weight,
                                          transformer.{input,post_attention}_layernorm.weight, linear_head.{weight,bias}

The official forward is `logits * exp(linear_head(DecoderLayer(h))).clip(max=10)`: one Llama decoder layer (RMSNorm
eps 1e-6, RoPE base 10000, grouped-query attention, SiLU MLP) and a linear head with NO final norm. Our
`TransformerHead` is the same layer with a final RMSNorm before its projection, so an official head becomes an
`OfficialATSCalibrator`: our head with that norm replaced by the identity, grouped key/value projections repeated
to one per attention head (exactly what the official `repeat_kv` does to their outputs), weights in float32.
Saved, it is an ordinary calibrator folder of type "ats-official" (`load_calibrator` reads both).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import ATSError
from ..io import read_json
from ..model.backbone import Backbone
from ..model.heads import HeadConfig
from ..model.heads.config import MAX_SCALE  # the official max_temperature (not in config.json, never changed)
from .ats import ATSCalibrator, ATSConfig
from .saving import OFFICIAL_CONFIG, OFFICIAL_LAYOUT, saved_type

OFFICIAL_WEIGHTS = "calibration_head.safetensors"
OFFICIAL_PICKLE = "calibration_head.bin"
RMS_EPS = 1e-6  # the official DecoderLayer's rms_norm_eps (TransformerHead never passes another)
ROPE_THETA = 10000.0  # the official SelfAttention's rope_theta (not in config.json)
REQUIRED = ("calibration_type", "in_features", "intermediate_size", "num_attention_heads")
# official state-dict key -> ours (TransformerHead)
KEY_MAP = {
    "transformer.input_layernorm.weight": "input_norm.weight",
    "transformer.self_attn.q_proj.weight": "attn.q_proj.weight",
    "transformer.self_attn.k_proj.weight": "attn.k_proj.weight",
    "transformer.self_attn.v_proj.weight": "attn.v_proj.weight",
    "transformer.self_attn.o_proj.weight": "attn.o_proj.weight",
    "transformer.post_attention_layernorm.weight": "post_attn_norm.weight",
    "transformer.mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "transformer.mlp.up_proj.weight": "mlp.up_proj.weight",
    "transformer.mlp.down_proj.weight": "mlp.down_proj.weight",
    "linear_head.weight": "proj.weight",
    "linear_head.bias": "proj.bias",
}


def read_official_config(directory: Path) -> dict:
    """The official config.json, checked for what our head can reproduce.

    Raises:
        ATSError: naming the file, field and value: not a transformer head, a feature other than the last hidden
            state, normalised logits, a missing or non-integer size.
    """
    path = directory / OFFICIAL_CONFIG
    config = read_json(path)
    where = str(path)
    if not isinstance(config, dict):
        raise ATSError(f"{where}: expected a JSON object, got {type(config).__name__}")
    for key in REQUIRED:
        if key not in config:
            raise ATSError(f"{where}: missing field {key!r}")
    if config["calibration_type"] != "transformer":
        raise ATSError(f"{where}: calibration_type {config['calibration_type']!r} is not supported (only the "
                       f"paper's 'transformer' head is read)")
    if config.get("feature_key", "hidden_states") != "hidden_states":
        raise ATSError(f"{where}: feature_key {config['feature_key']!r} is not supported (only 'hidden_states', "
                       f"the backbone's last hidden state)")
    if config.get("normalize_logits", False):
        raise ATSError(f"{where}: normalize_logits true is not supported (the head would scale logits / std(logits))")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    for key in ("in_features", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        value = config[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ATSError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    hidden, heads, kv_heads = config["in_features"], config["num_attention_heads"], config["num_key_value_heads"]
    if hidden % heads or (hidden // heads) % 2:
        raise ATSError(f"{where}: in_features {hidden} / num_attention_heads {heads} must be an even integer (RoPE)")
    if heads % kv_heads:
        raise ATSError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    return config


def read_official_weights(directory: Path) -> dict[str, Tensor]:
    """The official state dict from calibration_head.safetensors; a pickle (.bin) is refused, never unpickled.

    Raises:
        ATSError: if only calibration_head.bin exists (with how to convert it), or the file is missing or corrupt.
    """
    path = directory / OFFICIAL_WEIGHTS
    if not path.is_file():
        if (directory / OFFICIAL_PICKLE).is_file():
            raise ATSError(f"{directory / OFFICIAL_PICKLE}: a pickle file, which ats never loads; convert it once, "
                           f"where you trust it, to {OFFICIAL_WEIGHTS} (docs/official_heads.md gives the command)")
        raise ATSError(f"{path}: file not found")
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise ATSError(f"{path}: corrupt or truncated safetensors file ({err})") from None


def map_state(state: dict[str, Tensor], config: dict, where: str) -> dict[str, Tensor]:
    """The official state dict as our `TransformerHead`'s (without the final norm), in float32.

    Grouped-query key/value projections (num_key_value_heads < num_attention_heads) are repeated per group: the
    official `repeat_kv` repeats each key/value head's output `n_rep` times in a row, which is the same as repeating
    the rows of each head's block of k_proj / v_proj.

    Raises:
        ATSError: naming the first missing or unexpected key, or a tensor whose shape does not match the config.
    """
    missing = sorted(set(KEY_MAP) - set(state))
    unexpected = sorted(set(state) - set(KEY_MAP))
    if missing:
        raise ATSError(f"{where}: missing tensor {missing[0]!r} (an official transformer head has {len(KEY_MAP)})")
    if unexpected:
        raise ATSError(f"{where}: unexpected tensor {unexpected[0]!r} (not part of an official transformer head)")
    hidden, inter = config["in_features"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    kv_width = kv_heads * head_dim
    shapes = {"input_norm.weight": (hidden,), "post_attn_norm.weight": (hidden,),
              "attn.q_proj.weight": (hidden, hidden), "attn.k_proj.weight": (kv_width, hidden),
              "attn.v_proj.weight": (kv_width, hidden), "attn.o_proj.weight": (hidden, hidden),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter), "proj.weight": (1, hidden), "proj.bias": (1,)}
    ours = {}
    for official, key in KEY_MAP.items():
        tensor = state[official]
        if tuple(tensor.shape) != shapes[key]:
            raise ATSError(f"{where}: tensor {official!r} has shape {tuple(tensor.shape)}, the config gives "
                           f"{shapes[key]}")
        ours[key] = tensor.detach().to("cpu", torch.float32)
    for key in ("attn.k_proj.weight", "attn.v_proj.weight"):
        ours[key] = ours[key].view(kv_heads, head_dim, hidden).repeat_interleave(heads // kv_heads, dim=0) \
            .reshape(hidden, hidden)
    return ours


class OfficialATSCalibrator(ATSCalibrator):
    """ATS with the official head: our `TransformerHead` without its final norm (see the module docstring).

    Args:
        config: as for `ATSCalibrator`; `config.head` must be a transformer head.
    """

    name = "ats-official"

    def __init__(self, config: ATSConfig) -> None:
        if config.head.head_type != "transformer":
            raise ATSError(f"ats-official: head_type must be 'transformer', got {config.head.head_type!r}")
        super().__init__(config)
        self.head.final_norm = nn.Identity()  # the official linear head reads the layer's output directly

    @classmethod
    def read_folder(cls, directory: Path, backbone: Backbone | None = None) -> "OfficialATSCalibrator":
        """A folder in the paper's layout (`from_official`: the backbone's hidden size checked before the weights
        are read), or its conversion saved by `save_pretrained`."""
        if saved_type(directory) == OFFICIAL_LAYOUT:
            return cls.from_official(directory, backbone=backbone)
        return super().read_folder(directory, backbone)

    @classmethod
    def from_official(cls, directory: str | Path, backbone: Backbone | None = None) -> "OfficialATSCalibrator":
        """Read a head in the official layout; with `backbone`, check its hidden size.

        Args:
            directory: the folder with config.json and calibration_head.safetensors.
            backbone: the backbone it will read, or None to skip the check.

        Returns:
            The calibrator, its head in eval mode, float32.

        Raises:
            ATSError: on an unsupported or invalid config, a pickle or missing weights file, mismatched tensors, or
                a backbone of another hidden size.
        """
        directory = Path(directory)
        config = read_official_config(directory)
        if backbone is not None:  # before reading the weights (hundreds of MB for a 7B model's head)
            check_hidden_size(config["in_features"], backbone)
        state = map_state(read_official_weights(directory), config, str(directory / OFFICIAL_WEIGHTS))
        head = HeadConfig(head_type="transformer", hidden_size=config["in_features"],
                          num_heads=config["num_attention_heads"], intermediate_size=config["intermediate_size"],
                          rope_theta=ROPE_THETA)
        record = {k: config[k] for k in ("calibration_type", "num_key_value_heads", "max_position_embeddings",
                                         "layer_idx", "loss_type", "smooth_loss_weight", "label_smoothing_type",
                                         "smoothing_topk") if k in config}
        calibrator = cls(ATSConfig(head=head, max_scale=MAX_SCALE, hidden_size=config["in_features"],
                                   base_model=str(config.get("base_model_name_or_path") or "unknown"),
                                   training={"source": "official", "official_config": record}))
        calibrator.head.load_state_dict(state, strict=True)
        calibrator.head.eval()
        if backbone is not None:
            calibrator.check_backbone(backbone)
        return calibrator

    def check_backbone(self, backbone: Backbone) -> None:
        """Refuse a backbone of another hidden size (the official heads record no vocabulary or revision).

        Raises:
            ATSError: naming both sizes.
        """
        check_hidden_size(self.config_.hidden_size, backbone)


def check_hidden_size(in_features: int, backbone: Backbone) -> None:
    """Refuse a backbone whose hidden size is not the head's `in_features`.

    Raises:
        ATSError: naming both sizes.
    """
    if in_features != backbone.hidden_size:
        raise ATSError(f"calibrator: the head reads hidden size (in_features) {in_features}, backbone "
                       f"{backbone.name} has hidden size {backbone.hidden_size}")
