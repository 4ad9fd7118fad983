"""Is the lent host's slow spell a matter of time or of the CPU the bench runs on?

Usage:
    python bench/probes/host_cpus.py [--rounds 4] [--steps 60] [--json PATH]

Question: the lent GPU host runs chained ``copy_`` at 3.5 µs a copy in one run and
6.4-7.6 in another, and within one run a whole stretch can be slow (run 41: every
contender of N = 8, timed first, ran 1.4-1.6x slower than at N = 32). A Firecracker
machine's vCPUs may sit on different host cores, or NUMA nodes, than the GPU's. This
pins the main thread to each CPU the process may use in turn (``os.sched_setaffinity``
on the calling thread; the driver's own threads keep theirs) and times, on each, a
step of 32 chained torch ``copy_(non_blocking=True)`` from pinned tensors and a
32-copy cucopy ``auto`` step, each after a drained stream; ``--rounds`` rounds over
the CPUs, the order reversed every other round, so a CPU that is always slow differs
from a spell that passes. Prints the GPU's PCI address, its NUMA node and local
CPUs (from sysfs), then per CPU the median µs a step of each round. Host time only.
Answer: ``host_cpus.log`` in the first ``bench/results/`` run with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

N = 32


def _sysfs(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _topology() -> dict:
    """The GPU's PCI address, NUMA node and local CPUs, and the machine's NUMA nodes."""
    import cupy

    bus = cupy.cuda.runtime.deviceGetPCIBusId(0).lower()
    dev = f"/sys/bus/pci/devices/{bus}"
    nodes = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        nodes[d.name] = _sysfs(f"{d}/cpulist")
    return {
        "gpu_pci": bus,
        "gpu_numa_node": _sysfs(f"{dev}/numa_node"),
        "gpu_local_cpulist": _sysfs(f"{dev}/local_cpulist"),
        "numa_nodes": nodes,
        "affinity": sorted(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
    }


def _median_us(step, sync, steps: int) -> float:
    out = []
    for i in range(steps + 5):
        sync()
        t0 = time.perf_counter_ns()
        step()
        t1 = time.perf_counter_ns()
        if i >= 5:
            out.append((t1 - t0) / 1e3)
    sync()
    return statistics.median(out)


def main(argv=None) -> int:
    """Run the probe; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args(argv)
    import torch

    import cucopy as cc

    topo = _topology()
    print(json.dumps(topo))
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    rng = np.random.default_rng(0)
    sizes = rng.choice([4, 16, 64, 256, 1024], size=N)
    srcs = [rng.integers(0, 9, int(k), dtype=np.int32) for k in sizes]
    dsts = [torch.zeros(int(k), dtype=torch.int32, device="cuda") for k in sizes]
    pinned = [torch.from_numpy(x).pin_memory() for x in srcs]
    site = cc.CopySite("Cpu", [("s", cc.H2D)])
    copier = cc.DeviceCopier(cc.CopyPlan(merge=set(site)), stream=stream)
    pairs = list(zip(dsts, pinned))
    triples = [(site.s, d, x) for d, x in zip(dsts, srcs)]

    def chain():
        for d, x in pairs:
            d.copy_(x, non_blocking=True)

    def merged():
        copy = copier.copy
        with copier.step():
            for s, d, x in triples:
                copy(s, d, x)

    sync = stream.synchronize
    cpus = topo["affinity"]
    rows: dict = {c: {"chain": [], "cucopy": []} for c in cpus}
    try:
        for r in range(args.rounds):
            for cpu in cpus if r % 2 == 0 else cpus[::-1]:
                os.sched_setaffinity(0, {cpu})
                rows[cpu]["chain"].append(_median_us(chain, sync, args.steps))
                rows[cpu]["cucopy"].append(_median_us(merged, sync, args.steps))
    finally:
        os.sched_setaffinity(0, set(cpus))
        copier.close()
    print(f"N={N}: median host us a step per round (chained copy_ | cucopy auto), by CPU")
    for cpu in cpus:
        ch = " ".join(f"{x:6.1f}" for x in rows[cpu]["chain"])
        cu = " ".join(f"{x:5.1f}" for x in rows[cpu]["cucopy"])
        print(f"  cpu {cpu:3d}: {ch} | {cu}")
    if args.json:
        Path(args.json).write_text(json.dumps({"topology": topo, "n": N, "by_cpu": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
