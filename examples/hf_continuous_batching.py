"""transformers' continuous batching (``generate_batch``), its per-step uploads routed through cucopy.

Usage:
    python examples/hf_continuous_batching.py [--mode async|sync|both] [--requests 32]
        [--new-tokens 64] [--pairs 5] [--bound] [--json PATH]
    python examples/hf_continuous_batching.py --cpu [--requests 8] [--new-tokens 8]  # no GPU

A real engine written elsewhere, run unmodified and routed through cucopy: Hugging Face
transformers' continuous batching (written against transformers 5.17.0, checked at
import), a tiny random-weight ``LlamaForCausalLM`` fed token ids (nothing downloaded),
greedy decoding. Both of its upload paths are routed:

- **async** (``use_async_batching=True, use_cuda_graph=True``): the host prepares a
  batch in pinned buffers (``HostDeviceIOPair.host_io``), then
  ``HostDeviceIOPair.transfer_inputs_h2d(h2d_stream)`` copies them whole with
  ``copy_(non_blocking=True)`` and the engine records ``h2d_over`` on that stream, which
  the compute stream waits on. Routed: the same method stages this step's regions into
  one cucopy segment on the engine's ``h2d_stream`` and flushes it before it returns, so
  the engine's event lands after it.
- **sync** (the default without flash-attn): ``ContinuousBatchingIOs.prepare_batch_tensors``
  fills the device buffers directly: reset kernels, an attention mask built on the device
  request by request, and seven ``torch.tensor(list, device="cuda")`` uploads, each of
  which waits for the device. Routed: the engine's own ``prepare_batch_tensors`` runs on a
  host twin (a CPU ``ContinuousBatchingIOs``, what async mode's ``host_io`` is), then this
  step's regions go up as one cucopy segment on the engine's compute stream.

The seam is :class:`CucopyRoute`: it retypes the engine's own IO objects to two
subclasses that override only the upload method (:class:`RoutedIOPair`,
:class:`RoutedIOs`), and back. Nothing of torch or transformers is patched; every
other reference the engine holds sees the same objects.

What goes up is what the step's ``prepare_batch_tensors`` rewrote on the host (its reset
ranges, which hold everything it writes), one named :class:`Site` per buffer; padded
tails of the KV index buffers are ``fill_tail`` fills, and an attention-mask block of
``--raw-min-bytes`` or more is one plain async copy from the engine's pinned buffer on
the same stream instead of a snapshot (the engine already fences that buffer: see
:class:`CucopyRoute`).

The script runs ``generate_batch`` once to build and warm the engine (kept as a
persistent manager), then ``--pairs`` rounds of one run per variant, the order rotated
each round (AB, BA, ...): ``unmodified``, ``routed`` and, in sync mode on a GPU,
``twin_plain`` (the routed step's host twin uploaded with a plain ``copy_``/``fill_``
per region: what the twin alone gains, apart from cucopy). ``--bound`` adds
``no_upload``: the routed step with every upload left out (stale device inputs, so its
tokens are not compared), the floor under any upload path's step ratio in that run,
printed beside the target. Every other run is checked token
for token against the first; then one routed run in cucopy's check mode. It prints per-step host time (the median interval between
generation steps, and the time in the upload method), wall time per run,
``copier.stats``, and ``match:`` (or ``MISMATCH:`` lines and exit status 1).
``--json PATH`` writes the environment, the configuration, every raw timing and the
stats.

``--cpu`` (no GPU; sync mode only) drives the same seam with :class:`PlainCopier`, a
stand-in that runs each call at once on CPU tensors: it checks the routing and the site
map, not cucopy's merging (CI runs it; the CUDA path needs a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import logging
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script: make ``cucopy`` and ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import cucopy as cc  # noqa: E402
from cucopy import check  # noqa: E402

#: The transformers release this integration was written against: the seam overrides
#: methods whose bodies it mirrors, so another release is refused, not guessed at.
TRANSFORMERS_VERSION = "5.17.0"


def check_transformers_version(installed: str) -> None:
    """Refuse any transformers release but :data:`TRANSFORMERS_VERSION`.

    Parameters
    ----------
    installed : str
        ``transformers.__version__``.

    Raises
    ------
    RuntimeError
        When ``installed`` is another release.
    """
    if installed != TRANSFORMERS_VERSION:
        raise RuntimeError(
            f"hf_continuous_batching: written against transformers {TRANSFORMERS_VERSION} "
            f"(its continuous batching internals: HostDeviceIOPair.transfer_inputs_h2d, "
            f"ContinuousBatchingIOs.prepare_batch_tensors and _transfer_inputs), found "
            f"transformers {installed}; install it with pip install "
            f'"transformers=={TRANSFORMERS_VERSION}" (or pip install -e ".[hf]"), or '
            "re-read those methods and update the seam"
        )


try:
    import transformers  # noqa: E402
except ImportError as exc:  # pragma: no cover - the message is the point
    raise SystemExit(
        f"hf_continuous_batching needs transformers=={TRANSFORMERS_VERSION}: "
        f'pip install -e ".[hf]" ({exc})'
    ) from None
check_transformers_version(transformers.__version__)

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.input_outputs import (  # noqa: E402
    ContinuousBatchingAsyncIOs,
    ContinuousBatchingIOs,
    HostDeviceIOPair,
)

#: A mask block at least this large is copied raw (see :class:`CucopyRoute`): snapshotting
#: the 0.8-1 MB sdpa mask cost ~0.2 ms of host time a step (issue 17's first attempt), more
#: than the whole unmodified upload (0.11 ms); a raw cudaMemcpyAsync costs ~2 us (run 26).
RAW_MIN_BYTES = 64 << 10


# -- the site map and the plan -----------------------------------------------------------------


class Site(cc.CopySite):
    """One member per engine buffer a step uploads."""

    BULK = (
        cc.H2D
    )  # input ids, positions, cu_seqlens q/k, logits indices, carry-over, processor args
    CARRY_OVER = cc.H2D  # async: the rest of the carry-over row, which the graph indexes whole
    WRITE_INDEX = cc.H2D  # KV-cache slots the step writes, per layer group
    WRITE_PAD = cc.FILL  # ... and their padded tail (the cache's write trash index)
    READ_INDEX = cc.H2D  # KV-cache slots the step reads, per layer group
    READ_PAD = cc.FILL  # ... and their padded tail (the read trash index)
    BLOCK_TABLE = cc.H2D  # decode fast path (flash attention): pages per request
    OUTPUT_RESET = (
        cc.FILL
    )  # sync: output_ids[:, :b] = 0, which the engine's step does on the device
    MASK = cc.H2D  # eager/sdpa attention mask rows, when under RAW_MIN_BYTES


#: Which engine buffer (a ``ContinuousBatchingIOs`` attribute) each site writes.
SITE_BUFFERS = {
    Site.BULK: "_bulk_input_tensor",
    Site.CARRY_OVER: "_bulk_input_tensor",
    Site.WRITE_INDEX: "write_index_storage",
    Site.WRITE_PAD: "write_index_storage",
    Site.READ_INDEX: "read_index_storage",
    Site.READ_PAD: "read_index_storage",
    Site.BLOCK_TABLE: "block_table",
    Site.OUTPUT_RESET: "output_ids",
    Site.MASK: "attention_mask",
}

# Every site merges and none is a barrier. The plan comes from the buffers' readers: the
# only device work that reads them is the model's forward, which the engine orders after
# the upload (async: on the compute stream, after h2d_over, recorded after the step's
# flush; sync: on the same stream as the copier, after the flush), and the work that read
# them last is fenced by the engine before the host prepares them again (async: the IO
# pair's d2h_over is synchronized before its host buffers are refilled; sync: the compute
# stream is synchronized every step). The graph's carry-over writes input_ids on the
# compute stream, after the barrier. So nothing touches a destination between a copy and
# the step's final flush: one segment, one launch a step.
PLAN = cc.CopyPlan(merge=set(Site))


def copy_accumulators(src, dst) -> None:
    """Copy the step's host-side scalars from ``src`` to ``dst`` (two ``ContinuousBatchingIOs``).

    The non-tensor half of transformers 5.17.0's ``ContinuousBatchingIOs._transfer_inputs``
    (tests/test_hf_continuous_batching.py compares the two).

    Parameters
    ----------
    src, dst : ContinuousBatchingIOs
    """
    dst.num_q_tokens = src.num_q_tokens
    dst.max_kv_read = src.max_kv_read
    dst.num_request_in_batch = src.num_request_in_batch
    dst.true_read_sizes = src.true_read_sizes[:]
    dst.true_write_sizes = src.true_write_sizes[:]
    dst.use_block_table = src.use_block_table
    dst.total_seqlen_q = src.total_seqlen_q
    dst.total_seqlen_k = dict(src.total_seqlen_k)
    dst.max_seqlen_q = src.max_seqlen_q
    dst.max_seqlen_k = dict(src.max_seqlen_k)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Buffers:
    """A host ``ContinuousBatchingIOs`` and the device one it uploads into, as views made once.

    Host sides are NumPy views (cucopy's fastest source); device views made per step are
    cached by their length (torch slicing costs ~1-2 us a view; decode steps repeat them).
    """

    def __init__(self, host, dev):
        self.host, self.dev = host, dev
        self.tokens = host.input_ids.numel()  # max_batch_tokens
        self.h_bulk = host._bulk_input_tensor.numpy()
        self.h_write = host.write_index_storage.numpy()
        self.h_read = host.read_index_storage.numpy()
        self.h_table = host.block_table.numpy()
        self.d_bulk = dev._bulk_input_tensor
        self.d_write = list(dev.write_index_storage)
        self.d_read = list(dev.read_index_storage)
        self.d_table = list(dev.block_table)
        self.d_out = list(dev.output_ids)
        self.write_trash = int(dev._write_trash_index)
        self.read_trash = int(dev._read_trash_index)
        self.masks = []  # (host tensor 2-D, host numpy 2-D, device tensor 2-D), same-size ints
        if dev.attention_mask is not None:
            for layer_type, d in dev.attention_mask.items():
                h = host.attention_mask[layer_type]
                it = _INT_OF_SIZE[d.element_size()]
                h2, d2 = h.view(it)[0, 0], d.view(it)[0, 0]
                self.masks.append((h2, h2.numpy(), d2))
        self._views: dict = {}

    def _cached(self, key, make, *args):
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 4096:  # a long run of new shapes: start over
                self._views.clear()
            v = self._views[key] = make(*args)
        return v

    def head(self, name, tensor, n: int):
        """``tensor[:n]`` (``name`` tells the tensors apart)."""
        return self._cached((name, n), tensor.__getitem__, slice(0, n))

    def bulk(self, n: int):
        """The device bulk tensor's first ``n`` columns, every row."""
        return self._cached(("bulk", n), self.d_bulk.__getitem__, (slice(None), slice(0, n)))

    def carry_tail(self, start: int):
        """The device carry-over row from ``start`` on."""
        return self._cached(
            ("carry", start), self.d_bulk.__getitem__, (6, slice(start, self.tokens))
        )


# -- the seam ----------------------------------------------------------------------------------


def _after_reset(stream) -> None:
    """Order ``stream`` after the engine's reset of the device buffers.

    ``ContinuousBatchingIOs.reset`` fills them on the thread's current stream, and the
    engine's streams are non-blocking: without this, a routed step's copies on ``stream``
    could land before those fills (the unmodified sync step writes on the current stream
    itself, so it is ordered). Device-side only: no host wait.
    """
    if stream is not None and torch.cuda.is_available():
        stream.wait_stream(torch.cuda.current_stream(stream.device))


class RoutedIOPair(HostDeviceIOPair):
    """An engine ``HostDeviceIOPair`` whose H2D transfer goes through cucopy (async mode).

    Set by :meth:`CucopyRoute.install` on the engine's own pairs (``__class__`` is
    reassigned; this class adds no fields), reset by :meth:`CucopyRoute.uninstall`.
    """

    def transfer_inputs_h2d(self, stream) -> None:
        """Upload this step's host buffers on ``stream`` (the engine's H2D stream).

        The engine records ``h2d_over`` on ``stream`` right after this returns; the
        step's segment is flushed before that, so the event covers it.
        """
        route, bufs = self._cucopy_route
        if stream is not route.stream:
            raise cc.CopyError(
                f"RoutedIOPair: the copier runs on {route.stream!r}, the engine transfers "
                f"on {stream!r}: its h2d_over event would not cover the copies"
            )
        copy_accumulators(self.host_io, self.device_io)
        route.upload(bufs, carry_over=True)

    def reset(self) -> None:
        """The engine's reset, then the copier's stream ordered after it."""
        super().reset()
        _after_reset(self._cucopy_route[0].stream)


class RoutedIOs(ContinuousBatchingIOs):
    """An engine ``ContinuousBatchingIOs`` (sync mode) prepared on a host twin, uploaded through cucopy.

    Set by :meth:`CucopyRoute.install` on the engine's own object (``__class__`` is
    reassigned; this class adds no fields), reset by :meth:`CucopyRoute.uninstall`.
    """

    def prepare_batch_tensors(self, *args, **kwargs) -> None:
        """The engine's ``prepare_batch_tensors`` on the host twin, then one upload."""
        route, bufs = self._cucopy_route
        twin = bufs.host
        twin.prepare_batch_tensors(*args, **kwargs)
        copy_accumulators(twin, self)
        self.requests_in_batch = twin.requests_in_batch
        self.req_id_to_new_token_position = twin.req_id_to_new_token_position
        route.upload(bufs, reset_outputs=True)

    def reset(self) -> None:
        """Reset the device buffers (the engine's own reset) and the host twin."""
        super().reset()
        self._cucopy_route[1].host.reset()
        _after_reset(self._cucopy_route[0].stream)


class CucopyRoute:
    """Routes one transformers batch processor's per-step uploads through one cucopy copier.

    Parameters
    ----------
    processor : ContinuousBatchProcessor
        The engine's batch processor (``manager.batch_processor`` once the manager has
        been warmed up or run).
    copier : DeviceCopier or PlainCopier, optional
        None makes a ``cc.DeviceCopier(PLAN)`` on the engine's stream: ``h2d_stream``
        (async) or the compute stream (sync).
    raw_min_bytes : int
        Attention-mask blocks this large or larger are copied raw (below).
    **copier_options
        Passed to ``cc.DeviceCopier`` (``flush_mode``, ``capacity``, ``slots``).

    Notes
    -----
    Raw copies. A mask block of ``raw_min_bytes`` or more is one plain
    ``cudaMemcpy(2D)Async`` from the engine's pinned host buffer on the copier's stream
    (through ``copier.backend.copy2d``, issued at the call), not a snapshot: its source
    is a buffer the engine itself fences before refilling it (async: the IO pair's
    ``d2h_over`` is synchronized before its host buffers are prepared again, and it
    comes after ``h2d_over``; sync: the compute stream is synchronized every step), so
    the copy may read it late. A source that is not pinned goes through the copier.
    cucopy never sees raw copies (check mode cannot vouch for them); they write
    bytes no merged copy writes.
    """

    def __init__(
        self, processor, copier=None, *, raw_min_bytes: int = RAW_MIN_BYTES, **copier_options
    ):
        io = processor.inputs_and_outputs
        self.processor = processor
        self.is_async = isinstance(io, ContinuousBatchingAsyncIOs)
        if not self.is_async and type(io) not in (ContinuousBatchingIOs, RoutedIOs):
            raise TypeError(f"CucopyRoute: unexpected IO object {type(io).__qualname__}")
        self.stream = io.h2d_stream if self.is_async else io.compute_stream
        if copier is None:
            if self.stream is None:
                raise ValueError(
                    "CucopyRoute: the engine runs on the CPU; pass copier=PlainCopier()"
                )
            copier = cc.DeviceCopier(
                PLAN, stream=self.stream, device=self.stream.device.index, **copier_options
            )
        self.copier = copier
        self.raw_min_bytes = int(raw_min_bytes)
        self.raw = Counter()  # raw copies by site
        #: per upload: ns in begin(), staging (raw mask copies aside), raw mask copies, flush()
        self.phases: list = []
        if self.is_async:
            self._targets = [(pair, _Buffers(pair.host_io, pair.device_io)) for pair in io.io_pairs]
        else:
            twin = ContinuousBatchingIOs(
                cache=processor.cache,
                config=processor.config,
                continuous_batching_config=processor.cb_config,
                device=torch.device("cpu"),
                model_dtype=processor.model_dtype,
                logit_processor=processor.logit_processor,
            )
            # The twin's masks follow the device's: outside a run the engine has given the
            # model its own attention implementation back, so the config no longer says
            # that the paged one needs masks.
            if io.attention_mask is None:
                twin.attention_mask = None
            elif twin.attention_mask is None:
                pin = twin._bulk_input_tensor.is_pinned()
                twin.attention_mask = {
                    k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
                    for k, v in io.attention_mask.items()
                }
                twin._reset_static_tensors(full_reset=True)
            self._targets = [(io, _Buffers(twin, io))]
        pinned = copier.backend.is_pinned
        self._raw_ok = all(pinned(h.data_ptr()) for _, b in self._targets for h, _, _ in b.masks)
        self.installed = False

    @property
    def host_twin(self):
        """Sync mode: the CPU ``ContinuousBatchingIOs`` the engine prepares into; else None."""
        return None if self.is_async else self._targets[0][1].host

    def install(self) -> None:
        """Route the engine's uploads through the copier (idempotent)."""
        if self.installed:
            return
        routed = RoutedIOPair if self.is_async else RoutedIOs
        for obj, bufs in self._targets:
            obj._cucopy_route = (self, bufs)
            obj.__class__ = routed
        self.installed = True

    def uninstall(self) -> None:
        """Give the engine its own upload methods back (idempotent)."""
        if not self.installed:
            return
        plain = HostDeviceIOPair if self.is_async else ContinuousBatchingIOs
        for obj, _ in self._targets:
            obj.__class__ = plain
            del obj._cucopy_route
        self.installed = False

    def __enter__(self) -> CucopyRoute:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def close(self) -> None:
        """Uninstall and close the copier."""
        self.uninstall()
        self.copier.close()

    # -- one step ----------------------------------------------------------------------------

    def upload(self, bufs: _Buffers, *, carry_over: bool = False, reset_outputs: bool = False):
        """Upload what this step's ``prepare_batch_tensors`` rewrote in ``bufs.host``.

        Its reset ranges for ``q = num_q_tokens`` query tokens and ``kv = max_kv_read``
        cached ones hold everything it writes: bulk rows ``[:q + 1]``, the write index
        ``[:q]`` and read index ``[:q + kv]`` of each group (or the block table's
        ``[:b]`` rows, ``b = min(q, max_requests)``), and the mask's ``[:q, :q + kv]``.

        Parameters
        ----------
        bufs : _Buffers
        carry_over : bool
            Also the carry-over row past ``q + 1`` (async: the host rewrites it whole and
            the graph indexes it whole).
        reset_outputs : bool
            Also zero ``output_ids[:, :b]`` on the device (sync: the engine's step does).

        Each upload appends its phases to :attr:`phases` (ns in ``begin()``, in staging
        less the raw mask copies, in those copies, in ``flush()``).
        """
        c = self.copier
        clock = time.perf_counter_ns
        t0 = clock()
        step = c.step()
        step.__enter__()  # begin(): as ``with c.step():``, timed phase by phase
        t1 = clock()
        try:
            mask_ns = self._stage(bufs, carry_over, reset_outputs)
        except BaseException:
            if not step.__exit__(*sys.exc_info()):
                raise
            return
        t2 = clock()
        step.__exit__(None, None, None)  # flush()
        t3 = clock()
        self.phases.append((t1 - t0, t2 - t1 - mask_ns, mask_ns, t3 - t2))

    def _stage(self, bufs: _Buffers, carry_over: bool, reset_outputs: bool) -> int:
        """Stage one step's regions (see :meth:`upload`); returns the ns the raw mask
        copies took."""
        h = bufs.host
        q, kv = h.num_q_tokens, h.max_kv_read
        b = min(q, h.max_requests_per_batch)
        c = self.copier
        c.copy(Site.BULK, bufs.bulk(q + 1), bufs.h_bulk[:, : q + 1])
        if carry_over and q + 1 < bufs.tokens:
            c.copy(Site.CARRY_OVER, bufs.carry_tail(q + 1), bufs.h_bulk[6, q + 1 : bufs.tokens])
        if reset_outputs:
            for r, row in enumerate(bufs.d_out):
                c.fill_tail(Site.OUTPUT_RESET, bufs.head(("out", r), row, b), 0, 0)
        if h.use_block_table:
            for g, table in enumerate(bufs.d_table):
                c.copy(Site.BLOCK_TABLE, bufs.head(("table", g), table, b), bufs.h_table[g, :b])
        else:
            for g, (dw, dr) in enumerate(zip(bufs.d_write, bufs.d_read)):
                nw, nr = h.true_write_sizes[g], h.true_read_sizes[g]
                if nw:
                    c.copy(Site.WRITE_INDEX, bufs.head(("w", g), dw, nw), bufs.h_write[g, :nw])
                c.fill_tail(Site.WRITE_PAD, bufs.head(("w", g), dw, q), nw, bufs.write_trash)
                if nr:
                    c.copy(Site.READ_INDEX, bufs.head(("r", g), dr, nr), bufs.h_read[g, :nr])
                c.fill_tail(Site.READ_PAD, bufs.head(("r", g), dr, q + kv), nr, bufs.read_trash)
        mask_ns = 0
        for h_mask, h_np, d_mask in bufs.masks:
            mask_ns += self._mask(h_mask, h_np, d_mask, q, q + kv)
        return mask_ns

    def _mask(self, h_mask, h_np, d_mask, rows: int, cols: int) -> int:
        """Mask ``[:rows, :cols]``: raw when large and pinned (see Notes), else merged.
        Returns the ns a raw copy took (0 when merged)."""
        if rows == 0 or cols == 0:
            return 0
        t0 = time.perf_counter_ns()
        it = d_mask.element_size()
        width = d_mask.shape[1]
        if self._raw_ok and rows * cols * it >= self.raw_min_bytes:
            c = self.copier
            if cols == width:  # whole rows: one contiguous block
                n = rows * width * it
                c.backend.copy2d(True, d_mask.data_ptr(), n, h_mask.data_ptr(), n, n, 1, c.stream)
            else:
                pitch = width * it
                c.backend.copy2d(
                    True,
                    d_mask.data_ptr(),
                    pitch,
                    h_mask.data_ptr(),
                    pitch,
                    cols * it,
                    rows,
                    c.stream,
                )
            self.raw[Site.MASK] += 1
            return time.perf_counter_ns() - t0
        self.copier.copy(Site.MASK, d_mask[:rows, :cols], h_np[:rows, :cols])
        return 0

    def stats_text(self) -> str:
        """``copier.stats`` and the raw copies, for printing."""
        raw = ", ".join(f"{s.label} {n}" for s, n in self.raw.items()) or "none"
        return f"{self.copier.stats}\nraw copies (not through cucopy): {raw}"


# -- a stand-in copier for machines without a GPU ------------------------------------------------


class _HostBackend:
    """What :class:`CucopyRoute` asks of a copier's backend, on host memory."""

    @staticmethod
    def is_pinned(ptr: int) -> bool:
        return True  # host memory: the raw path is taken, and tested

    @staticmethod
    def copy2d(h2d, dst, dpitch, src, spitch, width, rows, stream) -> None:
        for r in range(rows):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)


