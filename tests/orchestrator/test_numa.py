"""orchestrator.numa: the GPU's local CPUs from sysfs, binding a thread to them, where pages landed;
and the swap pool allocating its page-locked buffers under that binding."""

from __future__ import annotations

import os

import pytest

from orchestrator import numa
from orchestrator.swap import SwapPool


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("5") == {5}
    assert numa.parse_cpulist("") == set()
    with pytest.raises(ValueError):
        numa.parse_cpulist("4-2")
    with pytest.raises(ValueError):
        numa.parse_cpulist("a-b")


def _fake_sysfs(root, pci, node, cpulist):
    d = root / "bus" / "pci" / "devices" / pci
    d.mkdir(parents=True)
    (d / "numa_node").write_text(f"{node}\n")
    (d / "local_cpulist").write_text(cpulist + "\n")
    return root


def test_device_node_reads_sysfs(tmp_path):
    sysfs = _fake_sysfs(tmp_path, "0000:1b:00.0", 1, "16-31,48-63")
    node, cpus = numa.device_node("0000:1B:00.0", sysfs)
    assert node == 1 and cpus == set(range(16, 32)) | set(range(48, 64))
    # unknown device, or a platform that does not say: nothing
    assert numa.device_node("0000:ff:00.0", sysfs) == (None, None)
    sysfs2 = _fake_sysfs(tmp_path / "b", "0000:01:00.0", -1, "")
    assert numa.device_node("0000:01:00.0", sysfs2) == (None, None)


def test_bound_to_binds_and_restores():
    old = os.sched_getaffinity(0)
    one = {min(old)}
    with numa.bound_to(one) as bound:
        assert bound == (one != old)
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == old
    # CPUs this thread may not use, or none: no change
    with numa.bound_to({max(old) + 4096}) as bound:
        assert not bound and os.sched_getaffinity(0) == old
    with numa.bound_to(None) as bound:
        assert not bound
    # restored when the block raises
    with pytest.raises(RuntimeError), numa.bound_to(one):
        raise RuntimeError("boom")
    assert os.sched_getaffinity(0) == old


def test_near_gpu_without_cuda_is_a_no_op():
    old = os.sched_getaffinity(0)
    with numa.near_gpu() as bound:  # the CPU torch of this machine has no CUDA device
        assert not bound and os.sched_getaffinity(0) == old


def test_pages_by_node_parses_numa_maps():
    text = (
        "7f0000000000 default anon=10 dirty=10 N0=4 N1=6 kernelpagesize_kB=4\n"
        "7f0000200000 bind:1 anon=3 N1=3 kernelpagesize_kB=4\n"
    )
    assert numa.pages_by_node(0x7F0000000000, text) == {0: 4, 1: 6}
    assert numa.pages_by_node(0x7F0000200000, text) == {1: 3}
    assert numa.pages_by_node(0x1234, text) == {}
    # this process's own file: a fresh mapping of touched pages is found on some node
    import mmap

    m = mmap.mmap(-1, 1 << 20)
    m.write(b"x" * (1 << 20))
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    pages = numa.pages_by_node(addr)
    assert sum(pages.values()) == 256
    del pages
    m.close()


def test_pool_allocates_pinned_buffers_bound_to_the_gpu_cpus(monkeypatch):
    # the pinned path with torch's CPU allocator standing in for pin_memory (as test_swap does), and
    # a GPU whose local CPUs are this thread's first allowed CPU: the allocation runs bound there
    import torch

    old = os.sched_getaffinity(0)
    local = {min(old)}
    seen = []
    real_empty = torch.empty

    def fake_empty(n, dtype, pin_memory=False):
        seen.append(os.sched_getaffinity(0))
        return real_empty(n, dtype=dtype)

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(numa, "near_gpu", lambda device=0: numa.bound_to(local))
    pool = SwapPool(ram_limit_bytes=64 << 20, pinned=True, prealloc_bytes=8 << 20)
    assert seen == [local] and os.sched_getaffinity(0) == old
    assert pool.numa_bound == (local != old)
    pool.close()


def test_describe_without_cuda(tmp_path):
    (tmp_path / "devices" / "system" / "node").mkdir(parents=True)
    (tmp_path / "devices" / "system" / "node" / "online").write_text("0-1\n")
    got = numa.describe(0, tmp_path)  # the CPU torch of this machine has no CUDA device
    assert got == {"nodes_online": "0-1", "gpu_pci": None, "gpu_node": None, "gpu_local_cpus": None,
                   "allowed_cpus": len(os.sched_getaffinity(0))}  # fmt: skip
    assert numa.gpu_node(0, tmp_path) == (None, None, None)
