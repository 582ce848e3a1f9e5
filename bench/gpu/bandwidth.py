#!/usr/bin/env python3
"""The GPU's copy bandwidths, for the ceilings of bench/gpu/side_by_side.sh: a 4 GiB device-to-device
copy (bytes read + written, TB/s) and 2 GiB page-locked host<->device copies (GB/s), medians of 10
timed with CUDA events. Prints one JSON line."""

import json

import torch


def median_s(fn, n: int = 10) -> float:
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return sorted(times)[n // 2]


def main() -> None:
    n = 4 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    x.random_(0, 255)  # never time zeros
    y.copy_(x)
    d2d = 2 * n / median_s(lambda: y.copy_(x)) / 1e12
    h = torch.empty(n // 2, dtype=torch.uint8, pin_memory=True)
    z = x[: n // 2]
    h2d = (n // 2) / median_s(lambda: z.copy_(h, non_blocking=True)) / 1e9
    d2h = (n // 2) / median_s(lambda: h.copy_(z, non_blocking=True)) / 1e9
    print(
        json.dumps(
            {
                "kind": "bandwidth",
                "copy_bw_tb_s": round(d2d, 3),
                "pinned_h2d_gb_s": round(h2d, 1),
                "pinned_d2h_gb_s": round(d2h, 1),
                "gpu": torch.cuda.get_device_name(),
            }
        )
    )


if __name__ == "__main__":
    main()
