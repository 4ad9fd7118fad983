"""Run cucopy's copy profiler over the example programs and check its counts.

Usage:
    python bench/profile_programs.py [--out DIR] [--programs decode,hf_async,hf_sync]
        [--steps 30] [--requests 32] [--new-tokens 64] [--rounds 3] [--device cuda|meta]
        [--costs PATH] [--routed-from DIR]

Each program runs under ``cucopy.profile`` and the profiler's counts are compared with
what the program is known to issue, call by call:

- ``decode``: ``examples/torch_decode_loop.py``'s plain loop (``PlainUploader``: four
  ``copy_`` uploads a step, three from one line and the block table from another, and
  four ``fill_`` of the unused slots whenever the batch is not full), ``--steps`` steps
  of the example's own inputs, each followed by the graph replay. Its routed result is
  measured in the same process: the example's own verified and timed loops
  (``run_cuda``, ``--rounds`` rounds), whose host time a step and wall time a step for
  the plain and the cucopy loop are printed beside the profiler's estimate.
- ``hf_async``, ``hf_sync``: transformers' continuous batching as
  ``examples/hf_continuous_batching.py`` builds it (its model, prompts and engine
  configuration, imported from the example in :func:`hf_setup`), one ``generate_batch``
  after a warm-up one. async: each ``transfer_inputs_h2d`` call issues one pinned
  ``copy_`` per buffer the step uses (bulk inputs, write indices, read indices when the
  step reads the cache, the block table instead of both on the decode fast path, one
  mask per attention type): four a step in the common case. sync: each
  ``prepare_batch_tensors`` call issues seven ``torch.tensor(..., device=)`` uploads
  (input ids, positions, cumulative q lengths, logits indices, cumulative k lengths per
  attention type, write indices and read indices per cache group) and one mask block
  (``torch.full`` in ``build_attention_mask``) per request in the batch and attention
  type. The expected counts are read from the engine's own state at each call; the
  profiler's counts are those it recorded during that call. The routed result is not
  re-measured here (``examples/hf_continuous_batching.py`` takes minutes a mode): it
  is read from the latest stored run holding ``hf_continuous_batching-<mode>.json``
  (or ``--routed-from DIR``) and printed beside the estimate.

Without CUDA (``--device meta``, the default when torch sees no GPU) only ``decode``
runs, its uploads going to torch's ``meta`` device (counts and bytes only, no timing);
the transformers programs are skipped with a message. ``--device cpu`` runs
``hf_sync`` on the CPU too, counting its ``torch.tensor(..., device="cpu")`` calls and
mask blocks as uploads: a check of this harness and of the profiler's threads (every
CPU copy counts then, so the rest of that report means nothing).

Writes, under ``--out`` (default ``bench/results/profile_programs/``): per program
``<name>.txt`` (the profiler's report, then the check and the routed result) and
``<name>-skeleton.py`` (its ``Site`` enum and ``PLAN``), and ``profile_programs.json``
(per program: the check, the estimate, the routed result). Exit status 1 when a count
does not match.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cucopy  # noqa: E402
from cucopy import profiler  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PROGRAMS = ("decode", "hf_async", "hf_sync")


def load_example(name: str):
    """Import ``examples/<name>.py`` as a module (examples are scripts, not a package)."""
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_cucopy_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# -- the decode example ------------------------------------------------------------------------


class _StandInEvent:
    """``torch.cuda.Event``'s two calls ``PlainUploader`` makes, for the meta device."""

    def synchronize(self) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


