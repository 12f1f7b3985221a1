"""How much RAM this machine has free: what the CPU memory decisions (engine.memory_plan, engine.backends.cpu) read."""

from __future__ import annotations

import os


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else the physical RAM; None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
