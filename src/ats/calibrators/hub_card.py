"""A calibrator on the Hugging Face Hub: its model card, the folder with the card, the upload (docs/hub.md)."""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_file


class HubCard:
    """card_info / save_for_hub / push_to_hub, for a calibrator (mixed into `Calibrator`: it uses `name`, `label`,
    `config()` and `save_pretrained`)."""

    def card_info(self) -> dict:
        """What a model card records about this calibrator: its type and label, and from its config the backbone
        (base_model, revision, hidden_size) and the training record, where it has them."""
        config = self.config()
        return {"type": self.name, "label": self.label, "base_model": config.get("base_model"),
                "revision": config.get("revision"), "hidden_size": config.get("hidden_size"),
                "training": config.get("training") or {}}

    def save_for_hub(self, directory: str | Path, repo_id: str, *, datasets: list[str] | None = None,
                     evidence: dict[str, dict[str, float]] | None = None) -> Path:
        """`save_pretrained(directory)` plus the model card README.md that `push_to_hub` uploads.

        Args:
            directory: the folder to write; an existing one is replaced.
            repo_id: the Hub repo the card's usage lines name (owner/name).
            datasets: the training data (Hub ids or descriptions).
            evidence: numbers to record, {row: {metric: value}} (e.g. {"held-out tokens": {"ece": 0.01}}).

        Returns:
            The folder.
        """
        from ..hub import model_card

        directory = Path(directory)
        self.save_pretrained(directory)
        card = model_card({**self.card_info(), "repo_id": repo_id, "datasets": datasets or [], "evidence": evidence})
        with atomic_file(directory / "README.md") as f:
            f.write(card)
        return directory

    def push_to_hub(self, repo_id: str, *, datasets: list[str] | None = None,
                    evidence: dict[str, dict[str, float]] | None = None, private: bool = False,
                    token: str | None = None, commit_message: str = "Upload calibrator") -> str:
        """Upload the config, the safetensors weights and a generated model card to the Hub repo `repo_id`.

        Needs the network and a write token (`hf auth login`); `save_for_hub` writes the same folder locally.

        Args:
            repo_id: owner/name; created if it does not exist.
            datasets: the training data, recorded in the card.
            evidence: numbers recorded in the card, {row: {metric: value}}.
            private: create the repo private.
            token: a Hub token (None: the logged-in one).
            commit_message: the commit's message.

        Returns:
            The URL of the commit.

        Raises:
            ATSError: if `repo_id` is not owner/name or the upload fails.
        """
        import tempfile

        from ..hub import upload_folder

        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save_for_hub(Path(tmp) / "calibrator", repo_id, datasets=datasets, evidence=evidence)
            return upload_folder(folder, repo_id, private=private, token=token, commit_message=commit_message)
