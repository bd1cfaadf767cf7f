"""The engine's default CPU thread count: the CPUs this process may actually use.

torch's default is the machine's cores, whatever the process is allowed. In a container
limited to 2 CPUs on a 64-core node that is dozens of OpenMP threads on a 2-CPU quota;
OpenMP threads spin-wait at every fork-join, so the quota is spent spinning and the
process is throttled. Measured on the 2-core machine with the default model, two
replicas on default threads decoded 17.6 tok/s each; on one thread each, 59 tok/s each.

So the default is the smaller of the CPUs in the affinity mask (taskset, cpuset,
Kubernetes' static CPU manager) and the cgroup CPU quota rounded down (docker --cpus,
Kubernetes limits.cpu), never more than torch's own default, at least 1. ``--threads``
overrides it. The kernels' own thresholds keep small work on one thread either way.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cpu_max(directory: Path) -> float | None:
    """A cgroup v2 ``cpu.max`` ("max 100000" or "200000 100000") as CPUs; None = none."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        if quota == "max" or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _cfs_quota(directory: Path) -> float | None:
    """A cgroup v1 CFS quota (cpu.cfs_quota_us / cpu.cfs_period_us) as CPUs; None = none."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


_V1_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def cgroup_cpu_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in CPUs.

    None when there is none (or no cgroup filesystem). Both hierarchies are read: v2
    (``0::/path``, ``cpu.max`` at each level) and v1 (the ``cpu`` controller's line).
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            base, read = root, _cpu_max
        elif "cpu" in controllers.split(","):
            mounts = [root / name for name in _V1_MOUNTS if (root / name).is_dir()]
            if not mounts:
                continue
            base, read = mounts[0], _cfs_quota
        else:
            continue
        # The process's own cgroup and every ancestor up to the mount (inside a container
        # with a private cgroup namespace the path is "/" and the mount is the container's).
        relative = Path(path.strip().lstrip("/"))
        for directory in (base / relative, *(base / p for p in relative.parents)):
            limit = read(directory)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def default_threads(torch_default: int) -> int:
    """torch's default thread count, capped by the CPUs this process may use."""
    return max(1, min(torch_default, available_cpus()))
