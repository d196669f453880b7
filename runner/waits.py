"""OpenMP's wait policy, chosen once at start from how busy the machine is: what torch's idle threads do between
parallel regions. On an idle machine they should spin a moment (libgomp's default): sleeping at once cost digits'
tiny steps 1.40x. On a machine whose cores other processes use, they should sleep at once (PASSIVE): spinning against
that work cost 2.0-2.9x. Chosen so, within 2% of the best of four settings on digits, the SAE and the lm presets,
idle and loaded, but digits loaded (1.13x, where threads=1 wins): benchmarks/threads.py, benchmarks/README.md. OpenMP
reads the policy once, when torch loads it, so this runs before torch is imported: from runner/__init__.py for every
`python -m runner.<tool>`, and runner/__main__.py.

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. The choice and why are kept (`chosen`) for the start table and
run.json. What it cannot see: load that starts after it (a second job launched a minute later); a sweep's parallel
jobs share the cores by their thread counts instead (runner.sweeps.job.threads_per_job).
"""

from __future__ import annotations

import os
import time

USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
chosen: dict[str, str] = {}  # {"policy": ..., "why": ...}, once choose() has run


def _running() -> int | None:
    # processes runnable right now, this one included (Linux's /proc/stat), or None where it cannot be read
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def busy_others(samples: int = 5, gap_s: float = 0.002) -> float | None:
    """How many other processes are running now: the median of a few reads of the runnable count, less this one;
    None where the system does not say (not Linux)."""
    reads = []
    for i in range(samples):
        count = _running()
        if count is None:
            return None
        reads.append(count - 1)
        if i + 1 < samples:
            time.sleep(gap_s)
    return float(sorted(reads)[len(reads) // 2])


def choose(environ: os._Environ | dict[str, str] = os.environ) -> dict[str, str]:
    """Set OMP_WAIT_POLICY in `environ` for this machine's load (unless the user set a policy); what and why."""
    if chosen:
        return chosen
    mine = [key for key in USER_KEYS if key in environ]
    if mine:
        chosen.update(policy=environ.get("OMP_WAIT_POLICY", "default"), why=f"yours ({', '.join(mine)} set)")
        return chosen
    others = busy_others()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if others is None:  # cannot tell: sleeping loses least when wrong (1.37x at worst, against 2.5x)
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        chosen.update(policy="PASSIVE", why="the machine's load is not readable here")
    elif others >= 1:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        chosen.update(policy="PASSIVE", why=f"{others:.0f} other process(es) running on {cores} core(s) at start")
    else:
        chosen.update(policy="default (spin, then sleep)", why=f"no other process running on {cores} core(s) at start")
    return chosen
