"""Peak resident memory of a piece of work on Linux, for CPU benchmarks (torch has no CPU memory statistics).

`reset_peak()` sets the high-water mark VmHWM to the current resident size (writing 5 to /proc/self/clear_refs);
after the work, `peak_kb() - resident_before` is what the work allocated at its peak. Where clear_refs cannot be
written, ru_maxrss (the process's lifetime peak) is the fallback, so measure one thing per fresh process.
"""

import os
import re
import resource


def resident_kb() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current resident size (Linux ≥ 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_kb(use_hwm: bool) -> int:
    if use_hwm:
        with open("/proc/self/status") as status:
            return int(re.search(r"VmHWM:\s+(\d+)", status.read()).group(1))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
