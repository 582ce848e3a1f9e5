"""SwapPool: paused tasks' sequence states in host RAM, with optional spill to disk.

The engine saves a sequence with `llama_state_seq_get_data` straight into a buffer the pool
lends (`acquire`), hands it back with `put`, and later gets it again with `take` to restore.
Buffers are reused through a free list: writing into fresh pages costs several times the copy
itself (DEVICE.md measured 7x for a 2.3 GB state). With a GPU the buffers are page-locked
(`pinned`, allocated through torch's CUDA host allocator): device<->host copies then run at PCIe
speed (~55 GB/s measured) instead of 6-14 GB/s. Byte counts are kept as running totals.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

log = logging.getLogger(__name__)
_MIB = 1 << 20


class SwapFull(RuntimeError):
    """Neither RAM (within its limit) nor the spill folder can take a state."""


@dataclass
class _Entry:
    nbytes: int
    buf: np.ndarray | None  # in RAM, or None when spilled
    path: Path | None = None  # on disk when spilled


class SwapPool:
    """Host store of task states keyed by task id.

    ram_limit_bytes: most bytes of stored states kept in RAM (idle reusable buffers not counted);
    min_free_ram_bytes: spill rather than leave the machine with less free memory than this;
    spill_dir: where states go when RAM is short (None: no spilling, SwapFull instead).
    """

    def __init__(
        self,
        ram_limit_bytes: int,
        spill_dir: Path | None = None,
        min_free_ram_bytes: int = 512 << 20,
        pinned: bool = False,
    ):
        self.pinned = pinned  # page-locked buffers (through torch's CUDA allocator): ~55 vs 6-14 GB/s
        self._owners: dict[int, object] = {}  # buffer address -> the torch tensor owning a pinned buffer
        self.ram_limit = ram_limit_bytes
        self.min_free_ram = min_free_ram_bytes
        self.spill_dir = spill_dir
        self._entries: dict[int, _Entry] = {}
        self._free: list[np.ndarray] = []
        self.ram_bytes = 0  # bytes of states held in RAM
        self.disk_bytes = 0
        self.free_bytes = 0  # capacity of idle buffers kept for reuse

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def where(self, key: int) -> str:
        return "ram" if self._entries[key].buf is not None else "disk"

    def nbytes(self, key: int) -> int:
        return self._entries[key].nbytes

    def acquire(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least `nbytes` (a reused one when one is big enough)."""
        fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
        if fits:
            best = min(fits, key=lambda i: self._free[i].nbytes)
            buf = self._free.pop(best)
            self.free_bytes -= buf.nbytes
            return buf
        # headroom: a task's next state is a little larger (it has decoded since), and should fit
        capacity = -(-(nbytes + nbytes // 16) // _MIB) * _MIB
        if not self.pinned:
            return np.empty(capacity, dtype=np.uint8)
        import torch

        owner = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        buf = owner.numpy()
        self._owners[buf.ctypes.data] = owner
        return buf

    def release(self, buf: np.ndarray) -> None:
        """Give a buffer back for reuse; the free list keeps at most a quarter of the RAM limit."""
        if self.free_bytes + buf.nbytes <= self.ram_limit // 4:
            self._free.append(buf)
            self.free_bytes += buf.nbytes
        else:
            self._owners.pop(buf.ctypes.data, None)  # a pinned buffer is unpinned and freed

    def put(self, key: int, buf: np.ndarray, nbytes: int) -> str:
        """Store `buf[:nbytes]` as the state of `key`; returns "ram" or "disk". Raises SwapFull."""
        if key in self._entries:
            raise KeyError(f"task {key} already has a swapped state")
        if self._ram_ok(buf.nbytes):
            self._entries[key] = _Entry(nbytes, buf)
            self.ram_bytes += buf.nbytes
            return "ram"
        path = self._spill(key, buf, nbytes)
        self.release(buf)
        self._entries[key] = _Entry(nbytes, None, path)
        self.disk_bytes += nbytes
        return "disk"

    def take(self, key: int) -> tuple[np.ndarray, int]:
        """Remove and return (buffer, nbytes) of `key`; give the buffer back with `release`."""
        entry = self._entries.pop(key)
        if entry.buf is not None:
            self.ram_bytes -= entry.buf.nbytes
            return entry.buf, entry.nbytes
        buf = self.acquire(entry.nbytes)
        with open(entry.path, "rb") as f:
            f.readinto(memoryview(buf)[: entry.nbytes])
        entry.path.unlink(missing_ok=True)
        self.disk_bytes -= entry.nbytes
        return buf, entry.nbytes

    def drop(self, key: int) -> None:
        """Forget `key`'s state (a cancelled task, an evicted cached session)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        if entry.buf is not None:
            self.ram_bytes -= entry.buf.nbytes
            self.release(entry.buf)
        else:
            entry.path.unlink(missing_ok=True)
            self.disk_bytes -= entry.nbytes

    def close(self) -> None:
        for key in list(self._entries):
            self.drop(key)
        self._free.clear()
        self._owners.clear()
        self.free_bytes = 0

    def _ram_ok(self, nbytes: int) -> bool:
        if self.ram_bytes + nbytes > self.ram_limit:
            return False
        return psutil.virtual_memory().available - nbytes >= self.min_free_ram

    def _spill(self, key: int, buf: np.ndarray, nbytes: int) -> Path:
        if self.spill_dir is None:
            raise SwapFull(f"swap RAM limit of {self.ram_limit} bytes reached and no spill folder is set")
        path = self.spill_dir / f"task-{key}-{os.getpid()}.state"
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(memoryview(buf)[:nbytes])
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise SwapFull(f"cannot spill {nbytes} bytes to {self.spill_dir}: {exc.strerror}") from None
        log.info("swap: task %d spilled to disk (%d bytes)", key, nbytes)
        return path
