"""``torch_checkpointing`` storage for the tests: local files without ``O_DIRECT``, with a fault on one rank.

Its writer process unpickles the storage config, so it lives in a module the process can import.
``FaultyStorageConfig(fault="fail")`` makes ``rank`` == ``fault_rank``'s files of a checkpoint whose path holds
``fault_in`` fail to open (``OSError`` EIO: an injected disk failure); ``fault="hang"`` blocks that write for good
(after writing ``$HANG_OUT/blocked-<rank>``), as a hung file system does; ``fault="slow"`` delays it by
``delay_s``, as a slow one does.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

INJECTED = "injected: disk failure on rank 1"
#: Never set: a write waiting on it never returns.
NEVER = threading.Event()


@dataclass
class FaultyStorageConfig(LocalFileSystemStorageConfig):
    rank: int = 0
    fault_rank: int = -1
    fault_in: str = "\0"
    fault: str = "fail"
    delay_s: float = 0.0

    def create_storage(self) -> LocalFileSystemStorage:
        return FaultyStorage(self)


class FaultyStorage(LocalFileSystemStorage):
    def __init__(self, config: FaultyStorageConfig) -> None:
        super().__init__(config)
        self._faulty = config

    def stream_write(self, path: Path) -> Any:
        config = self._faulty
        if config.rank == config.fault_rank and config.fault_in in str(path):
            if config.fault == "slow":
                threading.Event().wait(config.delay_s)  # (a slow device, not a synchronisation)
                return super().stream_write(path)
            if config.fault == "hang":
                (Path(os.environ["HANG_OUT"]) / f"blocked-{config.rank}").write_text(str(os.getpid()))
                NEVER.wait()
            raise OSError(errno.EIO, INJECTED, str(path))
        return super().stream_write(path)
