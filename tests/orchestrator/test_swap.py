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
