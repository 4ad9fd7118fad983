"""Steady decode where most inputs repeat each step: DeviceCopyBuffer's skip vs always uploading.

Usage:
    python bench/skip_unchanged.py [--n 32] [--changed 0,0.125,0.5,1] [--reps 200]
                                   [--sim] [--quick] [--json PATH]

Each step offers the same N inputs (the decode-like mix of ``step_cost``); the first
``changed x N`` of them (rounded up) take new values every step, the rest repeat the
last step's values. Contenders:

- ``cucopy_always``: every input through ``copier.copy`` (merged), changed or not;
- ``cucopy_buffer``: every input through ``cucopy.DeviceCopyBuffer.update`` on the
  active copier: repeated values are compared on the host and skipped;
- ``pinned_always`` (GPU): vLLM's persistent pinned buffer per input, refilled and
  copied with ``copy_(non_blocking=True)`` every step.

Measured per changed fraction: host µs per step (the comparison is host work, so it
counts), GPU µs per step with the stream held (GPU only), copies issued, copies +
launches enqueued and bytes staged per step. Skipped while ``DeviceCopyBuffer`` is not implemented.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``cucopy`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import cucopy as cc  # noqa: E402
from bench import _common as common  # noqa: E402
from bench import _device as devmod  # noqa: E402

NAME = "skip_unchanged"
DEFAULT_CHANGED = (0.0, 0.125, 0.5, 1.0)


class _Alternating(devmod.Contender):
    """Feeds each step's values: the changed inputs alternate between two value sets."""

    flush_mode = "auto"

    def __init__(self, ctx, wl, changed: int):
        super().__init__(ctx, wl)
        rng = np.random.default_rng(12345)
        alt = [
            (rng.integers(1, 1 << 30, size=v.size).astype(v.dtype) if i < changed else v)
            for i, v in enumerate(wl.values)
        ]
        self._sets = (list(wl.values), alt)
        self._k = 0
        self.changed = changed
        self.steps = 0
        self.issued = 0

    def next_values(self):
        """The values of the next step."""
        self._k ^= 1
        self.steps += 1
        return self._sets[self._k]

    def check(self) -> str | None:
        """Two steps into zeroed destinations (the second repeats the unchanged inputs).

        Returns None when every byte landed both times, else what went wrong.
        """
        ctx, wl = self.ctx, self.wl
        ctx.zero(wl.dsts)
        for k in range(2):
            self.step()
            ctx.sync()
            expect = self._sets[self._k]
            bad = [
                i
                for i, (d, v) in enumerate(zip(wl.dsts, expect))
                if not np.array_equal(ctx.to_numpy(d).view(np.uint8), v.view(np.uint8))
            ]
            if bad:
                return f"step {k}: {len(bad)}/{wl.n} destinations wrong (first: input {bad[0]})"
        return None

    def work_ops(self, steps):
        if self.copier is None:
            return float(self.wl.n)
        return devmod.copier_ops(self.copier)


class CucopyAlways(_Alternating):
    name = "cucopy_always"
    description = "copier.copy for every input, changed or not (merged, flush_mode=auto)"

    def __init__(self, ctx, wl, changed):
        super().__init__(ctx, wl, changed)
        self.copier = ctx.copier(devmod.PLAN, self.flush_mode, wl.capacity())
        self._dsts = list(wl.dsts)

    def step(self):
        copier = self.copier
        copy, site = copier.copy, devmod.Site.INPUT
        with copier.step():
            for d, v in zip(self._dsts, self.next_values()):
                copy(site, d, v)
        self.issued += self.wl.n


class CucopyBuffer(_Alternating):
    name = "cucopy_buffer"
    description = "DeviceCopyBuffer.update per input on the active copier (skips repeats)"

    def __init__(self, ctx, wl, changed):
        super().__init__(ctx, wl, changed)
        self.copier = ctx.copier(devmod.PLAN, self.flush_mode, wl.capacity())
        try:
            self._bufs = [cc.DeviceCopyBuffer(d, site=devmod.Site.INPUT) for d in wl.dsts]
        except NotImplementedError as e:
            self.copier.close()
            raise devmod.Unavailable(
                f"cucopy.DeviceCopyBuffer is not implemented yet ({e})"
            ) from None

    def step(self):
        copier = self.copier
        issued = 0
        with copier.activate(), copier.step():
            for b, v in zip(self._bufs, self.next_values()):
                issued += bool(b.update(v))
        self.issued += issued


class PinnedAlways(_Alternating):
    name = "pinned_always"
    description = "persistent pinned buffer per input: refill + copy_, always (vLLM CpuGpuBuffer)"

    def __init__(self, ctx, wl, changed):
        super().__init__(ctx, wl, changed)
        if ctx.torch is None:
            raise devmod.Unavailable("needs torch with CUDA")
        self._bufs = []
        for (k, dt), d in zip(wl.mix, wl.dsts):
            cpu, view = ctx.pinned(k, dt)
            self._bufs.append((view, cpu, d, k))

    def step(self):
        for (view, cpu, gpu, n), v in zip(self._bufs, self.next_values()):
            view[:n] = v
            gpu[:n].copy_(cpu[:n], non_blocking=True)
        self.issued += self.wl.n


