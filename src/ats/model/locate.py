"""What a model name and a device name may be, checked before anything loads: the rules `load_backbone` applies and
the CLI applies to `--model` and `--device` (each caller puts its own name for the value before the reason).
"""

from __future__ import annotations

from pathlib import Path

from .embedded import EMBEDDED_MODELS


def model_name_problem(name: str) -> str | None:
    """Why `name` can be neither an embedded model, a `.gguf` file, a model folder nor a Hub id (one line), or None.

    A name that starts with ".", "/" or "~", ends in ".gguf" or exists is taken for a local path; any other is a
    Hub id ("owner/name" or "name"), which only loading can confirm.
    """
    if name in EMBEDDED_MODELS:
        return None
    path = Path(name).expanduser()
    if name.startswith((".", "/", "~")) or path.suffix == ".gguf" or path.exists():
        if not path.exists():
            return f"no such file or folder (and not an embedded model: {', '.join(EMBEDDED_MODELS)})"
        if path.is_file() and path.suffix != ".gguf":
            return "a file, not a model folder or a .gguf file"
        if path.is_dir() and not (path / "config.json").is_file():
            return "not a model folder (no config.json)"
        return None
    if name.count("/") > 1 or not name.strip():
        return f"not an embedded model ({', '.join(EMBEDDED_MODELS)}), a local path or a Hub id (owner/name)"
    return None


def default_device() -> str:
    """"cuda" when torch sees a CUDA device, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_problem(name: str) -> str | None:
    """Why `name` is no device torch knows, or a CUDA / MPS device this machine does not have (one line), or None."""
    import torch

    try:
        parsed = torch.device(name)
    except (RuntimeError, TypeError):
        return "not a device (cpu, cuda, cuda:1, mps, ...)"
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return ("this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device") \
                + "; use cpu"
        if parsed.index is not None and parsed.index >= count:
            return f"this machine has {count} CUDA device{'s' * (count > 1)} (cuda:0 to cuda:{count - 1})"
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available here; use cpu"
    return None
