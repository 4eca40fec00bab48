"""The Hugging Face Hub for calibrators: a repo id resolved to a local snapshot, and the model card of an upload
(docs/hub.md).

    resolve_folder("runs/smol/head")      # a local folder wins, always
    resolve_folder("jxie/ATS-...")        # else owner/name: huggingface_hub.snapshot_download (cache, then network)
    model_card(info)                      # README.md: base_model, datasets, training, evidence numbers
    run_record("runs/smol/head")          # the data and held-out numbers a trained head's folder records

Only JSON, safetensors and markdown files are downloaded: nothing a calibrator reads is a pickle.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ATSError

DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.md"]  # a calibrator's files
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # a model's, no pickles
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(name: str) -> bool:
    """Whether `name` has the shape of a Hub repo id (owner/name), not of a local path."""
    return bool(REPO_ID.match(name)) and not name.startswith((".", "/", "~")) and ".." not in name


def resolve_folder(name: str | Path, *, revision: str | None = None, token: str | bool | None = None,
                   patterns: list[str] = DOWNLOAD_PATTERNS) -> Path:
    """The local folder of `name`: the path itself when it exists, else the snapshot of the Hub repo `name`.

    `huggingface_hub.snapshot_download` reads the local cache first ($HF_HUB_CACHE, with $HF_HUB_OFFLINE=1 the cache
    only) and downloads what is missing.

    Args:
        name: a local folder, or a Hub repo id (owner/name).
        revision: the repo's branch, tag or commit (None: main).
        token: the Hub token (None: the logged-in one).
        patterns: the files to download (a calibrator's by default; `MODEL_PATTERNS` for a model).

    Returns:
        The folder (a path that does not exist is returned as it is when `name` is not shaped like a repo id, so
        that the caller's "file not found" names it).

    Raises:
        ATSError: one line naming the repo id, when it is neither cached nor downloadable.
    """
    path = Path(name).expanduser()
    if path.exists() or not is_repo_id(str(name)):
        return path
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ATSError(f"{name}: no such folder (and huggingface_hub, which reads Hub ids, is not installed)") \
            from None
    try:
        return Path(snapshot_download(repo_id=str(name), revision=revision, token=token,
                                      allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise ATSError(f"{name}: no such folder, and not in the Hugging Face cache ({_cache_dir()}) while offline "
                       f"(HF_HUB_OFFLINE=1 or no connection)") from None
    except GatedRepoError:
        raise ATSError(f"{name}: a gated Hub repository; accept its terms on the Hub and log in (hf auth login)") \
            from None
    except RepositoryNotFoundError:
        raise ATSError(f"{name}: no such folder, and no such Hub repository (or a private one: log in with "
                       f"hf auth login)") from None
    except RevisionNotFoundError:
        raise ATSError(f"{name}: Hub repository has no revision {revision!r}") from None
    except HfHubHTTPError as err:
        raise ATSError(f"{name}: Hub download failed ({str(err).splitlines()[0]})") from None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def model_card(info: dict) -> str:
    """A model card (README.md) for a calibrator upload.

    Args:
        info: `type`, `label` and `repo_id`; optionally `base_model`, `revision`, `hidden_size`, `datasets` (list of
            Hub ids or descriptions of the training data), `training` (the training record: loss, lr, steps ...),
            `evidence` ({row: {metric: value}}, e.g. held-out token ECE, task ECE).

    Returns:
        The card: YAML front matter (library_name, base_model, datasets, tags) and markdown sections.
    """
    datasets = [d for d in info.get("datasets") or [] if d]
    base = info.get("base_model")
    front = ["---", "library_name: ats", "tags:", "- calibration", "- adaptive-temperature-scaling"]
    if base and base != "unknown":
        front.append(f"base_model: {base}")
    hub_datasets = [d for d in datasets if is_repo_id(d)]
    if hub_datasets:
        front += ["datasets:", *[f"- {d}" for d in hub_datasets]]
    front.append("---")
    repo = info["repo_id"]
    lines = [f"# {info['label']} calibrator for {base or 'an unrecorded backbone'}", "",
             f"A post-hoc calibrator made with `ats`, Adaptive Temperature Scaling (type `{info['type']}`): it "
             "rescales the backbone's logits so that its confidence matches its accuracy; the argmax of the scaling "
             "methods, and so the generated text, is unchanged.", "", "## Use", "", "```python",
             "from ats import load_backbone, load_calibrator", "",
             f"backbone = load_backbone({base!r})" if base and base != "unknown" else "backbone = load_backbone(...)",
             f"calibrator = load_calibrator({repo!r}, backbone=backbone)", "```", "", "```bash",
             f"ats generate --model {base or 'MODEL'} --calibrator {repo} \"What is the capital of Australia?\"", "```",
             "", "## Backbone", "", f"- base model: {base or 'not recorded'}"]
    for key, name in (("revision", "revision"), ("hidden_size", "hidden size")):
        if info.get(key) not in (None, "unknown", 0):
            lines.append(f"- {name}: {info[key]}")
    lines += ["", "## Training data", ""]
    lines += [f"- {d}" for d in datasets] or ["- not recorded"]
    training = info.get("training") or {}
    if training:
        lines += ["", "## Training", "", "| setting | value |", "|---|---|"]
        lines += [f"| {k} | {_number(v)} |" for k, v in sorted(training.items()) if not isinstance(v, (dict, list))]
    evidence = info.get("evidence") or {}
    if evidence:
        metrics = sorted({m for row in evidence.values() for m in row})
        lines += ["", "## Evidence", "", "| | " + " | ".join(metrics) + " |", "|---|" + "---:|" * len(metrics)]
        lines += [f"| {row} | " + " | ".join(_number(values.get(m, "")) for m in metrics) + " |"
                  for row, values in evidence.items()]
    else:
        lines += ["", "## Evidence", "", "No evaluation numbers were recorded with this upload."]
    return "\n".join(front + [""] + lines) + "\n"


EVIDENCE_METRICS = ("ece", "adaptive_ece", "brier", "nll", "auroc", "accuracy", "mean_confidence")


def run_record(directory: str | Path) -> dict:
    """The training data and the evidence a head folder written by `ats train` carries, as `push_to_hub` takes them.

    Args:
        directory: the head's folder (with fingerprint.json and training_history.json beside the weights).

    Returns:
        {"datasets": [the data source, its size and split], "evidence": {"held-out tokens (epoch E, N tokens)":
        {metric: value}}}, each empty when the file is not there.

    Raises:
        ATSError: if one of the files is not valid JSON.
    """
    from .fingerprint import stored_fingerprint
    from .io import read_json

    directory = Path(directory)
    data = ((stored_fingerprint(directory) or {}).get("features") or {}).get("data") or {}
    datasets = []
    if data.get("source"):
        size = f"{data['records']} records" if data.get("records") else "all records"
        datasets.append(f"{data['source']} ({size}, {data.get('val_fraction', '?')} held out, seed "
                        f"{data.get('seed', '?')})")
    evidence = {}
    history = directory / "training_history.json"
    epochs = read_json(history).get("epochs") if history.is_file() else None
    if epochs:
        last = epochs[-1]
        row = f"held-out tokens (epoch {last.get('epoch', len(epochs) - 1)}, {last.get('n', '?')} tokens)"
        evidence[row] = {m: last[m] for m in EVIDENCE_METRICS if isinstance(last.get(m), (int, float))}
    return {"datasets": datasets, "evidence": evidence}


def upload_folder(folder: Path, repo_id: str, *, private: bool = False, token: str | None = None,
                  commit_message: str = "Upload calibrator") -> str:
    """Create `repo_id` if needed and upload every file of `folder` to it (needs the network and a write token).

    Returns:
        The URL of the commit.

    Raises:
        ATSError: if `repo_id` is not owner/name or the upload fails.
    """
    if not is_repo_id(repo_id):
        raise ATSError(f"push_to_hub: {repo_id!r} is not a Hub repo id (owner/name)")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message)
    except HfHubHTTPError as err:
        raise ATSError(f"push_to_hub {repo_id}: {str(err).splitlines()[0]}") from None
    return str(getattr(info, "commit_url", info))
