"""Running on several processes (GPUs, nodes) with Hugging Face accelerate (torch.distributed underneath).

`init_distributed()` returns a `Dist`: a single-process no-op unless the program was started by a launcher
(`accelerate launch`, `torchrun`: WORLD_SIZE > 1), in which case it creates an `accelerate.Accelerator`, which
initialises the process group (NCCL on GPUs, gloo on CPUs) and gives each process its device.

What is distributed (see docs/scaling.md):
- feature extraction: shard k of the length-sorted shard plan is written by rank k % W; the main process writes
  meta.json after a barrier;
- head training: the head alone is wrapped for data parallelism (`accelerator.prepare(head, optimizer)`), the
  frozen backbone is only moved to each process's device. The global micro-batch sequence is dealt round-robin,
  each rank accumulates batch_size / (micro_batch_size * W) micro-batches and DDP averages the gradients, so a step
  applies the same update as one process with accumulation;
- metrics: per-step losses are summed over ranks, validation ECE is computed on all ranks' tokens (gathered);
- writing: only the main process writes checkpoints and the final head.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def launched() -> bool:
    """True when started by a multi-process launcher (torchrun / accelerate launch set WORLD_SIZE).

    Returns:
        Whether the environment's WORLD_SIZE is above 1.
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class Dist:
    """The process's place in the job; `accelerator` is None for a plain single-process run."""

    accelerator: Any = None

    @property
    def distributed(self) -> bool:
        """True when there is more than one process."""
        return self.accelerator is not None and self.accelerator.num_processes > 1

    @property
    def rank(self) -> int:
        """This process's index (0 for a single process)."""
        return self.accelerator.process_index if self.accelerator is not None else 0

    @property
    def world_size(self) -> int:
        """The number of processes, W."""
        return self.accelerator.num_processes if self.accelerator is not None else 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that writes."""
        return self.rank == 0

    @property
    def device(self) -> torch.device | None:
        """The accelerator's device for this process, or None for a plain single-process run."""
        return self.accelerator.device if self.accelerator is not None else None

    def barrier(self) -> None:
        """Wait for every process (a no-op on a single process)."""
        if self.distributed:
            self.accelerator.wait_for_everyone()

    def my_shards(self, n_shards: int) -> list[int]:
        """Round-robin shard ids of this rank: r, r + W, r + 2W, ...

        Args:
            n_shards: the total number of shards.

        Returns:
            This rank's shard ids, increasing.
        """
        return list(range(self.rank, n_shards, self.world_size))

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64).

        Args:
            values: this rank's values; the same length on every rank.

        Returns:
            The sums, one per value (a copy of `values` on a single process).
        """
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def gather_cat(self, values: Tensor) -> Tensor:
        """Concatenate a 1-D tensor of any length over ranks, in rank order (float64 on the wire).

        Args:
            values: (n_r,) this rank's values (flattened if not 1-D); n_r may differ between ranks.

        Returns:
            (sum of n_r,) on the CPU in `values`' dtype (`values` itself on a single process).
        """
        if not self.distributed:
            return values
        acc = self.accelerator
        local = values.to(self.device, torch.float64).reshape(-1)
        sizes = acc.gather(torch.tensor([local.numel()], device=self.device)).tolist()
        width = max(sizes)
        padded = torch.zeros(width, dtype=torch.float64, device=self.device)
        padded[: local.numel()] = local
        everything = acc.gather(padded).cpu()
        return torch.cat([everything[r * width: r * width + n] for r, n in enumerate(sizes)]).to(values.dtype)


SINGLE = Dist()


def init_distributed(cpu: bool | None = None) -> Dist:
    """A `Dist` for this process: an Accelerator when launched on several processes, else the no-op SINGLE.

    Args:
        cpu: force (True) or forbid (False) CPU processes; None: CPU only when CUDA is unavailable.

    Returns:
        The process's `Dist`.
    """
    if not launched():
        return SINGLE
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    # the heads' buffers (rotary tables) are constants: no per-forward broadcast
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    return Dist(Accelerator(cpu=bool(cpu) if cpu is not None else not torch.cuda.is_available(),
                            kwargs_handlers=[ddp]))
