"""Page-locked host memory next to the GPU: the CPUs of the GPU's NUMA node, and where pages landed.

On a host with several CPU sockets a page-locked buffer lives on the memory node of the CPU whose
thread allocated it; device<->host copies from the other socket's memory cross the socket link and
run slower. The swap pool allocates its buffers while its thread is bound to the GPU's local CPUs
(`near_gpu`), so the pages land on the GPU's node. Where the information is missing (no sysfs, no
CUDA device, one node) nothing changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

SYSFS = Path("/sys")


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}. Raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"cpu list range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus


def cuda_pci_bus_id(device: int = 0) -> str | None:
    """The PCI address ('0000:1b:00.0') of CUDA device `device` (torch's numbering, which follows
    CUDA_VISIBLE_DEVICES), or None without torch, CUDA or the fields."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(device)
        bus, dev, dom = (getattr(p, k, None) for k in ("pci_bus_id", "pci_device_id", "pci_domain_id"))
    except Exception as e:  # any failure means: no placement information
        log.debug("numa: no PCI address for CUDA device %d: %s", device, e)
        return None
    if bus is None or dev is None or dom is None:
        return None
    return f"{dom:04x}:{bus:02x}:{dev:02x}.0"


def device_node(pci: str, sysfs: Path = SYSFS) -> tuple[int | None, set[int] | None]:
    """(NUMA node, local CPUs) of the PCI device at address `pci` from sysfs; None where unknown
    (a node of -1 means the platform does not say)."""
    d = sysfs / "bus" / "pci" / "devices" / pci.lower()
    node: int | None = None
    cpus: set[int] | None = None
    with contextlib.suppress(OSError, ValueError):
        node = int((d / "numa_node").read_text().strip())
        if node < 0:
            node = None
    with contextlib.suppress(OSError, ValueError):
        cpus = parse_cpulist((d / "local_cpulist").read_text()) or None
    return node, cpus


@contextlib.contextmanager
def bound_to(cpus: set[int] | None) -> Iterator[bool]:
    """Run the block with this thread bound to `cpus` (those of them it may use), then restore its
    affinity. Yields whether it bound: not without `cpus`, without sched_setaffinity, when none of
    them is allowed, or when the thread may already run only there."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield False
        return
    old = os.sched_getaffinity(0)
    target = cpus & old
    if not target or target == old:
        yield False
        return
    try:
        os.sched_setaffinity(0, target)
    except OSError as e:
        log.debug("numa: cannot bind to %d CPUs: %s", len(target), e)
        yield False
        return
    try:
        yield True
    finally:
        os.sched_setaffinity(0, old)


def gpu_node(device: int = 0, sysfs: Path = SYSFS) -> tuple[str | None, int | None, set[int] | None]:
    """(PCI address, NUMA node, local CPUs) of CUDA device `device`; None where unknown."""
    pci = cuda_pci_bus_id(device)
    return (pci, *device_node(pci, sysfs)) if pci else (None, None, None)


def describe(device: int = 0, sysfs: Path = SYSFS) -> dict:
    """The host's NUMA nodes, CUDA device `device`'s address, node and local CPUs (those this process
    may use), and how many CPUs it may use: for benchmark records."""
    online = ""
    with contextlib.suppress(OSError):
        online = (sysfs / "devices" / "system" / "node" / "online").read_text().strip()
    pci, node, cpus = gpu_node(device, sysfs)
    allowed = os.sched_getaffinity(0)
    return {"nodes_online": online, "gpu_pci": pci, "gpu_node": node,
            "gpu_local_cpus": len(cpus & allowed) if cpus else None,
            "allowed_cpus": len(allowed)}  # fmt: skip


def near_gpu(device: int = 0, sysfs: Path = SYSFS):
    """`bound_to` the local CPUs of CUDA device `device` (a no-op context where unknown)."""
    return bound_to(gpu_node(device, sysfs)[2])


_NODE_PAGES = re.compile(r"\bN(\d+)=(\d+)")


def pages_by_node(address: int, numa_maps: str | None = None) -> dict[int, int]:
    """{node: pages} of the mapping that starts at `address`, from /proc/self/numa_maps (or the given
    text); {} when the mapping is not listed or the file cannot be read."""
    if numa_maps is None:
        try:
            numa_maps = Path("/proc/self/numa_maps").read_text()
        except OSError:
            return {}
    for line in numa_maps.splitlines():
        start, _, rest = line.partition(" ")
        try:
            if int(start, 16) != address:
                continue
        except ValueError:
            continue
        return {int(n): int(p) for n, p in _NODE_PAGES.findall(rest)}
    return {}
