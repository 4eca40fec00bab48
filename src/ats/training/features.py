"""Cached backbone features: hidden states extracted once, so many heads and all baselines train from one pass.

Layout of a feature folder:

    meta.json                  backbone identity, dtype, sizes, the list of shards with their sha256
    shard-00000.safetensors    hidden (N_tok, H) fp16/bf16, input_ids (N_tok,), labels (N_tok,), offsets (S+1,),
                               example_index (S,)  -- S sequences packed end to end, no padding stored;
                               summary (N_resp, D) float32: the scale summary of each response token, in order
                               (`ats.model.scale_summary`), when extracted with one
    shard-00000.json           the shard's sha256 and sizes, written after the shard (marks it finished)

Sequences are sorted by length and assigned to shards deterministically, so an interrupted extraction resumes by
skipping finished shards. Shards are read one at a time (memory stays flat as the data grows) and their checksum is
verified on first read. Logits are never stored: `(N, V)` for a whole data set would not fit. The extraction computes
the logits of the response positions once (from the hidden states as stored, so both routes see the same `z`) and
keeps their scale summary, from which the training losses follow without the vocabulary; the exact route
(`--exact-loss`, online features, folders extracted without a summary) recomputes them from `h` in chunks
(`z = backbone.logits(h)`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file
from torch import Tensor
from tqdm.auto import tqdm

from ..errors import ATSError
from ..io import atomic_file, read_json, write_json
from ..model.backbone import Backbone
from ..model.labels import IGNORE_INDEX
from ..model.scale_summary import ScaleSummarySpec, summarize_logits
from ..padding import pad_batch
from .data import TokenizedExample

META_NAME = "meta.json"
FORMAT_VERSION = 1
SUMMARY_CHUNK = 128  # response tokens per summary computation: a few (chunk, V) float32 buffers
DEFAULT_SUMMARY = ScaleSummarySpec()  # the scale summary extracted with the features (max_scale: the head's default)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group indices (already sorted by length, longest first) so that B * T_max <= batch_tokens."""
    batches, current, t_max = [], [], 0
    for i, n in enumerate(lengths):
        if current and max(t_max, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, t_max = [], 0
        current.append(i)
        t_max = max(t_max, n)
    if current:
        batches.append(current)
    return batches


def shard_plan(examples: list[TokenizedExample], shard_sequences: int) -> list[list[int]]:
    """Deterministic assignment of example indices to shards: longest first, `shard_sequences` per shard.

    Args:
        examples: the tokenized examples.
        shard_sequences: sequences per shard (the last shard may hold fewer).

    Returns:
        One list of example indices per shard (ties in length broken by index).
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    return [order[k:k + shard_sequences] for k in range(0, len(order), shard_sequences)]


def micro_batch_plan(shard_sizes: list[int], batch_size: int, *, shuffle: bool = False, seed: int = 0,
                     shard_ids: list[int] | None = None) -> list[tuple[int, list[int]]]:
    """The seeded global order of micro-batches as (shard, rows in the shard), computed from the sizes alone.

    Shards are visited in a seeded order, and the rows of each shard in a seeded order, cut into `batch_size` pieces
    (the last piece of a shard may be smaller). Shards hold sequences of similar length (they are cut from the
    length-sorted data), so a micro-batch wastes little padding. Cached and online features use the same plan.

    Args:
        shard_sizes: the number of sequences in each shard.
        batch_size: sequences per micro-batch.
        shuffle: shuffle the shard order and the rows within each shard; otherwise both in order.
        seed: the seed of the shuffling.
        shard_ids: the shards to visit; default all.

    Returns:
        [(shard id, row indices within the shard)] per micro-batch, in order.
    """
    rng = random.Random(seed)
    shard_ids = list(range(len(shard_sizes))) if shard_ids is None else list(shard_ids)
    if shuffle:
        rng.shuffle(shard_ids)
    plan = []
    for k in shard_ids:
        order = list(range(shard_sizes[k]))
        if shuffle:
            rng.shuffle(order)
        plan.extend((k, order[i:i + batch_size]) for i in range(0, len(order), batch_size))
    return plan


@torch.no_grad()
def extract_features(
    backbone: Backbone,
    examples: list[TokenizedExample],
    out_dir: str | Path,
    *,
    batch_tokens: int = 8192,
    shard_sequences: int = 256,
    dtype: str = "float16",
    shards: list[int] | None = None,
    progress: bool = True,
    extra_meta: dict | None = None,
    summary: ScaleSummarySpec | None = DEFAULT_SUMMARY,
) -> "FeatureStore":
    """Run the backbone over `examples` once and write hidden states + labels as shards.

    Finished shards (their `.json` marker present and the checksum matching) are skipped, so a killed extraction
    resumes where it stopped. The layout is the module docstring's.

    Args:
        backbone: the frozen backbone.
        examples: the tokenized examples.
        out_dir: the feature folder (created if missing).
        batch_tokens: the most padded tokens (B x T_max) per forward pass.
        shard_sequences: sequences per shard.
        dtype: the stored hidden states' dtype: "float16", "bfloat16" or "float32".
        shards: which shard indices this process writes (distributed extraction); default all.
        progress: show a progress bar.
        extra_meta: more entries for meta.json (e.g. the data's description).
        summary: also store the scale summary of every response token with these settings (meta.json records
            them); default `DEFAULT_SUMMARY`; None: hidden states only.

    Returns:
        The `FeatureStore` of the folder; None when `shards` is given (the main process writes meta.json with
        `write_meta` once every rank has finished).

    Raises:
        ATSError: if `dtype` is not one of the three.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype)
    if store_dtype is None:
        raise ATSError(f"feature dtype must be float16, bfloat16 or float32, got {dtype!r}")
    plan = shard_plan(examples, shard_sequences)
    todo = range(len(plan)) if shards is None else shards
    pad_id = backbone.tokenizer.pad_token_id or 0
    total = sum(len(examples[i].input_ids) for k in todo for i in plan[k])
    bar = tqdm(total=total, unit="tok", desc="extract features", disable=not progress)
    for k in todo:
        shard_path = out_dir / f"shard-{k:05d}.safetensors"
        marker = out_dir / f"shard-{k:05d}.json"
        indices = plan[k]
        n_tok = sum(len(examples[i].input_ids) for i in indices)
        if _finished(marker, shard_path, summary):
            bar.update(n_tok)
            continue
        pieces: dict[int, Tensor] = {}
        packer = _SummaryPacker(backbone, summary) if summary is not None else None
        for batch in _token_batches([len(examples[i].input_ids) for i in indices], batch_tokens):  # in order
            ids = [examples[indices[j]].input_ids for j in batch]
            input_ids, mask = pad_batch(ids, pad_id)
            hidden, _ = backbone.forward(input_ids.to(backbone.device), mask.to(backbone.device))  # (B, T, H)
            for row, j in enumerate(batch):
                pieces[j] = hidden[row, : len(ids[row])].to(store_dtype).cpu()
                if packer is not None:
                    packer.add(pieces[j], torch.tensor(examples[indices[j]].labels, dtype=torch.long))
            bar.update(int(mask.sum()))
        lengths = torch.tensor([len(examples[i].input_ids) for i in indices])
        tensors = {
            "hidden": torch.cat([pieces[j] for j in range(len(indices))]).contiguous(),
            "input_ids": torch.tensor([t for i in indices for t in examples[i].input_ids], dtype=torch.long),
            "labels": torch.tensor([t for i in indices for t in examples[i].labels], dtype=torch.long),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "example_index": torch.tensor(indices, dtype=torch.long),
        }
        if summary is not None:
            tensors["summary"] = packer.finish()
        with atomic_file(shard_path, "wb") as f:
            f.write(_serialize(tensors))
        write_json(marker, {"sha256": _sha256(shard_path), "sequences": len(indices), "tokens": n_tok,
                            "response_tokens": int((tensors["labels"] != IGNORE_INDEX).sum()),
                            **({"scale_summary": summary.describe()} if summary is not None else {})})
    bar.close()
    if shards is None:
        write_meta(out_dir, backbone, n_shards=len(plan), dtype=dtype,
                   extra={**(extra_meta or {}), **summary_meta(summary)})
        return FeatureStore(out_dir)
    return None  # type: ignore[return-value]  # distributed: the main process writes meta once all ranks finish


def _finished(marker: Path, shard_path: Path, summary: ScaleSummarySpec | None) -> bool:
    """Whether a shard is written, intact, and with the requested scale summary (or none, as requested)."""
    if not (marker.exists() and shard_path.exists()):
        return False
    done = read_json(marker)
    wanted = summary.describe() if summary is not None else None
    return done.get("scale_summary") == wanted and done.get("sha256") == _sha256(shard_path)


def summary_meta(summary: ScaleSummarySpec | None) -> dict:
    """The meta.json entry of a scale summary: {"scale_summary": its settings}, or {} without one.

    Args:
        summary: the settings, or None.

    Returns:
        The entry to merge into meta.json.
    """
    return {"scale_summary": summary.describe()} if summary is not None else {}


class _SummaryPacker:
    """The summary rows of a shard's response tokens, in order, packed across its sequences.

    The logits come from the hidden states as stored (rounded to the feature dtype), so that the summary and the
    exact route, which recomputes z from the stored h, describe the same logits. Response tokens are summarised
    SUMMARY_CHUNK at a time as soon as that many are waiting (so the progress bar moves with the work), the rest by
    `finish`: one sequence's own few tokens would make the logits' matmul read the whole output layer for a handful
    of rows.
    """

    def __init__(self, backbone: Backbone, spec: ScaleSummarySpec) -> None:
        self.backbone, self.spec = backbone, spec
        self.hidden: list[Tensor] = []  # waiting response tokens' hidden states, each (n_i, H)
        self.labels: list[Tensor] = []  # and their next-token ids, each (n_i,)
        self.waiting = 0
        self.rows: list[Tensor] = []  # finished summary rows, each (n, D)

    def add(self, hidden: Tensor, labels: Tensor) -> None:
        """Queue one sequence's response tokens: hidden (T, H) as stored, labels (T,) with IGNORE_INDEX elsewhere."""
        keep = labels != IGNORE_INDEX
        self.hidden.append(hidden[keep])
        self.labels.append(labels[keep])
        self.waiting += int(keep.sum())
        if self.waiting >= SUMMARY_CHUNK:
            self._summarise(whole_chunks_only=True)

    def finish(self) -> Tensor:
        """(N_resp, D) the rows of every queued token, in order."""
        self._summarise(whole_chunks_only=False)
        return torch.cat(self.rows) if self.rows else torch.empty(0, self.spec.width)

    def _summarise(self, *, whole_chunks_only: bool) -> None:
        h, y = torch.cat(self.hidden), torch.cat(self.labels)  # (n, H), (n,)
        n = h.shape[0] - h.shape[0] % SUMMARY_CHUNK if whole_chunks_only else h.shape[0]
        device, spec = self.backbone.device, self.spec
        for a in range(0, n, SUMMARY_CHUNK):
            z = self.backbone.logits(h[a:a + SUMMARY_CHUNK].to(device))  # (chunk, V)
            self.rows.append(summarize_logits(z, y[a:a + SUMMARY_CHUNK].to(device), max_scale=spec.max_scale,
                                              intervals=spec.intervals, knee=spec.knee).cpu())
        self.hidden, self.labels, self.waiting = [h[n:]], [y[n:]], h.shape[0] - n


def _serialize(tensors: dict[str, Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def write_meta(out_dir: Path, backbone: Backbone, *, n_shards: int, dtype: str, extra: dict | None = None) -> None:
    """Write meta.json from the finished shard markers (fails if a shard is missing).

    Args:
        out_dir: the feature folder.
        backbone: the backbone whose identity (`describe()`) is recorded.
        n_shards: the number of shards of the plan.
        dtype: the stored hidden states' dtype name.
        extra: more entries for meta.json.

    Raises:
        ATSError: if a shard's marker is missing.
    """
    shards = []
    for k in range(n_shards):
        marker = out_dir / f"shard-{k:05d}.json"
        if not marker.exists():
            raise ATSError(f"{out_dir}: shard {k} is missing; run the extraction again to finish it")
        shards.append({"file": f"shard-{k:05d}.safetensors", **read_json(marker)})
    write_json(out_dir / META_NAME, {
        "format_version": FORMAT_VERSION, "dtype": dtype, **backbone.describe(), "shards": shards,
        "sequences": sum(s["sequences"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
        "response_tokens": sum(s["response_tokens"] for s in shards), **(extra or {}),
    })


@dataclass
class SequenceBatch:
    """A right-padded batch of whole sequences of hidden states."""

    hidden: Tensor  # (B, T, H) float32, right-padded with zeros
    attention_mask: Tensor  # (B, T) 1 on real tokens
    labels: Tensor  # (B, T) next-token ids on response positions, IGNORE_INDEX elsewhere
    summary: Tensor | None = None  # (N_resp, D) scale summary rows of the response positions, row by row; or None


class FeatureStore:
    """Read access to an extracted feature folder; streams one shard at a time.

    Args:
        directory: the feature folder, as written by `extract_features`.

    Raises:
        ATSError: if meta.json is missing or invalid, or of another format version.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.meta = read_json(self.directory / META_NAME)
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ATSError(f"{self.directory / META_NAME}: unsupported format_version "
                           f"{self.meta.get('format_version')!r}")
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return int(self.meta["sequences"])

    @property
    def n_shards(self) -> int:
        """The number of shards."""
        return len(self.meta["shards"])

    @property
    def scale_summary(self) -> ScaleSummarySpec | None:
        """The settings of the stored scale summary, or None for a folder extracted without one."""
        entry = self.meta.get("scale_summary")
        return ScaleSummarySpec(**entry) if entry is not None else None

    @property
    def hidden_size(self) -> int:
        """H, the backbone's hidden size the features were extracted with."""
        return int(self.meta["hidden_size"])

    def check_backbone(self, backbone: Backbone) -> None:
        """Refuse features extracted from another backbone.

        Args:
            backbone: the backbone the features are to be used with.

        Raises:
            ATSError: naming the first identity field (`backbone.describe()`) that differs.
        """
        for key, value in backbone.describe().items():
            if self.meta.get(key) != value:
                raise ATSError(f"{self.directory}: features were extracted with {key}={self.meta.get(key)!r}, "
                               f"but the backbone has {key}={value!r}")

    def load_shard(self, k: int) -> dict[str, Tensor]:
        """One shard's tensors (memory-mapped by safetensors), its checksum verified on first read.

        Args:
            k: the shard index.

        Returns:
            {"hidden": (N_tok, H), "input_ids": (N_tok,), "labels": (N_tok,), "offsets": (S+1,),
            "example_index": (S,)}, and "summary" (N_resp, D) when extracted with a scale summary.

        Raises:
            ATSError: if the shard file is missing or its checksum does not match.
        """
        entry = self.meta["shards"][k]
        path = self.directory / Path(entry["file"]).name  # a config can never point outside its folder
        if k not in self._verified:
            if not path.exists():
                raise ATSError(f"{path}: shard file missing")
            if _sha256(path) != entry["sha256"]:
                raise ATSError(f"{path}: checksum mismatch (corrupt or truncated shard); delete it and re-extract")
            self._verified.add(k)
        return load_file(str(path))

    def sequences(self, shard_ids: list[int] | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """(hidden (T, H), labels (T,)) per sequence, shard by shard.

        Args:
            shard_ids: the shards to read; default all, in order.

        Yields:
            (hidden (T, H) in the stored dtype, labels (T,)) per sequence.
        """
        for k in range(self.n_shards) if shard_ids is None else shard_ids:
            shard = self.load_shard(k)
            offsets = shard["offsets"].tolist()
            for a, b in zip(offsets[:-1], offsets[1:]):
                yield shard["hidden"][a:b], shard["labels"][a:b]

    def batches(self, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                shard_ids: list[int] | None = None, rank: int = 0, world_size: int = 1,
                start: int = 0) -> Iterator[SequenceBatch]:
        """Right-padded batches of whole sequences; with shuffle, shard order and sequence order are seeded.

        Distributed training: the global sequence of micro-batches (see `micro_batch_plan`) is dealt round-robin,
        this process gets those with index % world_size == rank; `start` skips the first global micro-batches
        without reading them (resuming). A shard is read only if one of this process's micro-batches is in it.

        Args:
            batch_size: sequences per micro-batch.
            shuffle: seeded shard and sequence order; otherwise in stored order.
            seed: the seed of the order.
            shard_ids: the shards to read; default all.
            rank: this process's rank.
            world_size: the number of processes, W.
            start: the number of global micro-batches to skip.

        Yields:
            `SequenceBatch`es: hidden (B, T, H) float32, attention_mask (B, T), labels (B, T).
        """
        plan = micro_batch_plan([s["sequences"] for s in self.meta["shards"]], batch_size, shuffle=shuffle,
                                seed=seed, shard_ids=shard_ids)
        loaded_k, shard = None, None
        for m, (k, rows) in enumerate(plan):
            if m < start or m % world_size != rank:
                continue
            if k != loaded_k:
                shard, loaded_k = self.load_shard(k), k
                offsets = shard["offsets"].tolist()
                summary_offsets = _response_offsets(shard) if "summary" in shard else None
            seqs = [(shard["hidden"][offsets[i]:offsets[i + 1]], shard["labels"][offsets[i]:offsets[i + 1]])
                    for i in rows]
            summaries = None if summary_offsets is None else [
                shard["summary"][summary_offsets[i]:summary_offsets[i + 1]] for i in rows]
            yield collate(seqs, summaries)

    def response_tokens(self, chunk_tokens: int = 4096, *, max_tokens: int | None = None,
                        seed: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        """(hidden (n, H) float32, labels (n,)) chunks over response tokens only; with `max_tokens`, over a seeded
        random subset of that many of them (the same subset on every call).

        Args:
            chunk_tokens: the most tokens per chunk (chunks do not cross shards).
            max_tokens: use a random subset of this many response tokens; None: all.
            seed: the seed of the subset.

        Yields:
            (hidden (n, H) float32, labels (n,)) chunks, in shard order.
        """
        keep_subset = self._token_subset(max_tokens, seed)
        offset = 0
        for k in range(self.n_shards):
            shard = self.load_shard(k)
            keep = shard["labels"] != IGNORE_INDEX
            hidden, labels = shard["hidden"][keep], shard["labels"][keep]
            if keep_subset is not None:
                mine = keep_subset[offset:offset + len(labels)]
                offset += len(labels)
                hidden, labels = hidden[mine], labels[mine]
            for start in range(0, len(labels), chunk_tokens):
                yield hidden[start:start + chunk_tokens].float(), labels[start:start + chunk_tokens]

    def response_sequence_ids(self, *, max_tokens: int | None = None, seed: int = 0) -> Tensor:
        """(N,) long: the sequence (0 .. len(self) - 1, in stored order) of every response token, in the order of
        `response_tokens` with the same `max_tokens` and `seed`.

        Args:
            max_tokens: the random subset, as in `response_tokens`; None: all.
            seed: the seed of the subset.

        Returns:
            (N,) sequence indices.
        """
        ids, first = [], 0
        for k in range(self.n_shards):
            shard = self.load_shard(k)
            lengths = shard["offsets"].diff()
            seq = torch.repeat_interleave(torch.arange(first, first + len(lengths)), lengths)  # (N_tok,)
            ids.append(seq[shard["labels"] != IGNORE_INDEX])
            first += len(lengths)
        ids = torch.cat(ids)
        keep_subset = self._token_subset(max_tokens, seed)
        return ids if keep_subset is None else ids[keep_subset]

    def response_summary(self, *, max_tokens: int | None = None, seed: int = 0) -> Tensor | None:
        """(N, D) float32: the scale summary row of every response token, in the order of `response_tokens` with
        the same `max_tokens` and `seed`; None for a folder extracted without a summary.

        Args:
            max_tokens: the random subset, as in `response_tokens`; None: all.
            seed: the seed of the subset.

        Returns:
            (N, D) rows, or None.
        """
        if self.scale_summary is None:
            return None
        rows = torch.cat([self.load_shard(k)["summary"] for k in range(self.n_shards)])
        keep_subset = self._token_subset(max_tokens, seed)
        return rows if keep_subset is None else rows[keep_subset]

    def _token_subset(self, max_tokens: int | None, seed: int) -> Tensor | None:
        """A boolean mask over all response tokens (in shard order) selecting `max_tokens` of them, or None."""
        total = int(self.meta["response_tokens"])
        if max_tokens is None or max_tokens >= total:
            return None
        chosen = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:max_tokens]
        mask = torch.zeros(total, dtype=torch.bool)
        mask[chosen] = True
        return mask

    def logit_chunks(self, logits_fn: Callable[[Tensor], Tensor], chunk_tokens: int = 2048, *,
                     max_tokens: int | None = None, seed: int = 0):
        """A re-iterable source of (logits (n, V) float32, labels (n,)) for fitting token-level calibrators; with
        `max_tokens`, over a fixed seeded random subset of that many response tokens.

        Args:
            logits_fn: the output layer, h (n, H) -> z (n, V); run without gradients.
            chunk_tokens: the most tokens per chunk.
            max_tokens: use a random subset of this many response tokens; None: all.
            seed: the seed of the subset.

        Returns:
            A `LogitChunks` callable: each call starts a new pass over the chunks.
        """

        def chunks() -> Iterator[tuple[Tensor, Tensor]]:
            for hidden, labels in self.response_tokens(chunk_tokens, max_tokens=max_tokens, seed=seed):
                with torch.no_grad():  # closed before the yield: grad mode is global, the consumer may train
                    logits = logits_fn(hidden).float()
                yield logits, labels

        return chunks


def _response_offsets(shard: dict[str, Tensor]) -> list[int]:
    """(S + 1) offsets of each sequence's rows in the shard's "summary" (its response tokens, in order)."""
    before = torch.cat([torch.zeros(1, dtype=torch.long), (shard["labels"] != IGNORE_INDEX).long().cumsum(0)])
    return before[shard["offsets"]].tolist()  # response tokens before each sequence's first token


def collate(seqs: list[tuple[Tensor, Tensor]], summaries: list[Tensor] | None = None) -> SequenceBatch:
    """Right-pad (hidden (T_i, H), labels (T_i,)) sequences into one batch.

    Args:
        seqs: B pairs (hidden (T_i, H), labels (T_i,)), at least one.
        summaries: B scale summaries (n_resp_i, D) of the sequences' response tokens, or None.

    Returns:
        The batch: hidden (B, T_max, H) float32 with zeros on padding, attention_mask (B, T_max), labels (B, T_max)
        with -100 on padding, and the summary rows (N_resp, D) in the order of `labels != IGNORE_INDEX` (row by
        row) when `summaries` is given.
    """
    t_max = max(h.shape[0] for h, _ in seqs)
    width = seqs[0][0].shape[1]
    hidden = torch.zeros(len(seqs), t_max, width)
    mask = torch.zeros(len(seqs), t_max, dtype=torch.long)
    labels = torch.full((len(seqs), t_max), IGNORE_INDEX, dtype=torch.long)
    for row, (h, y) in enumerate(seqs):
        hidden[row, : len(y)] = h.float()
        mask[row, : len(y)] = 1
        labels[row, : len(y)] = y
    summary = torch.cat(summaries) if summaries is not None else None
    return SequenceBatch(hidden=hidden, attention_mask=mask, labels=labels, summary=summary)
