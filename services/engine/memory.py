"""How much memory a device has free: what the KV cache may take (every rank asks the same way)."""
from __future__ import annotations

import os

import torch


def free_memory(device: torch.device) -> int:
    """Bytes free on `device`: the CUDA allocator's free memory, or the host's available memory
    (MemAvailable) on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