CONTENDERS = (CucopyAlways, CucopyBuffer, PinnedAlways)


def contender_classes(ctx) -> list:
    """The contenders that run on ``ctx`` (``pinned_always`` needs a GPU)."""
    return [c for c in CONTENDERS if ctx.kind == "gpu" or c is not PinnedAlways]


def jobs(ctx, fractions) -> int:
    """Measurement jobs :func:`run` reports to the progress bar."""
    return len(contender_classes(ctx)) * len(fractions)


def run(ctx, n: int, fractions, reps: int, warmup: int, progress=None, seed: int = 0) -> dict:
    """Measure each contender at each changed fraction.

    Parameters
    ----------
    ctx : bench._device.Context
    n : int
        Inputs per step.
    fractions : sequence of float
        Share of the inputs that change every step.
    reps, warmup : int
    progress : bench._common.Progress, optional
    seed : int

    Returns
    -------
    dict
        ``results`` (one row per contender and fraction), ``notes``.
    """
    classes = contender_classes(ctx)
    progress = progress or common.Progress(enabled=False)
    progress.add(jobs(ctx, fractions))
    mix = common.decode_mix(n, seed)
    out = {
        "device": common.device_label(ctx),
        "config": {"n": n, "changed": list(fractions), "total_bytes": common.mix_bytes(mix)},
        "results": [],
        "notes": [],
        "contenders": {c.name: c.description for c in classes},
    }
    wl = devmod.Workload(ctx, mix, seed)
    skipped = set()
    for frac in fractions:
        changed = min(n, math.ceil(frac * n))
        built = []  # (cls, contender or None, notes), every contender checked first
        for cls in classes:
            if cls.name in skipped:
                progress.advance(f"{NAME} {cls.name} skipped")
                continue
            notes: list = []
            c = None
            try:
                c = cls(ctx, wl, changed)
                why = c.check()
                if why is not None:
                    raise RuntimeError(f"correctness check failed: {why}")
            except devmod.Unavailable as e:
                notes.append(f"skipped: {e}")
                skipped.add(cls.name)
            except Exception as e:
                notes.append(
                    f"skipped: failed to set up: {e!r}"
                    if c is None
                    else f"measurement failed: {e!r}"
                )
                if c is not None:
                    c.close()
                    c = None
            built.append((cls, c, notes))
        live = [c for _, c, _ in built if c is not None]
        for c in live:
            c.steps = c.issued = 0
        # every contender's host time in two passes, the second reversed
        # (devmod.host_passes: the host's drift during the run weighs on all alike)
        host, ops = devmod.host_by_contender(
            ctx, live, reps, warmup, out["notes"], f"changed={frac:g}"
        )
        for cls, c, notes in built:
            row = {"contender": cls.name, "changed": frac, "changed_inputs": changed}
            if c is not None:
                try:
                    r = devmod.measure(
                        ctx, c, reps, warmup, host=host.get(id(c)), ops=ops.get(id(c))
                    )
                    notes.extend(r.pop("notes"))
                    row.update(r)
                    row["issued_per_step"] = c.issued / max(1, c.steps)
                except Exception as e:
                    notes.append(f"measurement failed: {e!r}")
                finally:
                    c.close()
            row["notes"] = notes
            out["notes"].extend(f"changed={frac:g}: {cls.name}: {m}" for m in notes)
            if c is not None or any(m.startswith("measurement failed") for m in notes):
                out["results"].append(row)
            progress.advance(f"{NAME} {cls.name} changed={frac:g}")
    if ctx.kind == "sim":
        out["notes"].append("simulated device: host time and stream operations only")
    return out


HEADER = [
    "contender",
    "changed",
    "host us/step [p10-p90]",
    "GPU us/step [p10-p90]",
    "issued/step",
    "ops/step",
    "bytes staged/step",
]


