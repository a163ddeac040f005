"""Small helpers shared by the GPU scripts: memory bandwidth and CUDA timing."""

from __future__ import annotations

import torch

# Peak HBM bandwidth from the vendors' data sheets, bytes/s (matched on the device name).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                  "A100-SXM4-80GB": 2.04e12, "A100": 1.56e12, "L40S": 0.864e12, "L4": 0.3e12}  # fmt: skip


def peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, where it came from): the data-sheet number if the card is known, else a measured copy."""
    name = torch.cuda.get_device_name(device)
    for key, bw in PEAK_BANDWIDTH.items():
        if key in name:
            return bw, f"data sheet ({key})"
    return measured_copy_bandwidth(device), "measured device-to-device copy"


def measured_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes moved per second by a large tensor copy (read + write), a practical upper bound."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / seconds


def cuda_time(fn, iters: int = 100, warmup: int = 10) -> float:
    """Mean seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters
