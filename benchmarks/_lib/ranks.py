"""Local ranks for the multi-process benchmarks: ``entry(argv)`` on ``world`` processes (gloo on CPU)."""

from __future__ import annotations

import os
import socket
import sys
from typing import Callable, Sequence


def spawn(entry: Callable[[Sequence[str]], object], argv: Sequence[str], world: int = 2) -> None:
    """Run ``entry(argv)`` in ``world`` processes that find each other on a free local port (each sees
    ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` as torchrun sets them)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(entry, world, port, list(argv)), nprocs=world, join=True)


def _worker(rank: int, entry, world: int, port: int, argv) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    entry(argv)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort a process finalizing beside them
