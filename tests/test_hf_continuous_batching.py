"""examples/hf_continuous_batching.py on the CPU: the seam into transformers and its site map.

Also bench/hf_ab.py, its A/B harness, run on the CPU.

No GPU here, so no cucopy copier: the route runs with the example's ``PlainCopier`` (each
call done at once on CPU tensors) and these tests check what the route asks of it.
Sync mode runs ``generate_batch`` itself on the CPU; async mode's ``HostDeviceIOPair``
is driven directly (its engine object needs CUDA streams to be built).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from math import ceil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("psutil")  # transformers sizes a CPU cache from psutil's memory figures
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_continuous_batching.py"
HARNESS = ROOT / "bench" / "hf_ab.py"


@pytest.fixture(scope="module")
def ex():
    sys.path.insert(0, str(ROOT))
    try:
        spec = importlib.util.spec_from_file_location("_example_hf_continuous_batching", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("_example_hf_continuous_batching", None)
        sys.path.remove(str(ROOT))


@pytest.fixture(scope="module")
def ab(ex):
    """bench/hf_ab.py (it imports the seam by its own name)."""
    spec = importlib.util.spec_from_file_location("_bench_hf_ab", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("_bench_hf_ab", None)


def small_args(ex, **kw):
    args = {
        "seed": 0,
        "requests": 6,
        "new_tokens": 6,
        "block_size": 16,
        "num_blocks": 24,
        "max_batch_tokens": 80,  # > 64, the padded query length: a carry-over tail
    }
    args.update(kw)
    return SimpleNamespace(**args)


@pytest.fixture(scope="module")
def engine(ex):
    """A tiny Llama on the CPU with a kept sync-mode manager (built by one generate_batch)."""
    from transformers import GenerationConfig

    args = small_args(ex)
    model = ex.make_model(args, torch.device("cpu"))
    prompts = ex.make_prompts(args)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1)
    cb = ex.cb_config(args, "sync")

    def generate():
        out = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, persistent_manager=True
        )
        assert all(r.error is None for r in out.values())
        return [list(r.generated_tokens) for r in out.values()]

    reference = generate()
    processor = model.init_continuous_batching().batch_processor
    yield SimpleNamespace(model=model, processor=processor, generate=generate, reference=reference)
    model.destroy_cached_continuous_batching_manager()


def device_state(io) -> dict:
    """Every buffer a step's preparation writes, cloned (``output_ids`` apart)."""
    tokens = io.input_ids.numel()
    out = {
        "_bulk_input_tensor": io._bulk_input_tensor[:, : tokens + 1].clone(),
        "write_index_storage": io.write_index_storage.clone(),
        "read_index_storage": io.read_index_storage.clone(),
        "block_table": io.block_table.clone(),
    }
    for layer_type, mask in (io.attention_mask or {}).items():
        out[f"attention_mask[{layer_type}]"] = mask.clone()
    return out


def routed_run(engine, route):
    """One routed generate_batch; after every prepare_batch_tensors, where the device
    buffers differ from the host twin's (the engine's own preparation), if anywhere."""
    io = engine.processor.inputs_and_outputs
    differences = []

    def prepare(*a, **kw):
        type(io).prepare_batch_tensors(io, *a, **kw)
        dev, host = device_state(io), device_state(route.host_twin)
        diff = [name for name in dev if not torch.equal(dev[name], host[name])]
        b = min(io.num_q_tokens, io.max_requests_per_batch)
        if io.output_ids[:, :b].any():  # the engine zeroes them on the device
            diff.append("output_ids")
        differences.append(diff)

    io.prepare_batch_tensors = prepare
    try:
        with route:
            tokens = engine.generate()
    finally:
        del io.prepare_batch_tensors
    return tokens, differences


def within(view, base) -> bool:
    """Whether ``view``'s bytes lie inside ``base``'s."""
    lo = base.data_ptr()
    hi = lo + base.numel() * base.element_size()
    first = view.data_ptr()
    last = first + sum((n - 1) * s for n, s in zip(view.shape, view.stride())) * view.element_size()
    return lo <= first and last < hi


# -- the pin and the plan ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [EXAMPLE, HARNESS], ids=["example", "harness"])
def test_docstring_has_usage(path):
    text = path.read_text()
    assert '"""' in text.splitlines()[0]
    assert "Usage:" in text.split('"""')[1]