def profile_decode(args, device: str) -> dict:
    """Profile the decode example's plain loop; check four uploads a step and the fills.

    Parameters
    ----------
    args : argparse.Namespace
    device : str
        ``"cuda"`` or a stand-in (``"meta"``).

    Returns
    -------
    dict
        See :func:`_result`; ``routed`` is None off CUDA.
    """
    import torch

    ex = load_example("torch_decode_loop")
    shape = ex.Shape(batch=args.batch)
    bufs = ex.Buffers(shape, lambda size: torch.empty(size, dtype=torch.int32, device=device))
    replay, stream_ctx = (lambda: None), contextlib.nullcontext()
    if device == "cuda":
        w = ex.make_weights(shape, torch.device("cuda"), args.seed)
        for buf, pad in zip(bufs.all(), (-1, -1, 0, -1)):  # unused slots, as the example's
            buf.fill_(pad)
        graph, _ = ex.capture(w, bufs, shape)
        stream = torch.cuda.Stream()
        uploader = ex.PlainUploader(shape, bufs, torch.cuda.Event(), stream, pin_memory=True)
        replay, stream_ctx = graph.replay, torch.cuda.stream(stream)
    else:
        uploader = ex.PlainUploader(shape, bufs, _StandInEvent(), None, pin_memory=False)
    inputs = [ex.make_inputs(shape, s, args.seed) for s in range(args.steps)]
    with stream_ctx:
        for inp in inputs[:3]:  # warm up: first calls, the caching allocator
            uploader(inp)
            replay()
        if device == "cuda":
            torch.cuda.synchronize()
        with cucopy.profile(device=device, costs=args.costs) as prof:
            for s, inp in enumerate(inputs):
                if s:
                    prof.step()
                uploader(inp)
                replay()
        if device == "cuda":
            torch.cuda.synchronize()
    sites = prof.sites
    lines, ok = [], True
    if prof.steps != len(inputs):
        ok = False
        lines.append(f"steps: profiler {prof.steps}, program {len(inputs)}")
    per_step_up = [sum(r.counts[s] for r in sites if r.upload) for s in range(prof.steps)]
    per_step_fill = [sum(r.counts[s] for r in sites if not r.upload) for s in range(prof.steps)]
    want_fill = [4 if inp.n < shape.batch else 0 for inp in inputs]
    bad = [
        s
        for s in range(min(prof.steps, len(inputs)))
        if per_step_up[s] != 4 or per_step_fill[s] != want_fill[s]
    ]
    ops = {(r.op, r.upload) for r in sites}
    lines.append(
        f"uploads a step: {dict(sorted(Counter(per_step_up).items()))} (expected 4 every step); "
        f"fills a step: {dict(sorted(Counter(per_step_fill).items()))} (expected "
        f"{dict(sorted(Counter(want_fill).items()))}: 4 when the batch is not full)"
    )
    upload_sites = sorted(sum(r.counts) // max(prof.steps, 1) for r in sites if r.upload)
    if upload_sites != [1, 3]:
        ok = False
        lines.append(f"upload sites: {upload_sites} a step each, expected [1, 3] (table, vectors)")
    if bad:
        ok = False
        lines.append(f"steps that differ: {bad[:10]}{' ...' if len(bad) > 10 else ''}")
    if any(r.op != "copy_" for r in sites if r.upload) or any(
        r.op != "fill_" for r in sites if not r.upload
    ):
        ok = False
        lines.append(f"ops seen: {sorted(ops)}, expected copy_ and fill_ only")
    lines.insert(0, f"decode: counts {'MATCH' if ok else 'MISMATCH'} over {len(inputs)} steps")
    routed = None
    if device == "cuda":
        routed = measure_decode_routed(ex, shape, args)
    return _result(prof, ok, lines, routed)


def measure_decode_routed(ex, shape, args) -> dict:
    """The example's own measurement: plain vs cucopy, host and wall µs a step."""
    ns = argparse.Namespace(steps=args.steps, batch=args.batch, seed=args.seed, rounds=args.rounds)
    try:
        merged, plain, _stats, env, _embedded, _estats = ex.run_cuda(ns, shape)
    except SystemExit as exc:  # the example's own message (CuPy missing)
        return {"what": "examples/torch_decode_loop.py run_cuda", "error": str(exc)}
    out = {
        "what": "examples/torch_decode_loop.py run_cuda, same process",
        "plain_host_us": plain.summary()["median_host_us"],
        "cucopy_host_us": merged.summary()["median_host_us"],
        "plain_gpu_us": plain.summary()["median_gpu_us"],
        "cucopy_gpu_us": merged.summary()["median_gpu_us"],
    }
    timed = env.get("timed")
    if timed:
        walls = timed["median_wall_us_per_step"]
        out["plain_wall_us"], out["cucopy_wall_us"] = walls.get("plain"), walls.get("cucopy")
    out["host_saved_us"] = out["plain_host_us"] - out["cucopy_host_us"]
    if out.get("plain_wall_us") is not None:
        out["wall_saved_us"] = out["plain_wall_us"] - out["cucopy_wall_us"]
    return out


# -- transformers' continuous batching -------------------------------------------------------------


def hf_setup():
    """The one coupling to ``examples/hf_continuous_batching.py``: its model, prompts and
    engine configuration (``make_model``, ``make_prompts``, ``cb_config``). Raises
    SystemExit with the example's message when transformers is missing or another release.
    """
    ex = load_example("hf_continuous_batching")
    return SimpleNamespace(
        make_model=ex.make_model, make_prompts=ex.make_prompts, cb_config=ex.cb_config
    )


def _hf_expected_async(pair) -> int:
    """``copy_`` calls of ``HostDeviceIOPair.transfer_inputs_h2d`` (transformers 5.17.0)."""
    h = pair.host_io
    n = 1  # the bulk input tensor
    n += 1 if h.use_block_table else 1 + (1 if h.max_kv_read > 0 else 0)
    if h.attention_mask is not None and pair.device_io.attention_mask is not None:
        n += len(h.attention_mask)
    return n


def _hf_expected_sync(io) -> tuple[int, int]:
    """``torch.tensor`` uploads and mask blocks of ``prepare_batch_tensors`` (5.17.0)."""
    tensors = 4 + len(io.cumulative_seqlens_k)  # ids, positions, cu_q, logits idx; cu_k
    if not io.use_block_table:
        groups = io.cache.num_groups
        tensors += groups + (groups if io.max_kv_read > 0 else 0)
    masks = 0
    if io.attention_mask is not None:
        masks = io.num_request_in_batch * len(io.attention_mask)
    return tensors, masks


def profile_hf(args, mode: str, device: str = "cuda") -> dict:
    """Profile one ``generate_batch`` of transformers' continuous batching in ``mode``.

    ``device="cpu"`` (sync mode only) runs the engine on the CPU and counts its
    ``torch.tensor(..., device="cpu")`` calls and mask blocks as if the CPU were the
    device: it checks this harness and the profiler's threads, not uploads (every CPU
    copy counts then too, so the report's other rows mean nothing).
    """
    import torch

    hf = hf_setup()  # first: its SystemExit says what is missing
    # the engine warns once a persistent-manager run; errors still show (as the example does)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.input_outputs import (
        ContinuousBatchingAsyncIOs,
    )

    ns = argparse.Namespace(
        seed=args.seed,
        requests=args.requests,
        new_tokens=args.new_tokens,
        block_size=32,
        num_blocks=100,
        max_batch_tokens=64,
    )
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else device
    model = hf.make_model(ns, where)
    prompts = hf.make_prompts(ns)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1)
    cb = hf.cb_config(ns, mode)

    def generate():
        return model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, persistent_manager=True
        )

    calls: list = []  # per upload call: (expected, actual)
    patched: list = []
    try:
        generate()  # builds and warms the engine, kept as a persistent manager
        processor = model.init_continuous_batching().batch_processor
        io = processor.inputs_and_outputs
        is_async = isinstance(io, ContinuousBatchingAsyncIOs)
        if is_async != (mode == "async"):
            raise RuntimeError(f"hf_{mode}: the engine built {type(io).__name__}")
        targets = io.io_pairs if is_async else [io]
        name = "transfer_inputs_h2d" if is_async else "prepare_batch_tensors"
        prof = cucopy.profile(device=device, costs=args.costs)

        def hook(obj):
            method = getattr(type(obj), name)

            def call(*a, **k):
                profiler.step()  # each upload call begins a step
                before = prof.totals()
                try:
                    return method(obj, *a, **k)
                finally:
                    after = prof.totals()
                    got = {op: after.get(op, 0) - before.get(op, 0) for op in after}
                    if is_async:
                        calls.append(((_hf_expected_async(obj), 0), (got.get("copy_", 0), 0)))
                    else:
                        want = _hf_expected_sync(obj)
                        calls.append((want, (got.get("torch.tensor", 0), got.get("torch.full", 0))))

            return call

        for obj in targets:
            setattr(obj, name, hook(obj))
            patched.append(obj)
        with prof:
            generate()
    finally:
        for obj in patched:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
        model.destroy_cached_continuous_batching_manager()
    ok = bool(calls) and all(w == g for w, g in calls)
    what = "copy_ uploads" if mode == "async" else "torch.tensor uploads"
    lines = [f"hf_{mode}: counts {'MATCH' if ok else 'MISMATCH'} over {len(calls)} {name} calls"]
    lines.append(
        f"  {what} a call: profiler {dict(sorted(Counter(g[0] for _, g in calls).items()))}, "
        f"expected from the engine's state {dict(sorted(Counter(w[0] for w, _ in calls).items()))}"
    )
    if mode == "sync":
        lines.append(
            f"  mask blocks (torch.full) over the run: profiler {sum(g[1] for _, g in calls)}, "
            f"expected {sum(w[1] for w, _ in calls)} (one per request in a batch)"
        )
    bad = [i for i, (w, g) in enumerate(calls) if w != g]
    if bad:
        lines.append(f"  calls that differ: {[(i, calls[i]) for i in bad[:5]]}")
    return _result(prof, ok, lines, stored_hf_routed(mode, args.routed_from))


