"""CuPy-owned device buffers filled through cucopy each step and read by JAX through DLPack.

Usage:
    python examples/cupy_jax_prototype.py [--steps 100] [--rows 64] [--cols 128] [--check]
    python examples/cupy_jax_prototype.py --sim [--steps 5] [--check] [--no-jax]   # CPU only

Each step the host builds, in NumPy, a block of values for the ``n`` active rows and
each row's length; a JAX computation produces a weight vector on the GPU. Through
cucopy, all merged into one upload + one scatter at the step's flush:

- ``Site.VALUES`` (H2D): the values into a row-strided view ``values[:n, :m]`` of a CuPy
  buffer (``m`` is the longest row this step);
- ``Site.LENGTHS`` (H2D) and ``Site.LENGTH_PAD`` (FILL, 0 for the unused rows);
- ``Site.WEIGHTS`` (D2D): the JAX array is the source, a CuPy buffer the destination
  (JAX arrays are immutable: they are copy sources only).

JAX then views the three CuPy buffers without a copy (``jax.dlpack.from_dlpack``) and
computes each row's masked weighted sum, ``sum(values[r, :len[r]] * weights[:len[r]])``.
The values are small integers, so the sums are exact in float32 and the result is
compared for equality with a NumPy reference each step; any difference exits 1.

Stream order, with no host synchronization per step: cucopy resolves the JAX source
with the copier's stream, so JAX makes that stream wait for the array to be computed;
``from_dlpack`` is called with the copier's stream as CuPy's current stream, so CuPy
makes JAX's stream wait for the copies. The host reads each step's result before the
next step's uploads, so the next writes never race with JAX's reads.

``--sim`` runs on cucopy's simulated device: the buffers live in simulated device memory
and the same cucopy calls fill them; the JAX weights are computed by JAX on the CPU and
placed on the simulated device as the D2D source (``dev.asarray``, standing in for a JAX
GPU array), and the buffers are read back with ``dev.to_host`` and given to JAX with
``jnp.asarray``. Without JAX installed (or with ``--no-jax``) NumPy computes instead.
``--check`` turns on cucopy's check mode (``cucopy.check.CHECK_MODE = True``).

JAX is imported with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so that it does not take
most of the GPU's memory before CuPy allocates.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# before any import of jax: leave GPU memory to CuPy and the copier
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

if __package__ in (None, ""):  # run as a script: make ``cucopy`` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import cucopy as cc  # noqa: E402
from cucopy import check  # noqa: E402


class Site(cc.CopySite):
    """The prototype's per-step copies."""

    VALUES = cc.H2D
    LENGTHS = cc.H2D
    LENGTH_PAD = cc.FILL
    WEIGHTS = cc.D2D


# JAX reads the buffers only after the step's final flush: every site merges.
PLAN = cc.CopyPlan(merge=set(Site))


@dataclass
class Inputs:
    """One step's host inputs for the ``n`` active rows."""

    n: int
    values: np.ndarray  # [n, m] float32, small integers
    lengths: np.ndarray  # [n] int32, each <= m


def make_inputs(rows: int, cols: int, step: int, seed: int) -> Inputs:
    rng = np.random.default_rng([seed, step])
    n = int(rng.integers(1, rows + 1))
    lengths = rng.integers(0, cols + 1, size=n).astype(np.int32)
    m = max(int(lengths.max()), 1)
    values = rng.integers(-8, 9, size=(n, m)).astype(np.float32)
    return Inputs(n, values, lengths)


def weights_numpy(cols: int, step: int) -> np.ndarray:
    """What the JAX weight function computes, in NumPy."""
    return ((np.arange(cols, dtype=np.int32) * (step + 1)) % 7 - 3).astype(np.float32)


def reference(rows: int, cols: int, inp: Inputs, weights: np.ndarray) -> np.ndarray:
    out = np.zeros(rows, np.float32)
    for r in range(inp.n):
        k = int(inp.lengths[r])
        out[r] = np.sum(inp.values[r, :k] * weights[:k], dtype=np.float32)
    return out


def rowsum_fn(xp):
    """The masked weighted row sum, written once for ``jax.numpy`` and NumPy."""

    def masked_rowsum(values, lengths, weights):
        cols = xp.arange(values.shape[1])
        live = cols[None, :] < lengths[:, None]
        return xp.sum(xp.where(live, values * weights[None, :], 0.0), axis=1)

    return masked_rowsum


def upload(bufs, inp: Inputs, weights_src) -> None:
    """The step's copies, routed through the active copier."""
    values, lengths, weights = bufs
    n, m = inp.n, inp.values.shape[1]
    cc.copy(Site.VALUES, values[:n, :m], inp.values)
    cc.copy(Site.LENGTHS, lengths[:n], inp.lengths)
    cc.fill_tail(Site.LENGTH_PAD, lengths, n, 0)
    cc.copy(Site.WEIGHTS, weights, weights_src)


def load_jax(sim: bool):
    if sim:  # the simulated run never touches a GPU
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    return jax, jnp