def _num(x, digits=0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


#: Why the buffer's host time is higher: printed under the table.
WHY = """\
why: every DeviceCopyBuffer.update compares the new values with the ones the buffer last
wrote before it decides, changed or not. On its fast path (compiled: NumPy values through
the active copier) a skip costs less host time than staging the copy, and a changed input
a little more than copier.copy; on the general path (pure Python, other inputs) both cost
more. Besides host time it saves copies, stream operations, bytes staged and (on a GPU)
GPU time."""


def savings(result: dict) -> list[str]:
    """Per changed fraction: what ``cucopy_buffer`` saved against ``cucopy_always``."""
    by = {(r["contender"], r["changed"]): r for r in result["results"]}
    lines = []
    for frac in result["config"]["changed"]:
        a, b = by.get(("cucopy_always", frac)), by.get(("cucopy_buffer", frac))
        if not a or not b or a.get("bytes_staged_per_step") is None:
            continue
        parts = [
            f"copies {b.get('issued_per_step', 0):.0f} of {a.get('issued_per_step', 0):.0f}",
            f"operations {_num(b.get('work_ops_per_step'), 1)} of {_num(a.get('work_ops_per_step'), 1)}",
            f"bytes staged {b['bytes_staged_per_step']:.0f} of {a['bytes_staged_per_step']:.0f}",
        ]
        ga, gb = (r.get("gpu_us") or {} for r in (a, b))
        if ga.get("median") is not None and gb.get("median") is not None:
            parts.append(f"GPU {gb['median']:.1f} of {ga['median']:.1f} us")
        ha, hb = a.get("host_us") or {}, b.get("host_us") or {}
        if ha.get("median") is not None and hb.get("median") is not None:
            parts.append(f"host {hb['median']:.1f} against {ha['median']:.1f} us")
        lines.append(f"  changed={frac:g}: " + ", ".join(parts))
    return ["cucopy_buffer against cucopy_always, per step:", *lines] if lines else []


def report(result: dict) -> str:
    """The scenario's table, what the buffer saved, why, and the notes as text."""
    rows = [
        [
            r["contender"],
            f"{r['changed']:g} ({r['changed_inputs']})",
            common.fmt_stat(r.get("host_us"), digits=1),
            common.fmt_stat(r.get("gpu_us"), digits=1),
            _num(r.get("issued_per_step"), 1),
            _num(r.get("work_ops_per_step"), 1),
            _num(r.get("bytes_staged_per_step")),
        ]
        for r in result["results"]
    ]
    lines = [f"N={result['config']['n']} inputs, {result['config']['total_bytes']} bytes per step"]
    if rows:
        lines.append(common.table(rows, HEADER))
        lines += savings(result)
        lines.append(WHY)
        lines.append(common.legend(result.get("contenders", {})))
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def plot(result: dict, stem: Path) -> list[Path]:
    """``<stem>-skip_unchanged.png``: host and GPU µs, copies issued and bytes staged per step.

    One panel per quantity against the share of inputs that change each step: the
    buffer's host time next to what it saves (copies, bytes and, on a GPU, GPU time).
    """
    plt = common.pyplot()
    if plt is None or not result["results"]:
        return []
    panels = [("host_us", "host time per step", "host µs per step (median, p10-p90)")]
    if any(r.get("gpu_us") for r in result["results"]):
        panels.append(
            ("gpu_us", "GPU time per step, stream held", "GPU µs per step (median, p10-p90)")
        )
    panels.append(("issued_per_step", "copies issued per step", "copies"))
    panels.append(("work_ops_per_step", "stream operations per step", "copies + launches"))
    panels.append(("bytes_staged_per_step", "bytes staged per step (cucopy)", "bytes"))
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    names = list(dict.fromkeys(r["contender"] for r in result["results"]))
    for ax, (key, title, ylabel) in zip(axes.flat, panels):
        for i, name in enumerate(names):
            rs = [r for r in result["results"] if r["contender"] == name and r.get(key) is not None]
            if not rs:
                continue
            xs = common.dodge([r["changed"] for r in rs], i, len(names), log=False, step=0.012)
            if isinstance(rs[0][key], dict):
                ys = [r[key]["median"] for r in rs]
                err = [
                    [r[key]["median"] - r[key]["p10"] for r in rs],
                    [r[key]["p90"] - r[key]["median"] for r in rs],
                ]
            else:
                ys, err = [r[key] for r in rs], None
            ax.errorbar(xs, ys, yerr=err, label=name, **common.line_style(i))
        ax.set_xlabel("share of inputs that change each step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    what = f"skip_unchanged: {result['config']['n']} inputs, DeviceCopyBuffer vs always copying"
    fig.suptitle(common.plot_title(what, result.get("device", "")), fontsize=11)
    return common.save_plot(fig, stem, NAME)


def main(argv=None) -> int:
    """Run the scenario alone; print its table; optionally write JSON."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=32, help="inputs per step")
    p.add_argument(
        "--changed",
        type=common.parse_floats,
        default=list(DEFAULT_CHANGED),
        help="shares of inputs that change each step",
    )
    common.add_run_args(p)
    args = p.parse_args(argv)
    ctx = devmod.make_context(args.sim, args.seed)
    reps, warmup = common.reps_for(ctx, args)
    return common.run_script(
        ctx,
        args,
        NAME,
        lambda prog: run(ctx, args.n, args.changed, reps, warmup, prog, args.seed),
        report,
    )


if __name__ == "__main__":
    sys.exit(main())