def test_another_transformers_release_is_refused(ex):
    assert ex.TRANSFORMERS_VERSION == "5.17.0"
    ex.check_transformers_version("5.17.0")
    with pytest.raises(
        RuntimeError, match=r"written against transformers 5\.17\.0.*found transformers 5\.18\.0"
    ):
        ex.check_transformers_version("5.18.0")


def test_plan_merges_every_site_and_each_site_names_its_buffer(ex):
    assert ex.PLAN.merge == frozenset(ex.Site)
    assert ex.PLAN.flush_after == frozenset()
    assert set(ex.SITE_BUFFERS) == set(ex.Site)
    fills = {s for s in ex.Site if s.direction is ex.cc.FILL}
    assert fills == {ex.Site.OUTPUT_RESET}


def test_copy_accumulators_is_the_scalar_half_of_the_engines_transfer(ex, engine):
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    assigned = re.compile(r"^\s*(?:other|dst)\.(\w+) = ", re.M)
    engine_names = set(assigned.findall(inspect.getsource(ContinuousBatchingIOs._transfer_inputs)))
    ours = set(assigned.findall(inspect.getsource(ex.copy_accumulators)))
    assert engine_names == ours

    # and the values: the host twin of a routed run holds a prepared batch
    route = ex.CucopyRoute(engine.processor, ex.PlainCopier())
    with route:
        engine.generate()
    twin = route.host_twin
    a = ContinuousBatchingIOs.__new__(ContinuousBatchingIOs)
    b = ContinuousBatchingIOs.__new__(ContinuousBatchingIOs)
    for t in (a, b):  # the tensors _transfer_inputs copies into
        for name in (
            "_bulk_input_tensor",
            "write_index_storage",
            "read_index_storage",
            "block_table",
        ):
            setattr(t, name, getattr(twin, name).clone())
        t.attention_mask = None
    twin._transfer_inputs(a, stream=None)
    ex.copy_accumulators(twin, b)
    for name in engine_names:
        assert getattr(a, name) == getattr(b, name), name


# -- sync mode: generate_batch itself, on the CPU ----------------------------------------------------


@pytest.mark.parametrize("in_place_min_bytes", [0, 1 << 40], ids=["in_place", "merged"])
def test_sync_routed_run_writes_what_the_engine_prepares(ex, engine, in_place_min_bytes):
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    io = engine.processor.inputs_and_outputs
    copier = ex.PlainCopier()
    route = ex.CucopyRoute(engine.processor, copier, in_place_min_bytes=in_place_min_bytes)
    tokens, differences = routed_run(engine, route)

    assert tokens == engine.reference
    assert route.phases == []  # untimed: no clock readings in the upload
    assert len(differences) > 3
    # every step, the device holds exactly what the engine's preparation wrote on the
    # host twin: what its unmodified step writes into the device buffers directly
    assert differences == [[]] * len(differences)
    # the seam ran: one copier step per prepare_batch_tensors, and it is undone
    assert copier.steps == len(differences)
    assert type(io) is ContinuousBatchingIOs and not hasattr(io, "_cucopy_route")

    # the site map: each call writes into the engine buffer its site names
    seen = set()
    for site, dst in copier.calls:
        seen.add(site)
        base = getattr(io, ex.SITE_BUFFERS[site])
        bases = list(base.values()) if isinstance(base, dict) else [base]
        assert any(within(dst, b) for b in bases), (site, dst.shape)
    sync_sites = set(ex.Site) - {ex.Site.CARRY_OVER, ex.Site.BLOCK_TABLE}
    assert seen == sync_sites  # every upload went to the copier: no side copies
    steps = len(differences)
    if in_place_min_bytes == 0:
        # every mask block (and bulk block) went in place, each through its buffer's guard
        assert route.in_place[ex.Site.MASK] == copier.guarded[ex.Site.MASK] == steps
        assert route.in_place[ex.Site.BULK] == copier.guarded[ex.Site.BULK] == steps
        assert {g.label for g in route.guards} >= {
            "host bulk",
            "host attention_mask[full_attention]",
        }
    else:
        assert not route.in_place and not copier.guarded and not route.guards


def test_a_timed_route_records_each_uploads_phases(ex, engine):
    copier = ex.PlainCopier()
    route = ex.CucopyRoute(engine.processor, copier, in_place_min_bytes=0)
    route.timed = True
    tokens, differences = routed_run(engine, route)
    assert tokens == engine.reference and differences == [[]] * len(differences)
    # one (begin, staging, in-place copies, flush) tuple of ns per upload
    assert len(route.phases) == copier.steps == len(differences)
    assert all(len(p) == 4 and min(p) >= 0 for p in route.phases)
    assert all(p[2] > 0 for p in route.phases)  # every step's mask went in place


