"""A/B timing of transformers' continuous batching, unmodified vs routed through cucopy.

Usage:
    python bench/hf_ab.py [--mode async|sync|both] [--requests 32] [--new-tokens 64]
        [--pairs 5] [--bound] [--json PATH]
    python bench/hf_ab.py --cpu [--requests 8] [--new-tokens 8]  # no GPU: the harness only

The harness around the seam of ``examples/hf_continuous_batching.py`` (read that file
for how the engine's uploads are routed). It runs ``generate_batch`` once to build and
warm the engine (kept as a persistent manager), then ``--pairs`` rounds of one run per
variant, the order rotated each round (AB, BA, ...): ``unmodified``, ``routed`` and, in
sync mode on a GPU, ``twin_plain`` (the routed step's host twin uploaded with a plain
``copy_``/``fill_`` per region: what the twin alone gains, apart from cucopy).
``--bound`` adds ``no_upload``: the routed step with every upload left out (stale
device inputs, so its tokens are not compared), the floor under any upload path's step
ratio in that run. Every other run is checked token for token against the first; then
one routed run in cucopy's check mode.

It prints per-step host time (the median interval between generation steps, and the
time in the upload method), wall time per run, the routed/unmodified ratios of the step
and of the upload method's own time (each beside its target), the routed upload by phase
(``begin()``, staging, the in-place copies through the route's ``HostGuard``s,
``flush()``), ``copier.stats``, and ``match:`` (or ``MISMATCH:`` lines and exit status 1). ``--json PATH`` writes the environment, the
configuration, every raw timing and the stats. ``bench/gpu_session.sh`` runs it in both
modes (steps ``hf_async``, ``hf_sync``). What it measures and does not: the engine's
step time as its host sees it (no CUDA events), on a tiny model whose forward pass is
short, so uploads weigh more than they would beside a real model.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import torch  # noqa: E402
import transformers  # noqa: E402
from hf_continuous_batching import (  # noqa: E402
    IN_PLACE_MIN_BYTES,
    CucopyRoute,
    PlainCopier,
    cb_config,
    make_model,
    make_prompts,
)
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import (  # noqa: E402
    ContinuousBatchingAsyncIOs,
)

import cucopy as cc  # noqa: E402
from cucopy import check  # noqa: E402

# -- a bound: a copier that uploads nothing --------------------------------------------------------


class NullCopier(PlainCopier):
    """Uploads nothing: the ``no_upload`` variant (``--bound``), a bound, not an engine.

    Its route still runs everything around the upload (the engine's host preparation,
    on the twin in sync mode, and the scalar accumulators), but ``copy`` and
    ``fill_tail`` only count, so the device keeps stale inputs and the tokens differ
    (they are not compared). Its step time is what any upload path, free of host and
    GPU cost, could give this engine in the same run: the floor under a target ratio.
    """

    def __init__(self, stream=None, backend=None):
        super().__init__(stream, backend, record=False)

    @contextlib.contextmanager
    def step(self):
        """One step: nothing is issued."""
        self.steps += 1
        yield

    def copy(self, site, dst, src, **_) -> bool:
        """Counted, not issued."""
        self._counts[site] += 1
        return True

    def fill_tail(self, site, dst, start, value, **_) -> bool:
        """Counted, not issued."""
        self._counts[site] += 1
        return True


#: ``in_place_min_bytes`` no region reaches: a route with no guards, so no ``write()`` fences
#: (the ``no_upload`` bound pays nothing for them)
NO_IN_PLACE = 1 << 62


# -- timing --------------------------------------------------------------------------------------


class StepClock:
    """Host timestamps of a batch processor's generation steps and upload calls.

    Installed once (instance attributes that call through ``type(obj)``, so routed and
    unmodified runs pay the same and see the class :class:`CucopyRoute` sets).
    """

    def __init__(self, processor):
        self.starts: list = []  # perf_counter_ns at each _generation_step
        self.hooks: list = []  # ns spent in the upload method
        starts, hooks = self.starts, self.hooks
        step = processor._generation_step

        def generation_step(model):
            starts.append(time.perf_counter_ns())
            return step(model)

        processor._generation_step = generation_step
        io = processor.inputs_and_outputs
        targets = io.io_pairs if isinstance(io, ContinuousBatchingAsyncIOs) else [io]
        self.hook_name = (
            "transfer_inputs_h2d"
            if isinstance(io, ContinuousBatchingAsyncIOs)
            else "prepare_batch_tensors"
        )
        for obj in targets:
            setattr(obj, self.hook_name, self._timed(obj, self.hook_name, hooks))

    @staticmethod
    def _timed(obj, name, hooks):
        def call(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return getattr(type(obj), name)(obj, *args, **kwargs)
            finally:
                hooks.append(time.perf_counter_ns() - t0)

        return call

    def take(self) -> tuple[list, list]:
        """``(step intervals in ms, upload times in us)`` since the last take."""
        s = self.starts
        intervals = [(b - a) / 1e6 for a, b in zip(s, s[1:])]
        hooks = [h / 1e3 for h in self.hooks]
        self.starts.clear()
        self.hooks.clear()
        return intervals, hooks


# -- the runs ------------------------------------------------------------------------------------


class Session:
    """One mode: the model's persistent manager, its route, its clock, and every run."""

    def __init__(self, args, mode, model, prompts, device):
        self.args, self.mode, self.model, self.prompts = args, mode, model, prompts
        self.device = device
        self.gen = GenerationConfig(
            max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1
        )
        self.cb = cb_config(args, mode)
        self.runs: list = []
        self.errors: list = []
        self.reference = None
        self.generated = 0  # generate_batch calls, all checked against the first
        self.flush_mode = None  # the routed copier's, once made

    def generate(self) -> tuple[list, float, list]:
        """One ``generate_batch``: tokens per request (input order), wall seconds, errors."""
        self.generated += 1
        t0 = time.perf_counter()
        out = self.model.generate_batch(
            self.prompts,
            generation_config=self.gen,
            continuous_batching_config=self.cb,
            persistent_manager=True,
        )
        wall = time.perf_counter() - t0
        results = list(out.values())
        errors = [f"{r.request_id}: {r.error}" for r in results if r.error is not None]
        if len(results) != len(self.prompts):
            errors.append(f"{len(results)} results for {len(self.prompts)} requests")
        return [list(r.generated_tokens) for r in results], wall, errors

    def compare(self, tokens, what: str) -> bool:
        """Check ``tokens`` against the reference run, request by request."""
        bad = []
        for i, (got, want) in enumerate(zip(tokens, self.reference)):
            if got != want:
                k = next(
                    (j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                    min(len(got), len(want)),
                )
                bad.append(f"{self.mode} {what}: request {i}: first difference at token {k}")
        if len(tokens) != len(self.reference):
            bad.append(
                f"{self.mode} {what}: {len(tokens)} requests, reference has {len(self.reference)}"
            )
        self.errors.extend(bad)
        return not bad

    def variants(self) -> list:
        """``unmodified``, ``routed``, in sync mode on a GPU ``twin_plain``, with ``--bound``
        ``no_upload``."""
        extra = ["twin_plain"] if self.mode == "sync" and not self.args.cpu else []
        if self.args.bound:
            extra.append("no_upload")
        return ["unmodified", "routed", *extra]

    def run(self) -> dict:
        """Warm up, rotate the variants' runs (AB, BA, ...), then one run in check mode."""
        args = self.args
        routes = {}
        try:
            self.reference, wall, errors = self.generate()  # builds, warms up, keeps the manager
            self.errors.extend(f"{self.mode} first run: {e}" for e in errors)
            manager = self.model.init_continuous_batching()  # the kept manager
            processor = manager.batch_processor
            clock = StepClock(processor)
            t0 = time.perf_counter()
            routes["routed"] = route = CucopyRoute(
                processor,
                PlainCopier() if args.cpu else None,
                in_place_min_bytes=args.in_place_min_bytes,
                **({} if args.cpu else {"flush_mode": args.flush_mode}),
            )
            copier_s = time.perf_counter() - t0  # the first CUDA copier builds its kernels
            # (the route's choice unless --flush-mode named one)
            self.flush_mode = getattr(route.copier, "flush_mode", None)
            variants = self.variants()
            if "twin_plain" in variants:
                plain = PlainCopier(route.stream, backend=route.copier.backend, record=False)
                routes["twin_plain"] = CucopyRoute(
                    processor, plain, in_place_min_bytes=args.in_place_min_bytes
                )
            if "no_upload" in variants:
                null = NullCopier(route.stream, backend=route.copier.backend)
                routes["no_upload"] = CucopyRoute(processor, null, in_place_min_bytes=NO_IN_PLACE)
            for name, r in routes.items():  # each route's first run (first steps), untimed
                with r:
                    tokens, _, errors = self.generate()
                if name != "no_upload":  # stale inputs: its tokens differ
                    self.compare(tokens, f"{name} warm-up run")
                self.errors.extend(f"{self.mode} {name} warm-up: {e}" for e in errors)
            clock.take()
            route.phases.clear()
            for rnd in range(args.pairs):
                k = rnd % len(variants)
                for variant in variants[k:] + variants[:k]:
                    with routes.get(variant) or contextlib.nullcontext():
                        tokens, wall, errors = self.generate()
                    intervals, hooks = clock.take()
                    ok = (
                        None
                        if variant == "no_upload"
                        else self.compare(tokens, f"{variant} run (round {rnd})")
                    )
                    self.errors.extend(f"{self.mode} {variant} (round {rnd}): {e}" for e in errors)
                    self.runs.append(
                        {
                            "variant": variant,
                            "pair": rnd,
                            "wall_s": wall,
                            "steps": len(intervals) + 1,
                            "step_ms": intervals,
                            "upload_us": hooks,
                            "tokens_identical": None if ok is None else ok and not errors,
                        }
                    )
            # the routed upload's phases, from one more routed run with its clock on (the
            # timed rounds take no clock readings inside the upload)
            route.timed = True
            route.phases.clear()
            with route:
                tokens, _, errors = self.generate()
            clock.take()
            route.timed = False
            self.compare(tokens, "routed run (phases timed)")
            self.errors.extend(f"{self.mode} routed (phases timed): {e}" for e in errors)
            phases = list(route.phases)
            checked = self.check_run(route)
            stats = route.stats_text()
            if "twin_plain" in routes:
                stats += "\ntwin_plain: " + routes["twin_plain"].stats_text()
            st = route.copier.stats
            stats_dict = st.as_dict() if hasattr(st, "as_dict") else None
        finally:
            # also after a failure: the next mode must not find this mode's kept manager
            try:
                for r in routes.values():
                    r.close()
            finally:
                self.model.destroy_cached_continuous_batching_manager()
        res = self.summary(
            copier_s, checked, stats, stats_dict, dict(route.in_place), clock.hook_name
        )
        res["routed_phases_us"] = phase_stats(phases)
        return res

    def check_run(self, route) -> dict:
        """One routed run with cucopy's check mode on (each flush verifies the plan)."""
        if self.args.cpu:
            return {"ran": False, "why": "--cpu: PlainCopier has no check mode"}
        before = check.CHECK_MODE
        check.CHECK_MODE = True
        try:
            with route:
                tokens, _, errors = self.generate()
        finally:
            check.CHECK_MODE = before
        ok = self.compare(tokens, "check-mode run")
        self.errors.extend(f"{self.mode} check mode: {e}" for e in errors)
        return {"ran": True, "tokens_identical": ok and not errors, "errors": errors[:5]}

    def bound(self, null_ratios) -> dict | None:
        """With ``--bound``: the floor under any routed step ratio, two ways, per round.

        ``step_ratio``: the ``no_upload`` run's median step over the unmodified run's.
        ``from_hooks``: the unmodified median step less what the upload method's median
        time drops to when it uploads nothing, over that step (the upload's own share,
        from the method's own timer: steadier than the whole step). Each a median over
        the rounds, with every round's value.
        """
        if null_ratios is None:
            return None
        from_hooks = []
        for rnd in range(self.args.pairs):
            runs = {r["variant"]: r for r in self.runs if r["pair"] == rnd}
            u, n = runs.get("unmodified"), runs.get("no_upload")
            if not (u and n and u["step_ms"] and u["upload_us"] and n["upload_us"]):
                continue
            step_us = statistics.median(u["step_ms"]) * 1e3
            saved = statistics.median(u["upload_us"]) - statistics.median(n["upload_us"])
            from_hooks.append((step_us - saved) / step_us)
        med = statistics.median
        return {
            "step_ratio": med(null_ratios) if null_ratios else None,
            "step_ratio_per_round": null_ratios,
            "from_hooks": med(from_hooks) if from_hooks else None,
            "from_hooks_per_round": from_hooks,
        }

    def summary(self, copier_s, checked, stats, stats_dict, in_place, hook_name) -> dict:
        """The mode's result: per variant, every raw sample and its statistics."""
        from bench._common import summarize

        by, ratios, up_ratios = {}, {}, {}
        for variant in self.variants():
            runs = [r for r in self.runs if r["variant"] == variant]
            by[variant] = {
                "runs": len(runs),
                "step_ms": summarize([x for r in runs for x in r["step_ms"]]),
                "upload_us": summarize([x for r in runs for x in r["upload_us"]]),
                "wall_s": summarize([r["wall_s"] for r in runs]),
                "steps_per_run": [r["steps"] for r in runs],
            }
            ratios[variant] = []
            up_ratios[variant] = []
        for rnd in range(self.args.pairs):  # per round: variant median / unmodified median
            for key, out in (("step_ms", ratios), ("upload_us", up_ratios)):
                med = {
                    r["variant"]: statistics.median(r[key])
                    for r in self.runs
                    if r["pair"] == rnd and r[key]
                }
                for variant in out:
                    if variant in med and med.get("unmodified"):
                        out[variant].append(med[variant] / med["unmodified"])
        target = {"async": 0.95, "sync": 0.85}[self.mode]
        ratio = statistics.median(ratios["routed"]) if ratios["routed"] else None
        # the upload method alone (issue 29): routed / unmodified time in it, per round
        up_target = {"async": 1.05, "sync": 0.95}[self.mode]
        up_ratio = statistics.median(up_ratios["routed"]) if up_ratios["routed"] else None
        cfg = self.cb
        bound = self.bound(ratios.get("no_upload"))
        return {
            "mode": self.mode,
            "upload_method": hook_name,
            "config": {
                "requests": len(self.prompts),
                "new_tokens": self.args.new_tokens,
                "prompt_tokens": [len(p) for p in self.prompts],
                "continuous_batching": {
                    "block_size": cfg.block_size,
                    "num_blocks": cfg.num_blocks,
                    "max_batch_tokens": cfg.max_batch_tokens,
                    "use_async_batching": cfg.use_async_batching,
                    "use_cuda_graph": cfg.use_cuda_graph,
                },
                "flush_mode": self.flush_mode,
                "in_place_min_bytes": self.args.in_place_min_bytes,
                "torch_threads": torch.get_num_threads(),
            },
            "copier_create_s": copier_s,
            "generate_batch_runs": self.generated,
            "variants": by,
            "step_ratio_per_round": {v: x for v, x in ratios.items() if v != "unmodified"},
            "step_ratio": ratio,
            "target_ratio": target,
            "target_met": None if ratio is None or self.args.cpu else ratio <= target,
            "upload_ratio_per_round": {v: x for v, x in up_ratios.items() if v != "unmodified"},
            "upload_ratio": up_ratio,
            "upload_target_ratio": up_target,
            "upload_target_met": None
            if up_ratio is None or self.args.cpu
            else up_ratio <= up_target,
            "bound": bound,
            "check_mode": checked,
            "tokens_identical": not self.errors,
            "stats": stats_dict,
            "stats_text": stats,
            "in_place_copies": {s.label: n for s, n in in_place.items()},
            "runs": self.runs,
        }


#: the routed upload's phases: ``begin()``, staging (less the in-place copies), the in-place
#: (guarded) copies, ``flush()``
PHASES = ("begin", "staging", "in_place_copies", "flush")


def phase_stats(phases: list) -> dict:
    """Per phase of the routed upload (:data:`PHASES`), µs statistics over the uploads."""
    from bench._common import summarize

    return {name: summarize([p[i] / 1e3 for p in phases]) for i, name in enumerate(PHASES)}


def report(res: dict, device_name: str) -> None:
    """Print one mode's result."""
    v = res["variants"]
    runs = " + ".join(str(s["runs"]) for s in v.values())
    print(
        f"mode {res['mode']} on {device_name}: {res['config']['requests']} requests x "
        f"{res['config']['new_tokens']} new tokens, {runs} timed runs ({', '.join(v)}, rotated); "
        f"copier made in {res['copier_create_s']:.2f} s"
    )
    for variant, s in v.items():
        step, up, wall = s["step_ms"], s["upload_us"], s["wall_s"]
        if step["median"] is None:
            print(f"  {variant:10}  no steps measured")
            continue
        print(
            f"  {variant:10}  step {step['median']:7.3f} ms [{step['p10']:.3f}-{step['p90']:.3f}]  "
            f"{res['upload_method']} {up['median']:8.1f} us [{up['p10']:.1f}-{up['p90']:.1f}]  "
            f"wall {wall['median']:6.3f} s/run, {statistics.median(s['steps_per_run'])} steps"
        )
    for variant, xs in res["step_ratio_per_round"].items():
        if not xs:
            continue
        line = f"  {variant}/unmodified step time: {statistics.median(xs):.3f} (rounds: "
        line += " ".join(f"{x:.3f}" for x in xs) + ")"
        if variant == "routed":
            met = {True: "MET", False: "NOT MET", None: "n/a (--cpu)"}[res["target_met"]]
            line += f"; target <= {res['target_ratio']}: {met}"
        print(line)
    for variant, xs in res["upload_ratio_per_round"].items():
        if not xs:
            continue
        line = f"  {variant}/unmodified {res['upload_method']} time: {statistics.median(xs):.3f}"
        line += " (rounds: " + " ".join(f"{x:.3f}" for x in xs) + ")"
        if variant == "routed":
            met = {True: "MET", False: "NOT MET", None: "n/a (--cpu)"}[res["upload_target_met"]]
            line += f"; target <= {res['upload_target_ratio']}: {met}"
        print(line)
    ph = res.get("routed_phases_us")
    if ph and ph["begin"]["median"] is not None:
        print(
            "  routed upload by phase (median us): "
            + ", ".join(f"{n.replace('_', ' ')} {ph[n]['median']:.1f}" for n in PHASES)
        )
    b = res.get("bound")
    if b and b["step_ratio"] is not None:
        hooks = "-" if b["from_hooks"] is None else f"{b['from_hooks']:.3f}"
        print(
            f"  bound (no upload at all, tokens not compared): step ratio "
            f"{b['step_ratio']:.3f}, from the upload method's own time {hooks} "
            f"(target {res['target_ratio']})"
        )
    c = res["check_mode"]
    if c["ran"]:
        print(
            f"  check mode: routed run, tokens identical: {c['tokens_identical']} {c['errors'] or ''}"
        )
    else:
        print(f"  check mode: not run ({c['why']})")
    print("  " + res["stats_text"].replace("\n", "\n  "))


def environment(args, device) -> dict:
    """Where it ran (bench's environment record, plus transformers and torch)."""
    from bench._common import environment as bench_environment

    cp = None
    if device.type == "cuda":
        try:
            import cupy as cp
        except ImportError:
            cp = None
    ctx = SimpleNamespace(kind="gpu" if cp is not None else "cpu", device=0, cp=cp, torch=torch)
    env = bench_environment(ctx)
    env["transformers"] = transformers.__version__
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    env["check_mode_at_start"] = bool(check.CHECK_MODE)
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--mode",
        choices=("async", "sync", "both"),
        default=None,
        help="default: both (--cpu: sync)",
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--pairs", type=int, default=5, help="rounds of one run per variant, rotated (default 5)"
    )
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=100)
    p.add_argument("--max-batch-tokens", type=int, default=64)
    p.add_argument(
        "--flush-mode",
        default=None,
        choices=("auto", "dma", "mapped", "inline"),
        help="the routed copier's flush_mode (default: the route's, mapped async, auto sync)",
    )
    p.add_argument(
        "--in-place-min-bytes",
        "--raw-min-bytes",  # its name before the in-place copies
        dest="in_place_min_bytes",
        type=int,
        default=IN_PLACE_MIN_BYTES,
        help="regions this large are read in place through a HostGuard (default 64 KiB)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bound",
        action="store_true",
        help="also time a no_upload variant (uploads nothing; tokens not compared): "
        "the floor under any upload path's step ratio",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch.set_num_threads(N) for both variants (0: torch's default)",
    )
    p.add_argument(
        "--cpu", action="store_true", help="no GPU: sync mode with PlainCopier (the seam only)"
    )
    p.add_argument(
        "--watchdog", type=float, default=0, help="dump every thread's stack and exit after S s"
    )
    p.add_argument("--json", metavar="PATH", help="write the environment, timings and stats here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.new_tokens < 1 or args.pairs < 1:
        p.error("--requests, --new-tokens and --pairs must be >= 1")
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    if args.threads > 0:
        # torch's intra-op threads (the engine's CPU tensor work) spin after each
        # parallel region: on a machine whose CPU time is shared, one process's
        # spinning threads can slow its own engine thread
        torch.set_num_threads(args.threads)
    # the engine logs a warning per persistent-manager run; errors (with tracebacks) still show
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    if args.cpu:
        device = torch.device("cpu")
        if args.mode == "async":
            p.error("--cpu runs sync mode only (async batching needs CUDA)")
        modes = ["sync"]
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device visible to torch: run with --cpu (sync mode, the seam only)")
        device = torch.device("cuda", torch.cuda.current_device())
        modes = ["async", "sync"] if args.mode in (None, "both") else [args.mode]
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (PlainCopier)"
    )
    print(
        f"hf_ab: transformers {transformers.__version__}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), cucopy {cc.__version__}, on {device_name}",
        flush=True,
    )

    model = make_model(args, device)
    prompts = make_prompts(args)
    results, errors = {}, []
    for mode in modes:
        session = Session(args, mode, model, prompts, device)
        try:
            res = session.run()
        except Exception:
            traceback.print_exc()
            errors.append(f"{mode}: the run raised (traceback above)")
            errors.extend(session.errors)
            continue
        results[mode] = res
        errors.extend(session.errors)
        report(res, device_name)

    ok = not errors and len(results) == len(modes)
    if ok:
        what = ", ".join(f"{m} {r['generate_batch_runs']} runs" for m, r in results.items())
        print(f"match: tokens identical request by request in every run ({what})")
    else:
        for e in errors[:20]:
            print(f"MISMATCH: {e}", file=sys.stderr)
        print(f"MISMATCH: {len(errors)} problems", file=sys.stderr)
    if args.json:
        from bench._common import write_json

        out = {
            "example": "hf_continuous_batching",
            "harness": "bench/hf_ab.py",
            "args": vars(args),
            "environment": environment(args, device),
            "modes": results,
            "match": ok,
            "errors": errors[:50],
        }
        write_json(Path(args.json), out)
        print(f"wrote {args.json}")
    faulthandler.cancel_dump_traceback_later()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
