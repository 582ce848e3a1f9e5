"""SwapPool alone: byte counts, buffer reuse, RAM limit, spill to disk, nothing lost."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.swap import SwapFull, SwapPool


def _state(pool: SwapPool, n: int, fill: int) -> np.ndarray:
    buf = pool.acquire(n)
    buf[:n] = fill
    return buf


def test_put_take_round_trip_and_running_counts():
    pool = SwapPool(ram_limit_bytes=4 << 20)
    pool.put(1, _state(pool, 1000, 7), 1000)
    pool.put(2, _state(pool, 3000, 9), 3000)
    mib = 1 << 20  # buffers are whole MiB with headroom
    assert pool.ram_bytes == 2 * mib and pool.disk_bytes == 0 and len(pool) == 2
    buf, n = pool.take(1)
    assert n == 1000 and (buf[:n] == 7).all()
    assert pool.ram_bytes == mib and 1 not in pool
    pool.release(buf)
    assert pool.free_bytes == mib


def test_released_buffers_are_reused_even_for_a_slightly_larger_state():
    pool = SwapPool(ram_limit_bytes=64 << 20)
    first = pool.acquire(3_000_000)
    pool.release(first)
    again = pool.acquire(3_000_000 + 6_000)  # the same task, a few tokens later
    assert again is first and pool.free_bytes == 0


def test_over_the_ram_limit_states_spill_to_disk_and_come_back_intact(tmp_path):
    pool = SwapPool(ram_limit_bytes=1 << 20, spill_dir=tmp_path, min_free_ram_bytes=0)
    pool.put(1, _state(pool, 3000, 1), 3000)
    assert pool.put(2, _state(pool, 3000, 2), 3000) == "disk"
    assert pool.where(1) == "ram" and pool.where(2) == "disk"
    assert pool.ram_bytes == 1 << 20 and pool.disk_bytes == 3000
    buf, n = pool.take(2)
    assert n == 3000 and (buf[:n] == 2).all()
    assert pool.disk_bytes == 0 and not list(tmp_path.iterdir())


def test_without_a_spill_folder_a_full_pool_refuses_and_keeps_what_it_has():
    pool = SwapPool(ram_limit_bytes=1 << 20, spill_dir=None, min_free_ram_bytes=0)
    pool.put(1, _state(pool, 3000, 1), 3000)
    with pytest.raises(SwapFull, match="RAM limit of 1048576 bytes"):
        pool.put(2, _state(pool, 3000, 2), 3000)
    buf, _ = pool.take(1)
    assert (buf[:3000] == 1).all()


def test_unwritable_spill_folder_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    pool = SwapPool(ram_limit_bytes=0, spill_dir=blocker / "swap", min_free_ram_bytes=0)
    with pytest.raises(SwapFull, match="cannot spill 100 bytes"):
        pool.put(1, _state(pool, 100, 1), 100)


def test_drop_and_close_release_everything(tmp_path):
    pool = SwapPool(ram_limit_bytes=1 << 20, spill_dir=tmp_path, min_free_ram_bytes=0)
    pool.put(1, _state(pool, 1500, 1), 1500)
    pool.put(2, _state(pool, 1500, 2), 1500)  # spills
    pool.drop(2)
    assert pool.disk_bytes == 0 and not list(tmp_path.iterdir())
    pool.close()
    assert pool.ram_bytes == 0 and len(pool) == 0


def test_a_key_cannot_be_stored_twice():
    pool = SwapPool(ram_limit_bytes=1 << 20)
    pool.put(1, _state(pool, 10, 1), 10)
    with pytest.raises(KeyError, match="already has"):
        pool.put(1, _state(pool, 10, 1), 10)


def test_pinned_buffers_round_trip_where_torch_can_pin(monkeypatch):
    # On this CPU machine torch cannot pin: the engine asks for pinned buffers only on CUDA builds;
    # the pool's pinned path is exercised with torch's CPU allocator standing in for pin_memory.
    import torch

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, dtype, pin_memory=False: real_empty(n, dtype=dtype))
    pool = SwapPool(ram_limit_bytes=64 << 20, pinned=True)
    buf = _state(pool, 3_000_000, 5)
    pool.put(1, buf, 3_000_000)
    got, n = pool.take(1)
    assert (got[:n] == 5).all() and len(pool._owners) == 1
    pool.release(got)
    assert pool.acquire(3_000_000) is got  # reused, still owned by its tensor
    pool.close()
    assert pool._owners == {}


# ---- the arena reserved at start (swap_prealloc_mb) ----


def test_arena_serves_pauses_without_allocating():
    pool = SwapPool(ram_limit_bytes=64 << 20, prealloc_bytes=16 << 20)
    assert pool.arena_bytes == 16 << 20
    for round_ in range(20):  # tasks of different sizes pausing and resuming, over and over
        sizes = [(1_000_000 + 37_000 * round_) * (1 + k) for k in range(3)]
        for key, n in enumerate(sizes):
            buf = _state(pool, n, key + round_)
            assert np.shares_memory(buf, pool._arena)
            pool.put(key, buf, n)
        for key, n in enumerate(sizes):
            buf, got = pool.take(key)
            assert got == n and (buf[:n] == key + round_).all()
            pool.release(buf)
    assert pool.grown == 0
    assert pool._arena_free == [(0, 16 << 20)]  # every range merged back


def test_arena_ranges_never_overlap_and_freed_neighbours_merge():
    pool = SwapPool(ram_limit_bytes=64 << 20, prealloc_bytes=12 << 20)
    a, b, c = (pool.acquire(3 << 20) for _ in range(3))  # 4 MiB each with headroom: the arena is full
    for fill, buf in enumerate((a, b, c), start=1):
        buf[:] = fill
    assert (a == 1).all() and (b == 2).all() and (c == 3).all()
    pool.release(b)
    pool.release(a)  # a and b are neighbours: one 8 MiB range
    big = pool.acquire(7 << 20)
    assert np.shares_memory(big, pool._arena) and pool.grown == 0 and (c == 3).all()
    pool.release(big)
    pool.release(c)
    assert pool._arena_free == [(0, 12 << 20)]


def test_a_state_larger_than_the_arena_is_allocated_and_counted():
    pool = SwapPool(ram_limit_bytes=64 << 20, prealloc_bytes=4 << 20)
    buf = _state(pool, 8 << 20, 4)
    assert not np.shares_memory(buf, pool._arena) and pool.grown == 1
    pool.put(1, buf, 8 << 20)
    got, n = pool.take(1)
    assert (got[:n] == 4).all()


def test_a_prealloc_over_the_ram_limit_reserves_the_limit():
    pool = SwapPool(ram_limit_bytes=8 << 20, prealloc_bytes=64 << 20)
    assert pool.arena_bytes == 8 << 20


def test_an_arena_state_still_obeys_the_ram_limit(tmp_path):
    pool = SwapPool(ram_limit_bytes=6 << 20, spill_dir=tmp_path, min_free_ram_bytes=0, prealloc_bytes=6 << 20)
    pool.put(1, _state(pool, 3_000_000, 1), 3_000_000)  # 4 MiB with headroom: in RAM
    assert pool.put(2, _state(pool, 1_500_000, 2), 1_500_000) == "ram"  # 2 MiB: exactly the limit
    assert pool.put(3, _state(pool, 10_000, 3), 10_000) == "disk"  # over the limit: spilled, not lost
    for key, fill, n in ((1, 1, 3_000_000), (2, 2, 1_500_000), (3, 3, 10_000)):
        buf, got = pool.take(key)
        assert got == n and (buf[:n] == fill).all()
        pool.release(buf)


def test_an_empty_state_gets_its_own_arena_range():
    pool = SwapPool(ram_limit_bytes=64 << 20, prealloc_bytes=8 << 20)
    empty = pool.acquire(0)
    full = pool.acquire(1 << 20)
    assert empty.nbytes >= 4096 and not np.shares_memory(empty, full)
    pool.release(empty)
    pool.release(full)
    assert pool._arena_free == [(0, 8 << 20)]