@pytest.mark.parametrize(
    "site, buffer",
    [
        ("BULK", "_bulk_input_tensor"),
        ("MASK", "attention_mask[full_attention]"),
        ("OUTPUT_RESET", "output_ids"),
    ],
)
@pytest.mark.parametrize("min_bytes", [0, 1 << 40], ids=["in_place", "merged"])
def test_sync_seam_broken_is_caught(ex, engine, site, buffer, min_bytes):
    dropped = ex.Site[site]

    class Drops(ex.PlainCopier):
        def copy(self, site, dst, src, **kw):
            return False if site is dropped else super().copy(site, dst, src, **kw)

        def fill_tail(self, site, dst, start, value, **kw):
            return False if site is dropped else super().fill_tail(site, dst, start, value, **kw)

    route = ex.CucopyRoute(engine.processor, Drops(), in_place_min_bytes=min_bytes)
    _, differences = routed_run(engine, route)
    assert any(buffer in d for d in differences), differences


def test_null_copier_routes_every_site_and_writes_nothing(ex, ab, engine):
    # --bound's no_upload variant: the route runs, every site is asked, nothing lands
    null = ab.NullCopier()
    route = ex.CucopyRoute(engine.processor, null, in_place_min_bytes=ab.NO_IN_PLACE)
    _, differences = routed_run(engine, route)
    assert null.steps == len(differences) > 3
    assert set(null._counts) == set(ex.Site) - {ex.Site.CARRY_OVER, ex.Site.BLOCK_TABLE}
    assert not route.in_place and not route.guards and not null.calls
    assert any(differences)  # the device kept stale inputs


def test_sync_route_needs_a_copier_on_the_cpu(ex, engine):
    with pytest.raises(ValueError, match="runs on the CPU; pass copier=PlainCopier"):
        ex.CucopyRoute(engine.processor)


# -- async mode: the engine's HostDeviceIOPair, driven directly ---------------------------------------


class FakeStream:
    """Stands in for the engine's CUDA streams (records and waits nothing)."""

    def record_event(self, event):
        pass

    def wait_event(self, event):
        pass


def async_ios(engine):
    """A ContinuousBatchingAsyncIOs over two CPU IO pairs (its own __init__ needs CUDA)."""
    from transformers.generation.continuous_batching.input_outputs import (
        ContinuousBatchingAsyncIOs,
        HostDeviceIOPair,
    )

    p = engine.processor
    io = ContinuousBatchingAsyncIOs.__new__(ContinuousBatchingAsyncIOs)
    io.io_pairs = [
        HostDeviceIOPair(
            cache=p.cache,
            config=p.config,
            continuous_batching_config=p.cb_config,
            device=torch.device("cpu"),
            model_dtype=p.model_dtype,
            logit_processor=p.logit_processor,
        )
        for _ in range(2)
    ]
    io.current_pair = 0
    io.h2d_stream, io.d2h_stream, io.compute_stream = FakeStream(), FakeStream(), FakeStream()
    io.max_batch_tokens = p.cache.max_batch_tokens
    # sdpa masks, as in a run (outside one the model's config no longer asks for them)
    for pair in io.io_pairs:
        for side in (pair.host_io, pair.device_io):
            if side.attention_mask is None:
                tokens = side.write_index_storage.shape[1]
                shape = (1, 1, tokens, side.read_index_storage.shape[1])
                side.attention_mask = {
                    k: torch.empty(shape, dtype=p.model_dtype) for k in side.cumulative_seqlens_k
                }
                side._reset_static_tensors(full_reset=True)
    return io


def poison(io) -> None:
    """Fill every device buffer with a value no step writes."""
    tensors = (io._bulk_input_tensor, io.write_index_storage, io.read_index_storage)
    for t in (*tensors, io.output_ids, io.block_table):
        t.fill_(0x5A5A5A5A)
    for mask in (io.attention_mask or {}).values():
        mask.fill_(123.0)