def stored_hf_routed(mode: str, folder: str | None = None) -> dict | None:
    """The routed result of ``hf_continuous_batching-<mode>.json`` in ``folder``, else in the
    latest stored run holding one."""
    name = f"hf_continuous_batching-{mode}.json"
    if folder:
        candidates = [Path(folder) / name]
    else:
        runs = sorted(
            (p for p in RESULTS.iterdir() if p.is_dir()), key=profiler._run_key, reverse=True
        )
        candidates = [p / name for p in runs]
    for path in candidates:
        if not path.is_file():
            continue
        res = json.loads(path.read_text())["modes"].get(mode)
        if not res:
            continue
        v = res["variants"]
        u, r = v["unmodified"], v["routed"]
        out = {
            "what": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name,
            "upload_method": res.get("upload_method"),
            "unmodified_step_ms": u["step_ms"]["median"],
            "routed_step_ms": r["step_ms"]["median"],
            "unmodified_upload_us": u["upload_us"]["median"],
            "routed_upload_us": r["upload_us"]["median"],
            "step_ratio": res.get("step_ratio"),
        }
        out["step_saved_us"] = (out["unmodified_step_ms"] - out["routed_step_ms"]) * 1e3
        out["upload_saved_us"] = out["unmodified_upload_us"] - out["routed_upload_us"]
        return out
    return None


