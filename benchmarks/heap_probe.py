"""Where a served model worker's memory grows: Python objects or native memory. Run beside a soak.

    python -m benchmarks.soak --start --clients 30 --minutes 10 --name diag &
    RAY_AUTH_MODE=disabled python -m benchmarks.heap_probe --rounds 5 --interval 100

Connects to the running Ray instance, starts ``tracemalloc`` in the drafter and target actors (through
``__ray_call__``), then every ``--interval`` seconds prints per actor: anonymous RSS (/proc), the Python
allocations traced since the start, the count of gc-tracked objects and their most common types, the live
tensors and their bytes, and the allocation sites that grew most since the first probe. Anonymous RSS
growing while the traced allocations, the object counts and the live tensors stay flat is native memory:
the allocator's retention or a native library's cache, not Python objects kept alive.

To find which native code holds it: preload jemalloc with heap profiling into the model actors
(``pipeline.worker_env_vars: {LD_PRELOAD: libjemalloc.so.2, MALLOC_CONF: "prof:true,lg_prof_sample:20,
prof_prefix:/tmp/jeprof/worker"}``, Debian's libjemalloc2); each probe then also writes a heap profile
(``prof.dump``), and ``jeprof --text --base=<first>.heap $(which python) <last>.heap`` (libjemalloc-dev) lists
the allocation sites of what grew between two probes.
"""

from __future__ import annotations

import argparse
import json
import time


def _start(worker) -> bool:
    import tracemalloc

    tracemalloc.start(8)
    return True


def _jemalloc_dump() -> bool:
    """A jemalloc heap profile of this process (prof_prefix names it); False without jemalloc's profiling."""
    import ctypes

    mallctl = getattr(ctypes.CDLL(None), "mallctl", None)  # present when jemalloc is preloaded
    return mallctl is not None and mallctl(b"prof.dump", None, None, None, 0) == 0


def _probe(worker) -> dict:
    import collections
    import gc
    import os
    import tracemalloc

    import torch

    gc.collect()
    objects = gc.get_objects()
    tensors = [item for item in objects if isinstance(item, torch.Tensor) and not item.is_quantized]
    snapshot = tracemalloc.take_snapshot()
    first = getattr(worker, "_heap_probe_first", None)
    if first is None:
        worker._heap_probe_first = snapshot
    grown = [] if first is None else snapshot.compare_to(first, "traceback")[:4]
    status = dict(line.split(":", 1) for line in open(f"/proc/{os.getpid()}/status").read().splitlines() if ":" in line)
    return {"rss_anon": status["RssAnon"].strip(), "traced_mib": tracemalloc.get_traced_memory()[0] // 2**20,
            "objects": len(objects), "tensors": len(tensors),
            "tensor_mib": sum(item.numel() * item.element_size() for item in tensors) // 2**20,
            "top_types": collections.Counter(type(item).__name__ for item in objects).most_common(8),
            "grown_kib": [(stat.size_diff // 1024, stat.traceback.format()[-2:]) for stat in grown],
            "jemalloc_profile": _jemalloc_dump()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--interval", type=float, default=100.0, help="seconds between probes")
    parser.add_argument("--app", default="hetspec", help="the Serve application's name")
    args = parser.parse_args()
    import ray
    from ray import serve

    ray.init(address="auto", log_to_driver=False)
    handle = serve.get_deployment_handle("HetSpecServer", app_name=args.app)
    actors = handle.actor_handles.remote().result(timeout_s=120)
    ray.get([actor.__ray_call__.remote(_start) for actor in actors.values()])
    for round_index in range(args.rounds):
        if round_index:
            time.sleep(args.interval)
        for role, actor in actors.items():
            print(time.strftime("%H:%M:%S"), role, json.dumps(ray.get(actor.__ray_call__.remote(_probe))), flush=True)


if __name__ == "__main__":
    main()