class PlainCopier:
    """Stands in for a ``DeviceCopier``: each call issued at once as a plain torch op.

    Where the engine runs on the CPU (``--cpu``, the tests) it checks the seam and the
    site map, not cucopy: nothing is merged or snapshotted, and :attr:`calls` records
    ``(site, dst)``. On CUDA (``stream`` given, ``backend`` a cucopy backend for the raw
    mask copies) it is the ``twin_plain`` variant: the routed sync step's host twin,
    uploaded region by region with ``copy_(non_blocking=True)`` and ``fill_`` on the
    engine's stream, so the twin's share of a gain is told apart from cucopy's.

    Parameters
    ----------
    stream : torch.cuda.Stream, optional
        Where the ops go (None: the engine runs on the CPU).
    backend : optional
        What the route's raw copies use (``copy2d``, ``is_pinned``); None: host memory.
    record : bool
        Keep every call in :attr:`calls`.
    """

    plan = PLAN

    def __init__(self, stream=None, backend=None, record: bool = True):
        self.backend = backend if backend is not None else _HostBackend()
        self._torch_stream = stream
        self.stream = stream.cuda_stream if stream is not None else None
        self.record = record
        self.calls: list = []
        self.steps = 0
        self._counts: Counter = Counter()

    @contextlib.contextmanager
    def step(self):
        """One step: the ops go on the stream (nothing to flush)."""
        self.steps += 1
        if self._torch_stream is None:
            yield
        else:
            with torch.cuda.stream(self._torch_stream):
                yield

    def copy(self, site, dst, src, **_) -> bool:
        """``dst[...] = src``, issued now."""
        self._counts[site] += 1
        if self.record:
            self.calls.append((site, dst))
        dst.copy_(torch.from_numpy(src).reshape(dst.shape), non_blocking=True)
        return True

    def fill_tail(self, site, dst, start, value, **_) -> bool:
        """``dst.reshape(-1)[start:] = value``, issued now (``dst`` contiguous)."""
        self._counts[site] += 1
        if self.record:
            self.calls.append((site, dst))
        if start >= dst.numel():
            return False
        dst.view(-1)[start:].fill_(value)
        return True

    @property
    def stats(self) -> str:
        """Calls by site."""
        return f"PlainCopier: {self.steps} steps, calls " + ", ".join(
            f"{s.label} {n}" for s, n in sorted(self._counts.items(), key=lambda x: x[0].label)
        )

    def close(self) -> None:
        """Nothing to release."""


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


