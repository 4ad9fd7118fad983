"""Where the torch example's cucopy host time goes (examples/torch_decode_loop.py uploads).

Usage: python bench/profile_example.py [--steps 400]. Needs torch with CUDA and CuPy.
Prints the per-call cost of each upload call of one step and a cProfile of whole
steps (``copier.step()`` + the uploads + ``flush()``), sorted by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import cucopy as cc  # noqa: E402


def _example():
    spec = importlib.util.spec_from_file_location("ex", ROOT / "examples" / "torch_decode_loop.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ex"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args(argv)
    import torch

    ex = _example()
    shape = ex.Shape(batch=32)
    dev = torch.device("cuda", torch.cuda.current_device())
    bufs = ex.Buffers(shape, lambda size: torch.empty(size, dtype=torch.int32, device=dev))
    inputs = [ex.make_inputs(shape, s, 0) for s in range(64)]
    stream = torch.cuda.Stream(dev)
    with cc.DeviceCopier(plan=ex.PLAN, stream=stream, device=dev.index, backend="cuda") as c:

        def step(inp):
            with c.step():
                ex.upload_cucopy(shape, bufs, inp)
                c.flush()

        with c.activate():
            for i in range(100):
                step(inputs[i % 64])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(inputs[i % 64])
            dt = (time.perf_counter() - t0) / args.steps * 1e6
            print(f"whole step: {dt:.1f} us")
            inp = inputs[0]
            n, m = inp.n, inp.table.shape[1]
            pieces = {
                "slice tokens[:n]": lambda: bufs.tokens[:n],
                "slice block_table[:n, :m]": lambda: bufs.block_table[:n, :m],
                "copy tokens (fresh view)": lambda: cc.copy(
                    ex.Site.TOKENS, bufs.tokens[:n], inp.tokens
                ),
                "copy block table (fresh view)": lambda: cc.copy(
                    ex.Site.BLOCK_TABLE, bufs.block_table[:n, :m], inp.table
                ),
                "fill_tail tokens": lambda: cc.fill_tail(ex.Site.TOKEN_PAD, bufs.tokens, n, -1),
                "fill_tail block table": lambda: cc.fill_tail(
                    ex.Site.BLOCK_PAD, bufs.block_table, n * shape.max_pages, -1
                ),
            }
            for name, fn in pieces.items():
                reps = 200
                ts = []
                for _ in range(10):
                    c.begin()
                    t0 = time.perf_counter()
                    for _ in range(reps // 10):
                        fn()
                    ts.append((time.perf_counter() - t0) / (reps // 10) * 1e6)
                    c.discard()
                ts.sort()
                print(f"{name:32s} {ts[len(ts) // 2]:8.2f} us")
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for i in range(args.steps):
                step(inputs[i % 64])
            pr.disable()
            torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
