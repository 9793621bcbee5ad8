"""torch.distributed set-up for ``torchrun``: one process per device, gloo on CPU, nccl on GPU.

``torchrun --nproc_per_node N -m cli.main train ...`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``;
without them training runs as a single process and nothing here touches torch.distributed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from foundation.errors import UnavailableError


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (one all-reduce; just ``flag`` in a single process)."""
        if not self.enabled:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def device(self, requested: str) -> torch.device:
        """``requested`` ("auto", "cpu", "cuda"): this process's GPU when there is one, else the CPU."""
        if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise UnavailableError("device 'cuda' requested but torch sees no GPU")
        return torch.device("cuda", self.local_rank)


@contextmanager
def distributed_from_env(requested_device: str) -> Iterator[Distributed]:
    """Join the process group torchrun describes in the environment (if any) for the block's duration."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        yield Distributed()
        return
    context = Distributed(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    device = context.device(requested_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        yield context
    finally:
        dist.destroy_process_group()
