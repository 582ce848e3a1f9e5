"""SwapPool: paused tasks' sequence states in host RAM, with optional spill to disk.

The engine saves a sequence with `llama_state_seq_get_data` straight into a buffer the pool
lends (`acquire`), hands it back with `put`, and later gets it again with `take` to restore.
Buffers are reused through a free list: writing into fresh pages costs several times the copy
itself (DEVICE.md measured 7x for a 2.3 GB state). With a GPU the buffers are page-locked
(`pinned`, allocated through torch's CUDA host allocator): device<->host copies then run at PCIe
speed (~55 GB/s measured) instead of 6-14 GB/s. Byte counts are kept as running totals.

Allocating (and, with a GPU, page-locking) a buffer costs far more than the copy: ~0.65 s per GiB on
the H200 machine, 1.5 s for a 32k-token 27B state. `prealloc_bytes` reserves one arena at start;
buffers are then carved out of it (best fit, neighbours merged on release), so pauses never allocate
or register memory. A request the arena cannot hold falls back to an ordinary allocation, counted in
`grown` and logged once.

Page-locked buffers are allocated while the thread is bound to the GPU's local CPUs
(`orchestrator.numa.near_gpu`), so on a host with several sockets their pages land on the GPU's
memory node; `numa_bound` says whether the last allocation was bound, `pages_by_node` where a
buffer's pages are.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from orchestrator import numa

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
        prealloc_bytes: int = 0,
    ):
        self.pinned = pinned  # page-locked buffers (through torch's CUDA allocator): ~55 vs 6-14 GB/s
        self._owners: dict[int, object] = {}  # buffer address -> the torch tensor owning a pinned buffer
        self.grown = 0  # buffers allocated on demand (outside the arena)
        self.numa_bound = False  # whether the last pinned allocation ran bound to the GPU's local CPUs
        self.ram_limit = ram_limit_bytes
        self.min_free_ram = min_free_ram_bytes
        self.spill_dir = spill_dir
        self._entries: dict[int, _Entry] = {}
        self._free: list[np.ndarray] = []
        self.ram_bytes = 0  # bytes of states held in RAM
        self.disk_bytes = 0
        self.free_bytes = 0  # capacity of idle buffers kept for reuse
        # the arena: one block, free ranges (offset, size) sorted by offset, lent ranges by address
        self._arena: np.ndarray | None = None
        self._arena_free: list[tuple[int, int]] = []
        self._arena_lent: dict[int, tuple[int, int]] = {}
        if prealloc_bytes > 0:
            if prealloc_bytes > ram_limit_bytes:
                log.warning(
                    "swap: prealloc of %d MiB is over the RAM limit of %d MiB; reserving the limit",
                    prealloc_bytes >> 20,
                    ram_limit_bytes >> 20,
                )
                prealloc_bytes = ram_limit_bytes
            self._arena = self._allocate(prealloc_bytes)
            self._arena_free = [(0, self._arena.nbytes)]

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def where(self, key: int) -> str:
        return "ram" if self._entries[key].buf is not None else "disk"

    def nbytes(self, key: int) -> int:
        return self._entries[key].nbytes

    @property
    def arena_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.nbytes

    def acquire(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least `nbytes`: from the arena when it has room, else a reused or a
        new buffer."""
        # headroom: a task's next state is a little larger (it has decoded since), and should fit
        capacity = -(-(nbytes + nbytes // 16) // _MIB) * _MIB
        buf = self._arena_take(capacity) if self._arena is not None else None
        if buf is None and self._arena is not None:
            buf = self._arena_take(nbytes)  # no room for the headroom: an exact fit still beats allocating
        if buf is not None:
            return buf
        fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
        if fits:
            best = min(fits, key=lambda i: self._free[i].nbytes)
            buf = self._free.pop(best)
            self.free_bytes -= buf.nbytes
            return buf
        if self._arena is not None and self.grown == 0:
            log.warning(
                "swap: the %d MiB arena is full; allocating %d MiB during a pause (raise swap_prealloc_mb)",
                self.arena_bytes >> 20,
                capacity >> 20,
            )
        self.grown += 1
        return self._allocate(capacity)

    def release(self, buf: np.ndarray) -> None:
        """Give a buffer back: an arena range returns to the arena (merged with free neighbours); a
        standalone buffer goes to the free list, which keeps at most a quarter of the RAM limit."""
        lent = self._arena_lent.pop(buf.ctypes.data, None)
        if lent is not None:
            self._arena_give(*lent)
            return
        if self.free_bytes + buf.nbytes <= self.ram_limit // 4:
            self._free.append(buf)
            self.free_bytes += buf.nbytes
        else:
            self._owners.pop(buf.ctypes.data, None)  # a pinned buffer is unpinned and freed

    def _allocate(self, capacity: int) -> np.ndarray:
        if not self.pinned:
            return np.empty(capacity, dtype=np.uint8)
        import torch

        with numa.near_gpu() as bound:
            owner = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.numa_bound = bound
        buf = owner.numpy()
        self._owners[buf.ctypes.data] = owner
        return buf

    def pages_by_node(self, buf: np.ndarray | None = None) -> dict[int, int]:
        """{NUMA node: pages} of `buf`'s mapping (default: the arena), when the buffer starts one."""
        buf = self._arena if buf is None else buf
        return {} if buf is None else numa.pages_by_node(buf.ctypes.data)

    def _arena_take(self, size: int) -> np.ndarray | None:
        """The smallest free range that holds `size` (4 KiB aligned, never empty: lent ranges are keyed
        by their address), or None."""
        size = max(4096, -(-size // 4096) * 4096)
        fits = [i for i, (_, n) in enumerate(self._arena_free) if n >= size]
        if not fits:
            return None
        i = min(fits, key=lambda j: self._arena_free[j][1])
        off, n = self._arena_free[i]
        if n == size:
            del self._arena_free[i]
        else:
            self._arena_free[i] = (off + size, n - size)
        buf = self._arena[off : off + size]
        self._arena_lent[buf.ctypes.data] = (off, size)
        return buf

    def _arena_give(self, off: int, size: int) -> None:
        free = self._arena_free
        at = next((i for i, (o, _) in enumerate(free) if o > off), len(free))
        free.insert(at, (off, size))
        if at + 1 < len(free) and free[at][0] + free[at][1] == free[at + 1][0]:  # merge the right one
            free[at] = (free[at][0], free[at][1] + free[at + 1][1])
            del free[at + 1]
        if at > 0 and free[at - 1][0] + free[at - 1][1] == free[at][0]:  # merge into the left one
            free[at - 1] = (free[at - 1][0], free[at - 1][1] + free[at][1])
            del free[at]

    def put(self, key: int, buf: np.ndarray, nbytes: int) -> str:
        """Store `buf[:nbytes]` as the state of `key`; returns "ram" or "disk". Raises SwapFull."""
        if key in self._entries:
            raise KeyError(f"task {key} already has a swapped state")
        if self._ram_ok(buf):
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
        self._arena, self._arena_free, self._arena_lent = None, [], {}

    def _ram_ok(self, buf: np.ndarray) -> bool:
        if self.ram_bytes + buf.nbytes > self.ram_limit:
            return False
        if buf.ctypes.data in self._arena_lent:
            return True  # reserved at start: holding it takes no more memory
        return psutil.virtual_memory().available - buf.nbytes >= self.min_free_ram

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