def run(args) -> tuple[list[str], object, list[float], str]:
    """Run the loop; returns (errors, copier stats, host us per step, where it ran)."""
    use_jax = not args.no_jax
    jax = jnp = None
    if use_jax:
        try:
            jax, jnp = load_jax(args.sim)
        except ImportError:
            if not args.sim:
                sys.exit("cupy_jax_prototype: JAX is not installed (the GPU run needs it)")
            use_jax = False
    rows, cols = args.rows, args.cols

    if use_jax:
        rowsum = jax.jit(rowsum_fn(jnp))
        weights_fn = jax.jit(
            lambda k: ((jnp.arange(cols, dtype=jnp.int32) * (k + 1)) % 7 - 3).astype(jnp.float32)
        )
    else:
        rowsum = rowsum_fn(np)

    if args.sim:
        from cucopy.backends.sim import SimDevice

        dev = SimDevice(policy=args.sim_policy, seed=args.seed)
        stream = dev.stream("prototype")
        bufs = (
            dev.zeros((rows, cols), np.float32),
            dev.zeros((rows,), np.int32),
            dev.zeros((cols,), np.float32),
        )
        copier = cc.DeviceCopier(plan=PLAN, stream=stream, device=dev, backend="sim")
        where = f"{dev!r}" + (" + JAX on the CPU" if use_jax else " + NumPy (no JAX)")

        def weights_source(step):
            w = np.asarray(weights_fn(jnp.int32(step))) if use_jax else weights_numpy(cols, step)
            return dev.asarray(w)  # stands in for the JAX GPU array (the D2D source)

        def compute(step):
            host = [dev.to_host(b) for b in bufs]  # runs the queued copies
            if use_jax:
                host = [jnp.asarray(h) for h in host]
            return np.asarray(rowsum(*host))

    else:
        try:
            import cupy as cp
        except ImportError:
            sys.exit("cupy_jax_prototype: the GPU run needs CuPy: pip install 'cucopy[cuda13]'")

        try:
            gpu = jax.devices("gpu")[0]
        except RuntimeError as e:
            sys.exit(f"cupy_jax_prototype: JAX has no GPU backend ({e}); use --sim on the CPU")
        ordinal = getattr(gpu, "local_hardware_id", None)
        ordinal = gpu.id if ordinal is None else ordinal
        cp.cuda.Device(ordinal).use()
        stream = cp.cuda.Stream(non_blocking=True)
        bufs = (
            cp.zeros((rows, cols), cp.float32),
            cp.zeros((rows,), cp.int32),
            cp.zeros((cols,), cp.float32),
        )
        cp.cuda.Device(ordinal).synchronize()  # the zeros ran on CuPy's default stream
        copier = cc.DeviceCopier(plan=PLAN, stream=stream, device=ordinal, backend="cuda")
        name = cp.cuda.runtime.getDeviceProperties(ordinal)["name"]
        where = f"{name.decode() if isinstance(name, bytes) else name} ({gpu})"

        def weights_source(step):
            with jax.default_device(gpu):
                return weights_fn(jnp.int32(step))  # a JAX array, computed asynchronously

        def compute(step):
            # CuPy's current stream is the copier's: from_dlpack makes JAX's stream wait on it
            with stream:
                views = [jax.dlpack.from_dlpack(b) for b in bufs]
            return np.asarray(rowsum(*views))  # blocks until JAX is done reading the buffers

    errors, host_us = [], []
    with copier, copier.activate():
        for step in range(args.steps):
            inp = make_inputs(rows, cols, step, args.seed)
            w_src = weights_source(step)  # kept alive until the step's result is read
            t0 = time.perf_counter_ns()
            with copier.step():
                upload(bufs, inp, w_src)
                copier.flush()
            host_us.append((time.perf_counter_ns() - t0) / 1e3)
            got = compute(step)
            want = reference(rows, cols, inp, weights_numpy(cols, step))
            if not np.array_equal(got, want):
                r = int(np.flatnonzero(got != want)[0])
                errors.append(f"step {step}: row {r}: got {got[r]!r}, expected {want[r]!r}")
            del w_src
    return errors, copier.stats, host_us, where


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps (default 100)")
    p.add_argument("--rows", type=int, default=64, help="rows of the value buffer (default 64)")
    p.add_argument("--cols", type=int, default=128, help="columns (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="run with cucopy's check mode on")
    p.add_argument("--sim", action="store_true", help="run on the simulated device (CPU only)")
    p.add_argument(
        "--sim-policy",
        choices=("lazy", "eager", "random"),
        default="random",
        help="when the simulated streams run their work (default random)",
    )
    p.add_argument("--no-jax", action="store_true", help="with --sim: compute with NumPy")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rows < 1 or args.cols < 1:
        p.error("--steps, --rows and --cols must be >= 1")
    if args.no_jax and not args.sim:
        p.error("--no-jax needs --sim (the GPU run reads the buffers through JAX)")
    if args.check:
        check.CHECK_MODE = True

    errors, stats, host_us, where = run(args)
    print(f"cupy_jax_prototype: {args.steps} steps, {args.rows}x{args.cols}, on {where}")
    print(f"  host {statistics.median(host_us):.1f} us/step to stage and flush (median)")
    print(stats)
    if errors:
        for e in errors[:10]:
            print(f"MISMATCH: {e}", file=sys.stderr)
        print(f"MISMATCH: {len(errors)} of {args.steps} steps differ", file=sys.stderr)
        return 1
    print(f"match: {args.steps} steps, masked row sums equal the NumPy reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