# -- output ----------------------------------------------------------------------------------------


def _result(prof, ok: bool, lines: list, routed: dict | None) -> dict:
    """One program's outcome: ``ok`` (the counts match), ``lines`` (the check, the
    estimate, the routed result, as printed), ``report`` and ``skeleton`` (the
    profiler's), ``estimate``, ``routed``, ``sites`` (per call site: op, calls, bytes,
    waits, source) and ``steps``."""
    e = prof.estimate()
    est = {
        "copies_per_step": e.copies,
        "waits_per_step": e.waits,
        "host_saved_us": round(e.host_saved, 2),
        "gpu_saved_us": round(e.gpu_saved, 2),
        "measured_host_us": e.measured_host,
        "measured_wait_host_us": e.measured_wait_host,
        "costs": e.costs.source,
    }
    lines = list(lines)
    lines.append(
        f"estimate: merging saves ~{e.host_saved:.1f} us of host and ~{e.gpu_saved:.1f} us of GPU "
        f"time a step ({_g(e.copies)} copies a step; {_g(e.waits)} host waits a step would go"
        + (
            f", {e.measured_wait_host:.1f} us measured in them)"
            if e.measured_wait_host is not None
            else ")"
        )
    )
    if routed:
        lines.append("routed result: " + _routed_text(routed))
    else:
        lines.append("routed result: not measured here (needs CUDA)")
    return {
        "ok": ok,
        "lines": lines,
        "report": prof.report(),
        "skeleton": prof.skeleton(),
        "estimate": est,
        "routed": routed,
        "sites": [
            {
                "site": r.site,
                "function": r.function,
                "op": r.op,
                "upload": r.upload,
                "calls": sum(r.counts),
                "bytes": sum(r.nbytes),
                "waits": sum(r.waits),
                "source": r.source,
            }
            for r in prof.sites
        ],
        "steps": prof.steps,
    }


