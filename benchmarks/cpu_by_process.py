"""Where a serving run's CPU time goes, by process: the model actors, the coordinator replica, the proxies, Ray's
own daemons and the benchmark's clients.

On a machine of few cores every process of the server shares the cores the target's passes run on, so a
slower server than transformers' ``generate`` in one process can be CPU spent outside the passes. A snapshot
of every process's CPU times (psutil) before and after a level; the difference, grouped by what the process
is (a Ray worker's title names its actor: ``ray::ServeReplica:hetspec:Coordinator``, ``ray::TargetWorker``).
"""

from __future__ import annotations

import os
import re
from collections import Counter

import psutil

Snapshot = dict[int, tuple[str, float]]  # pid -> (group, user + system CPU seconds so far)


def _group(process: psutil.Process) -> str:
    if process.pid == os.getpid():
        return "benchmark clients"
    command = " ".join(process.cmdline()) or process.name()
    if command.startswith("ray::"):  # a Ray worker's title: ray::<actor class>[.<method>]
        return re.split(r"[ .]", command, maxsplit=1)[0]
    for daemon in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env_agent"):
        if daemon in command:
            return daemon
    return process.name()


def snapshot() -> Snapshot:
    taken: Snapshot = {}
    for process in psutil.process_iter():
        try:
            times = process.cpu_times()
            taken[process.pid] = (_group(process), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return taken


def spent(before: Snapshot, after: Snapshot, wall_seconds: float) -> dict:
    """CPU seconds per group between two snapshots (a process started meanwhile counts from 0), with their share of
    what the machine's cores could give in ``wall_seconds``."""
    by_group: Counter = Counter()
    for pid, (group, seconds) in after.items():
        by_group[group] += seconds - before.get(pid, (group, 0.0))[1]
    cores = psutil.cpu_count() or 1
    capacity = wall_seconds * cores
    groups = {group: {"cpu_seconds": round(seconds, 2), "share": round(seconds / capacity, 4)}
              for group, seconds in by_group.most_common() if seconds >= 0.05}
    return {"cores": cores, "wall_seconds": wall_seconds, "cpu_seconds": round(sum(by_group.values()), 2),
            "busy_share": round(sum(by_group.values()) / capacity, 4), "groups": groups}