#: ``raw_min_bytes`` that no mask block reaches: a route whose every copy goes to its copier
NO_RAW = 1 << 62


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


def make_model(args, device):
    """A tiny random-weight Llama (seeded), greedy, no download."""
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(device).eval()


def make_prompts(args) -> list:
    """``--requests`` prompts of 16-32 token ids (seeded)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    lens = torch.randint(16, 33, (args.requests,), generator=g).tolist()
    return [torch.randint(3, 1024, (n,), generator=g).tolist() for n in lens]


def cb_config(args, mode: str) -> ContinuousBatchingConfig:
    """The engine's configuration: sizes fixed (no memory probing), the mode's upload path."""
    return ContinuousBatchingConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        use_async_batching=mode == "async",
        use_cuda_graph=mode == "async",
    )


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
                raw_min_bytes=args.raw_min_bytes,
                **({} if args.cpu else {"flush_mode": args.flush_mode}),
            )
            copier_s = time.perf_counter() - t0  # the first CUDA copier builds its kernels
            variants = self.variants()
            if "twin_plain" in variants:
                plain = PlainCopier(route.stream, backend=route.copier.backend, record=False)
                routes["twin_plain"] = CucopyRoute(
                    processor, plain, raw_min_bytes=args.raw_min_bytes
                )
            if "no_upload" in variants:
                null = NullCopier(route.stream, backend=route.copier.backend)
                routes["no_upload"] = CucopyRoute(processor, null, raw_min_bytes=NO_RAW)
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
            phases = list(route.phases)  # the timed routed runs' uploads
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
        res = self.summary(copier_s, checked, stats, stats_dict, dict(route.raw), clock.hook_name)
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

    def summary(self, copier_s, checked, stats, stats_dict, raw, hook_name) -> dict:
        """The mode's result: per variant, every raw sample and its statistics."""
        from bench._common import summarize

        by, ratios = {}, {}
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
        for rnd in range(self.args.pairs):  # per round: variant median / unmodified median
            med = {
                r["variant"]: statistics.median(r["step_ms"])
                for r in self.runs
                if r["pair"] == rnd and r["step_ms"]
            }
            for variant in ratios:
                if variant in med and "unmodified" in med:
                    ratios[variant].append(med[variant] / med["unmodified"])
        target = {"async": 0.95, "sync": 0.85}[self.mode]
        ratio = statistics.median(ratios["routed"]) if ratios["routed"] else None
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
                "flush_mode": None if self.args.cpu else self.args.flush_mode,
                "raw_min_bytes": self.args.raw_min_bytes,
                "torch_threads": torch.get_num_threads(),
            },
            "copier_create_s": copier_s,
            "generate_batch_runs": self.generated,
            "variants": by,
            "step_ratio_per_round": {v: x for v, x in ratios.items() if v != "unmodified"},
            "step_ratio": ratio,
            "target_ratio": target,
            "target_met": None if ratio is None or self.args.cpu else ratio <= target,
            "bound": bound,
            "check_mode": checked,
            "tokens_identical": not self.errors,
            "stats": stats_dict,
            "stats_text": stats,
            "raw_copies": {s.label: n for s, n in raw.items()},
            "runs": self.runs,
        }


PHASES = ("begin", "staging", "mask_raw_copy", "flush")


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
    p.add_argument("--flush-mode", default="auto", choices=("auto", "dma", "mapped", "inline"))
    p.add_argument("--raw-min-bytes", type=int, default=RAW_MIN_BYTES)
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
        f"hf_continuous_batching: transformers {transformers.__version__}, torch {torch.__version__} "
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