def differences(a, b, where="kwargs") -> list:
    """Where two get_model_kwargs results differ (tensors exactly; the cache object aside)."""
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [where]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [where]
        return [d for k in a if k != "cache" for d in differences(a[k], b[k], f"{where}[{k}]")]
    if isinstance(a, list):
        if len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def async_steps(
    ex, engine, copier, num, query, past, steps=3, fast_path=False, min_bytes=1 << 10, poke=None
) -> list:
    """Drive the engine's async IO pairs for ``steps`` steps through a route; per step,
    where what the model is given differs from what the host prepared. ``fast_path``:
    the decode fast path (block table; needs IO pairs made with max_blocks_per_request).
    ``min_bytes``: the route's ``in_place_min_bytes``. ``poke(step, io)``: called after
    each step's upload."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    io = async_ios(engine)
    route = ex.CucopyRoute(
        SimpleNamespace(inputs_and_outputs=io), copier, in_place_min_bytes=min_bytes
    )
    assert route.is_async and route.stream is io.h2d_stream
    status = RequestStatus.DECODING if query == 1 else RequestStatus.PREFILLING
    out = []
    with route:  # as the engine runs: its host writes inside the guards' write()
        for k in range(steps):  # both pairs, then the first again (carry-over across pairs)
            out.append(async_step(engine, io, num, query, past, status, fast_path))
            if poke is not None:
                poke(k, io)
            io.swap_io_pairs()
    assert type(io).__name__ == "ContinuousBatchingAsyncIOs"
    assert all(type(pair).__name__ == "HostDeviceIOPair" for pair in io.io_pairs)
    return out


@pytest.mark.parametrize("given, want", [(None, "mapped"), ("auto", "auto"), ("dma", "dma")])
def test_an_async_route_makes_a_mapped_copier_unless_told_otherwise(
    ex, engine, monkeypatch, given, want
):
    # async: the upload overlaps compute, so the route's own copier spares the host
    # (graphed launches); a flush_mode passed in is the one used
    made = []

    class Made:
        def __init__(self, plan, **kw):
            made.append((plan, kw))
            self.backend = SimpleNamespace(is_pinned=lambda ptr: False)

    monkeypatch.setattr(ex.cc, "DeviceCopier", Made)
    io = async_ios(engine)
    io.h2d_stream.device = SimpleNamespace(index=0)
    opts = {} if given is None else {"flush_mode": given}
    route = ex.CucopyRoute(SimpleNamespace(inputs_and_outputs=io), **opts)
    assert isinstance(route.copier, Made)
    [(plan, kw)] = made
    assert plan is ex.PLAN and kw["stream"] is io.h2d_stream and kw["flush_mode"] == want


def async_step(engine, io, num, query, past, status, fast_path) -> list:
    """One async step (prepare, then the engine's get_model_kwargs, which uploads)."""
    from transformers.generation.continuous_batching.utils import (
        create_warmup_future_states,
        pad_to_interval,
        pad_to_pow2,
    )

    p = engine.processor
    cache = p.cache
    states = create_warmup_future_states(num, status, query, past, cache)
    assert len(states) == num
    try:
        if fast_path:  # as ModelRunner.maybe_pad_inputs pads the decode fast path
            q, kv = pad_to_pow2(num, p.cb_config.max_requests_per_batch), 0
        else:
            q = pad_to_interval(
                num * query, p.cb_config.q_padding_interval_size, cache.max_batch_tokens
            )
            kv = pad_to_interval(num * past, p.cb_config.kv_padding_interval_size, cache.num_pages)
        pair = io.io_pairs[io.current_pair]
        poison(pair.device_io)
        io.prepare_batch_tensors(states, p.logit_processor, fast_path, q, kv, use_padding=True)
        assert pair.host_io.use_block_table == fast_path
        got = io.get_model_kwargs(use_padding=True)  # the engine calls transfer_inputs_h2d
        want = pair.host_io.get_model_kwargs(use_padding=True)
        diff = differences(dict(got), dict(want))
        if fast_path:  # the engine uploads no KV indices then either: the block table is read
            diff = [
                d for d in diff if not d.startswith(("kwargs[write_index]", "kwargs[read_index]"))
            ]
        # the graph indexes the whole carry-over row
        if not torch.equal(pair.device_io.carry_over_ids, pair.host_io.carry_over_ids):
            diff.append("carry_over_ids")
        return diff
    finally:
        for s in states:
            cache.free_blocks(s.state.request_id)


@pytest.mark.parametrize(
    "num, query, past", [(3, 5, 0), (4, 1, 40), (2, 9, 17), (5, 1, 0)], ids=lambda v: str(v)
)
def test_async_pair_upload_gives_the_model_what_the_host_prepared(ex, engine, num, query, past):
    copier = ex.PlainCopier()
    assert async_steps(ex, engine, copier, num, query, past) == [[]] * 3
    assert copier.steps == 3
    sites = {
        ex.Site.BULK,
        ex.Site.CARRY_OVER,
        ex.Site.WRITE_INDEX,
        ex.Site.READ_INDEX,
        ex.Site.MASK,
    }
    assert {s for s, _ in copier.calls} >= sites
    assert copier.guarded[ex.Site.MASK] == 3  # the mask went in place (1 KiB and more)


def test_async_decode_fast_path_uploads_the_block_table(ex, engine, monkeypatch):
    # the block table exists with flash attention on CUDA only; here the cache is told it
    # may hold 4 blocks a request before the IO pairs are made
    monkeypatch.setattr(engine.processor.cache, "max_blocks_per_request", 4)
    copier = ex.PlainCopier()
    out = async_steps(ex, engine, copier, 3, 1, 40, fast_path=True)
    assert out == [[]] * 3
    assert ex.Site.BLOCK_TABLE in {s for s, _ in copier.calls}

    class Drops(ex.PlainCopier):
        def copy(self, site, dst, src, **kw):
            return False if site is ex.Site.BLOCK_TABLE else super().copy(site, dst, src, **kw)

    assert any(async_steps(ex, engine, Drops(), 3, 1, 40, steps=2, fast_path=True))


@pytest.mark.parametrize("site", ["BULK", "CARRY_OVER", "WRITE_INDEX", "READ_INDEX", "MASK"])
def test_async_seam_broken_is_caught(ex, engine, site):
    dropped = ex.Site[site]

    class Drops(ex.PlainCopier):
        def copy(self, site, dst, src, **kw):
            return False if site is dropped else super().copy(site, dst, src, **kw)

        def fill_tail(self, site, dst, start, value, **kw):
            return False if site is dropped else super().fill_tail(site, dst, start, value, **kw)

    assert any(async_steps(ex, engine, Drops(), 4, 3, 40, steps=2))


def test_async_pair_refuses_another_stream(ex, engine):
    io = async_ios(engine)
    route = ex.CucopyRoute(SimpleNamespace(inputs_and_outputs=io), ex.PlainCopier())
    with route, pytest.raises(ex.cc.CopyError, match="h2d_over event would not cover"):
        io.io_pairs[0].transfer_inputs_h2d(FakeStream())


# -- the script ----------------------------------------------------------------------------------


def test_example_on_the_cpu():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--cpu", "--requests", "4", "--new-tokens", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "match: sync mode, 4 requests" in proc.stdout
    assert "PlainCopier" in proc.stdout


def test_build_manager_gives_a_kept_manager_to_route(ex):
    with ex.build_manager("sync", 3, requests=2, device="cpu") as engine:
        assert len(engine.reference) == 2 and all(len(t) == 3 for t in engine.reference)
        copier = ex.PlainCopier()
        with ex.CucopyRoute(engine.processor, copier):
            assert engine.generate() == engine.reference
        assert copier.steps >= 3
    with pytest.raises(ValueError, match="async batching needs a CUDA device"):
        ex.build_manager("async", device="cpu")
    with pytest.raises(ValueError, match="mode must be 'async' or 'sync', got 'fast'"):
        ex.build_manager("fast")


def test_harness_on_the_cpu(tmp_path):
    out = tmp_path / "hf.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            "--cpu",
            "--requests",
            "5",
            "--new-tokens",
            "5",
            "--pairs",
            "1",
            "--max-batch-tokens",
            "32",
            "--bound",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert "match: tokens identical" in proc.stdout, report
    assert "MISMATCH" not in proc.stdout + proc.stderr, report
    data = json.loads(out.read_text())
    assert data["match"] is True
    res = data["modes"]["sync"]
    assert res["tokens_identical"] is True
    assert [r["variant"] for r in res["runs"]] == ["unmodified", "routed", "no_upload"]
    assert all(r["step_ms"] and r["upload_us"] for r in res["runs"])
    assert res["variants"]["routed"]["step_ms"]["median"] > 0
    # --bound: the no_upload variant ran, its tokens were not compared, and its floor
    # is reported beside the target
    assert [r["tokens_identical"] for r in res["runs"]] == [True, True, None]
    bound = res["bound"]
    assert bound["step_ratio"] > 0 and len(bound["step_ratio_per_round"]) == 1
    assert bound["from_hooks"] > 0 and len(bound["from_hooks_per_round"]) == 1
    assert "bound (no upload at all" in proc.stdout, report
    # the routed uploads' phases, one sample per timed routed upload
    phases = res["routed_phases_us"]
    assert set(phases) == {"begin", "staging", "in_place_copies", "flush"}
    uploads = sum(len(r["upload_us"]) for r in res["runs"] if r["variant"] == "routed")
    assert all(len(p["samples"]) == uploads for p in phases.values())
    assert phases["staging"]["median"] > 0
    assert "routed upload by phase" in proc.stdout, report
    assert "in place copies" in proc.stdout, report
    # the upload method's own ratio, per round, beside its target
    assert res["upload_target_ratio"] == 0.95 and res["upload_target_met"] is None
    assert len(res["upload_ratio_per_round"]["routed"]) == 1 and res["upload_ratio"] > 0
    assert "routed/unmodified prepare_batch_tensors time" in proc.stdout, report
    assert res["config"]["in_place_min_bytes"] == 64 << 10
    assert "in_place_copies" in res
    assert data["environment"]["transformers"] == "5.17.0"
    assert ceil(res["step_ratio"] * 1000) > 0


# -- the guards' fence, checked by a real (simulated) cucopy copier ----------------------------------


class TeeCopier:
    """The example's ``PlainCopier`` for the engine, and each guarded copy also issued
    through a real cucopy copier on a simulated device (into scratch destinations), with
    the route's own ``HostGuard``: what check mode sees of the route's fence."""

    def __new__(cls, ex):
        from cucopy.backends.sim import SimDevice

        class Tee(ex.PlainCopier):
            def __init__(self):
                super().__init__()
                self.dev = SimDevice()
                self.sim = ex.cc.DeviceCopier(ex.PLAN, stream=self.dev.stream(), device=self.dev)
                self._scratch: dict = {}
                self._pinned: set = set()

            @contextlib.contextmanager
            def step(self):
                with super().step(), self.sim.step():
                    yield

            def copy(self, site, dst, src, *, guard=None, **kw):
                super().copy(site, dst, src, guard=guard, **kw)
                if guard is not None:
                    if id(guard) not in self._pinned:  # the engine's host buffer, pinned
                        self.dev._register_pinned(guard.buffer)
                        self._pinned.add(id(guard))
                    key = (src.shape, src.dtype.str)
                    if key not in self._scratch:
                        self._scratch[key] = self.dev.empty(src.shape, src.dtype)
                    self.sim.copy(site, self._scratch[key], src, guard=guard)
                return True

            def close(self):
                self.sim.close()

        return Tee()


def test_sync_routed_run_fences_every_host_write_in_check_mode(ex, engine, monkeypatch):
    from cucopy import check

    monkeypatch.setattr(check, "CHECK_MODE", True)
    tee = TeeCopier(ex)
    route = ex.CucopyRoute(engine.processor, tee, in_place_min_bytes=0)
    try:
        tokens, diffs = routed_run(engine, route)  # a write outside write() fails a request
    finally:
        route.close()
    assert tokens == engine.reference
    assert diffs == [[]] * len(diffs) and len(diffs) > 3
    sites = tee.sim.stats.sites
    assert sites[ex.Site.MASK].fallback["in_place"] == len(diffs)
    assert sites[ex.Site.BULK].fallback["in_place"] == len(diffs)


def test_async_host_write_outside_the_guard_is_caught_in_check_mode(ex, engine, monkeypatch):
    from cucopy import check

    monkeypatch.setattr(check, "CHECK_MODE", True)
    tee = TeeCopier(ex)
    # the engine's own writes all go through the guards: clean, and every mask in place
    assert async_steps(ex, engine, tee, 3, 5, 0, min_bytes=0) == [[]] * 3
    assert tee.sim.stats.sites[ex.Site.MASK].fallback["in_place"] == 3

    def poke(step, io):
        if step == 0:  # the mask a copy just read, written without write()
            mask = io.io_pairs[io.current_pair].host_io.attention_mask["full_attention"]
            mask[0, 0, 0, 0] = 7.0

    tee = TeeCopier(ex)
    with pytest.raises(ex.cc.CopyError, match=r"MASK.*host attention_mask.*without HostGuard"):
        async_steps(ex, engine, tee, 3, 5, 0, min_bytes=0, poke=poke)