def _g(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _routed_text(r: dict) -> str:
    if "error" in r:
        return f"{r['what']}: did not run: {r['error']}"
    if "plain_host_us" in r:
        s = (
            f"{r['what']}: host a step plain {r['plain_host_us']:.1f} -> cucopy "
            f"{r['cucopy_host_us']:.1f} us (saves {r['host_saved_us']:.1f})"
        )
        if r.get("plain_gpu_us") is not None:
            s += f"; GPU a step {r['plain_gpu_us']:.1f} -> {r['cucopy_gpu_us']:.1f} us"
        if r.get("wall_saved_us") is not None:
            s += (
                f"; wall a step {r['plain_wall_us']:.1f} -> {r['cucopy_wall_us']:.1f} us "
                f"(saves {r['wall_saved_us']:.1f})"
            )
        return s
    return (
        f"{r['what']}: step {r['unmodified_step_ms'] * 1e3:.0f} -> {r['routed_step_ms'] * 1e3:.0f} "
        f"us (saves {r['step_saved_us']:.0f}, ratio {r['step_ratio']:.3f}); "
        f"{r['upload_method']} {r['unmodified_upload_us']:.1f} -> {r['routed_upload_us']:.1f} us "
        f"(saves {r['upload_saved_us']:.1f})"
    )


def main(argv=None) -> int:
    """Run the programs asked for; print and write what each profile found."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(RESULTS / "profile_programs"), help="output folder")
    p.add_argument("--programs", default=",".join(PROGRAMS), help=f"of {', '.join(PROGRAMS)}")
    p.add_argument("--steps", type=int, default=30, help="decode: steps profiled (default 30)")
    p.add_argument("--batch", type=int, default=32, help="decode: batch slots (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="decode: timed rounds (default 3)")
    p.add_argument("--requests", type=int, default=32, help="hf: requests (default 32)")
    p.add_argument("--new-tokens", type=int, default=64, help="hf: new tokens (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default=None,
        help="cuda, or a stand-in: meta, cpu (default: cuda if torch sees one, else meta)",
    )
    p.add_argument("--costs", default=None, help="the profiler's --costs (default: its own choice)")
    p.add_argument(
        "--routed-from", default=None, help="hf: a folder with hf_continuous_batching-<mode>.json"
    )
    args = p.parse_args(argv)
    progs = [x for x in args.programs.split(",") if x]
    unknown = sorted(set(progs) - set(PROGRAMS))
    if unknown:
        p.error(f"unknown programs {unknown}; known: {', '.join(PROGRAMS)}")
    if args.steps < 1 or args.requests < 1 or args.new_tokens < 1 or args.rounds < 0:
        p.error("--steps, --requests and --new-tokens must be >= 1, --rounds >= 0")
    import torch

    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda else "meta")
    if device == "cuda" and not cuda:
        p.error("--device cuda: torch sees no CUDA device (use --device meta)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, ok = {}, True
    for name in progs:
        if name.startswith("hf_") and device != "cuda" and (name, device) != ("hf_sync", "cpu"):
            msg = (
                f"{name}: skipped: transformers' continuous batching needs CUDA (device {device!r})"
            )
            print(msg, flush=True)
            results[name] = {"skipped": msg}
            continue
        try:
            if name == "decode":
                res = profile_decode(args, device)
            else:
                res = profile_hf(args, name[3:], device)
        except SystemExit as exc:  # the hf example's own message (transformers missing)
            msg = f"{name}: skipped: {exc}"
            print(msg, flush=True)
            results[name] = {"skipped": msg}
            continue
        ok &= res["ok"]
        text = res["report"] + "\n" + "\n".join(res["lines"]) + "\n"
        (out / f"{name}.txt").write_text(text)
        (out / f"{name}-skeleton.py").write_text(res["skeleton"])
        print(f"== {name} ==\n{text}", flush=True)
        results[name] = {k: v for k, v in res.items() if k not in ("report", "skeleton")}
    summary = {
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "torch": torch.__version__,
        "cucopy": cucopy.__version__,
        "programs": results,
        "all_match": ok,
    }
    (out / "profile_programs.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    ran = [n for n, r in results.items() if "skipped" not in r]
    for name in ran:  # one line each: the check, the estimate, the routed result
        r = results[name]
        est, routed = r["estimate"], r["routed"]
        meas = "-"
        if routed and "host_saved_us" in routed:
            meas = f"host {routed['host_saved_us']:.1f}"
            if routed.get("wall_saved_us") is not None:
                meas += f", wall {routed['wall_saved_us']:.1f}"
        elif routed and "step_saved_us" in routed:
            meas = f"step {routed['step_saved_us']:.0f}, {routed['upload_method']} "
            meas += f"{routed['upload_saved_us']:.1f}"
        print(
            f"  {name:9} {'match' if r['ok'] else 'DIFFER':6} {_g(est['copies_per_step']):>5} "
            f"copies a step; estimate saves host {est['host_saved_us']:.1f}, GPU "
            f"{est['gpu_saved_us']:.1f} us a step; routed saved (us a step): {meas}",
            flush=True,
        )
    print(
        f"profile_programs: {'all counts match' if ok else 'COUNTS DIFFER'} "
        f"({', '.join(ran) or 'nothing ran'}); wrote {out}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
