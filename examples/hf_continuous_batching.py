"""transformers' continuous batching (``generate_batch``), its per-step uploads routed through cucopy.

Usage:
    python examples/hf_continuous_batching.py [--mode async|sync] [--requests 8] [--new-tokens 16]
    python examples/hf_continuous_batching.py --cpu   # no GPU: sync mode, the seam only

An engine author's reading: how a real engine written elsewhere sends its per-step
uploads through cucopy without being modified. The engine is Hugging Face transformers'
continuous batching (written against transformers 5.17.0, checked at import), here on a
tiny random-weight ``LlamaForCausalLM`` fed token ids (nothing downloaded), greedy
decoding. Both of its upload paths are routed:

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

The seam is :class:`CucopyRoute`: it retypes the engine's own IO objects to
subclasses that override only the upload method and the host writes they fence
(:class:`RoutedIOPair` and :class:`RoutedAsyncIOs` in async mode, :class:`RoutedIOs` in
sync mode), and back. Nothing of torch or transformers is patched; every other reference
the engine holds sees the same objects.

What goes up is what the step's ``prepare_batch_tensors`` rewrote on the host (its reset
ranges, which hold everything it writes), one named :class:`Site` per buffer, every byte
through the copier (no side copies): each KV index buffer as one region, every layer
group's row with its padded tail (the reset wrote the pad on the host); a region of :data:`IN_PLACE_MIN_BYTES` or more (the attention mask,
or a bulk block that large) is read in place from the engine's pinned buffer through a
``cc.HostGuard`` instead of snapshotted, and the engine's host writes of those buffers
are fenced by the guards' ``write()`` (see :class:`CucopyRoute`); the rest is merged.

:func:`build_manager` sets up the tiny model and its kept continuous-batching manager.
Run as a script, this file generates once unmodified and once routed, checks the tokens
request by request, and prints ``copier.stats``. ``--cpu`` drives the same seam with
:class:`PlainCopier`, a stand-in that runs each call at once on CPU tensors: it checks
the routing and the site map, not cucopy's merging (CI runs it). The timed A/B
comparison of the two is ``bench/hf_ab.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script: make ``cucopy`` and ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cucopy as cc  # noqa: E402

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

#: A region at least this large, of a pinned host buffer, is read in place through its
#: ``cc.HostGuard`` (see :class:`CucopyRoute`): snapshotting the 0.8-1 MB sdpa mask cost
#: ~0.2 ms of host time a step on an H200 host, more than the whole unmodified upload
#: (0.11 ms); an in-place copy is one cudaMemcpy(2D)Async, a few us. Smaller regions are
#: merged: their snapshot into the step's pack is cheaper than a copy of their own.
IN_PLACE_MIN_BYTES = 64 << 10


# -- the site map and the plan -----------------------------------------------------------------


class Site(cc.CopySite):
    """One member per engine buffer a step uploads."""

    BULK = (
        cc.H2D
    )  # input ids, positions, cu_seqlens q/k, logits indices, carry-over, processor args
    CARRY_OVER = cc.H2D  # async: the rest of the carry-over row, which the graph indexes whole
    WRITE_INDEX = cc.H2D  # KV-cache slots the step writes, every layer group, pad included
    READ_INDEX = cc.H2D  # KV-cache slots the step reads, every layer group, pad included
    BLOCK_TABLE = cc.H2D  # decode fast path (flash attention): pages per request
    OUTPUT_RESET = (
        cc.FILL
    )  # sync: output_ids[:, :b] = 0, which the engine's step does on the device
    MASK = cc.H2D  # eager/sdpa attention mask rows (in place from IN_PLACE_MIN_BYTES on)


#: Which engine buffer (a ``ContinuousBatchingIOs`` attribute) each site writes.
SITE_BUFFERS = {
    Site.BULK: "_bulk_input_tensor",
    Site.CARRY_OVER: "_bulk_input_tensor",
    Site.WRITE_INDEX: "write_index_storage",
    Site.READ_INDEX: "read_index_storage",
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


def _pinned(is_pinned, arr) -> bool:
    """Whether NumPy array ``arr``'s first and last bytes are pinned memory."""
    lo = arr.ctypes.data
    return bool(is_pinned(lo) and is_pinned(lo + max(arr.nbytes - 1, 0)))


@contextlib.contextmanager
def _write_all(guards):
    """``with g.write():`` for every guard of ``guards`` at once."""
    with contextlib.ExitStack() as stack:
        for g in guards:
            stack.enter_context(g.write())
        yield


class _Buffers:
    """A host ``ContinuousBatchingIOs`` and the device one it uploads into, as views made once.

    Host sides are NumPy views (cucopy's fastest source). The regions a step copies are
    cached as (device view, host view) pairs by their lengths: torch slicing costs ~1-2 us
    a view and NumPy's a few hundred ns, several times that when the engine's own work
    has left the host's caches cold; decode steps repeat the same lengths.

    Each host buffer with a region that can reach ``min_bytes`` gets a ``cc.HostGuard``
    (made once, when ``is_pinned`` says it is pinned): such a region is copied in place
    through it, and every host write of the buffer goes inside :meth:`writing`. Buffers
    whose regions stay smaller get none (their copies are merged: nothing to fence).
    """

    def __init__(self, host, dev, *, is_pinned=None, min_bytes: int = IN_PLACE_MIN_BYTES):
        self.host, self.dev = host, dev
        self.tokens = host.input_ids.numel()  # max_batch_tokens
        self.h_bulk = host._bulk_input_tensor.numpy()
        self.h_write = host.write_index_storage.numpy()
        self.h_read = host.read_index_storage.numpy()
        self.h_table = host.block_table.numpy()
        self.d_bulk = dev._bulk_input_tensor
        self.d_write = dev.write_index_storage
        self.d_read = dev.read_index_storage
        self.d_table = list(dev.block_table)
        self.d_out = list(dev.output_ids)
        self.guards: list = []  # every HostGuard below, for writing()

        def guard(arr, largest: int, label: str):
            # the largest region one copy reads from ``arr`` decides whether it can go in place
            if is_pinned is None or largest < min_bytes or not _pinned(is_pinned, arr):
                return None
            g = cc.HostGuard(arr, label=f"host {label}")
            self.guards.append(g)
            return g

        self.g_bulk = guard(self.h_bulk, self.h_bulk[:, : self.tokens + 1].nbytes, "bulk")
        self.g_write = guard(self.h_write, self.h_write.nbytes, "write_index_storage")
        self.g_read = guard(self.h_read, self.h_read.nbytes, "read_index_storage")
        self.g_table = guard(
            self.h_table, self.h_table[0].nbytes if len(self.h_table) else 0, "block_table"
        )
        # (host numpy 2-D, device tensor 2-D, HostGuard or None), as same-size ints
        self.masks = []
        if dev.attention_mask is not None:
            for layer_type, d in dev.attention_mask.items():
                h = host.attention_mask[layer_type]
                it = _INT_OF_SIZE[d.element_size()]
                h2 = h.view(it)[0, 0].numpy()
                g = guard(h2, h2.nbytes, f"attention_mask[{layer_type}]")
                self.masks.append((h2, d.view(it)[0, 0], g))
        self._views: dict = {}

    def writing(self):
        """A context in which the host may write its guarded buffers: entering it waits for
        the in-place copies that read them (``HostGuard.write()`` of each guard)."""
        gs = self.guards
        if not gs:
            return contextlib.nullcontext()
        return gs[0].write() if len(gs) == 1 else _write_all(gs)

    def fence(self) -> None:
        """Wait for the in-place copies reading the host buffers (before handing them back)."""
        for g in self.guards:
            g.wait()

    def close(self) -> None:
        """Close the guards (each waits for the copies reading its buffer)."""
        for g in self.guards:
            g.close()

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
        """The bulk block's first ``n`` columns, every row: ``(device, host)``."""
        return self._cached(("bulk", n), self._pair, self.d_bulk, self.h_bulk, np.s_[:, :n])

    def carry_tail(self, start: int):
        """The carry-over row from ``start`` on: ``(device, host)``."""
        at = np.s_[6, start : self.tokens]
        return self._cached(("carry", start), self._pair, self.d_bulk, self.h_bulk, at)

    def table(self, g: int, b: int):
        """Layer group ``g``'s block table, its first ``b`` rows: ``(device, host)``."""
        return self._cached(
            ("table", g, b), self._pair, self.d_table[g], self.h_table[g], np.s_[:b]
        )

    def index(self, name: str, cols: int):
        """The write (``"w"``) or read (``"r"``) index, every group's first ``cols``:
        ``(device, host)``."""
        d, h = (self.d_write, self.h_write) if name == "w" else (self.d_read, self.h_read)
        return self._cached((name, cols), self._pair, d, h, np.s_[:, :cols])

    def mask(self, i: int, rows: int, cols: int):
        """Mask ``i``'s ``[:rows, :cols]``: ``(device, host, guard)``."""
        key = ("mask", i, rows, cols)
        h, d, g = self.masks[i]
        return self._cached(key, lambda: (*self._pair(d, h, np.s_[:rows, :cols]), g))

    @staticmethod
    def _pair(dev, host, at) -> tuple:
        return dev[at], host[at]


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
        """The engine's reset (its host half inside the guards' ``write()``), then the
        copier's stream ordered after it."""
        route, bufs = self._cucopy_route
        with bufs.writing():
            super().reset()
        _after_reset(route.stream)


class RoutedAsyncIOs(ContinuousBatchingAsyncIOs):
    """The engine's ``ContinuousBatchingAsyncIOs`` whose host writes are fenced (async mode).

    Its ``prepare_batch_tensors`` writes the current pair's ``host_io`` (the pair's own
    ``prepare_batch_tensors``, then the carry-over row); here it does so inside that
    pair's guards' ``write()``, which waits for the in-place copies that read them. Set
    by :meth:`CucopyRoute.install` (``__class__`` reassigned; no fields added), reset by
    :meth:`CucopyRoute.uninstall`.
    """

    def prepare_batch_tensors(self, *args, **kwargs) -> None:
        """The engine's ``prepare_batch_tensors``, fenced by the current pair's guards."""
        with self.io_pairs[self.current_pair]._cucopy_route[1].writing():
            super().prepare_batch_tensors(*args, **kwargs)


class RoutedIOs(ContinuousBatchingIOs):
    """An engine ``ContinuousBatchingIOs`` (sync mode) prepared on a host twin, uploaded through cucopy.

    Set by :meth:`CucopyRoute.install` on the engine's own object (``__class__`` is
    reassigned; this class adds no fields), reset by :meth:`CucopyRoute.uninstall`.
    """

    def prepare_batch_tensors(self, *args, **kwargs) -> None:
        """The engine's ``prepare_batch_tensors`` on the host twin, then one upload."""
        route, bufs = self._cucopy_route
        twin = bufs.host
        with bufs.writing():  # waits for the in-place copies that read the twin
            twin.prepare_batch_tensors(*args, **kwargs)
        copy_accumulators(twin, self)
        self.requests_in_batch = twin.requests_in_batch
        self.req_id_to_new_token_position = twin.req_id_to_new_token_position
        route.upload(bufs, reset_outputs=True)

    def reset(self) -> None:
        """Reset the device buffers (the engine's own reset) and the host twin (inside
        its guards' ``write()``)."""
        super().reset()
        route, bufs = self._cucopy_route
        with bufs.writing():
            bufs.host.reset()
        _after_reset(route.stream)


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
    in_place_min_bytes : int
        Regions this large or larger are read in place through a ``cc.HostGuard`` (below).
    **copier_options
        Passed to ``cc.DeviceCopier`` (``flush_mode``, ``capacity``, ``slots``).
        ``flush_mode`` defaults to ``"mapped"`` in async mode and ``"auto"`` in sync
        mode (see Notes).

    Notes
    -----
    Every upload goes through the copier: there are no side copies.

    The flush. In async mode the copier's stream is the engine's H2D stream, whose work
    runs while the previous batch computes: what the upload costs is host time, and
    ``flush_mode="mapped"`` spends the least of it (a step's segment, ~29 KB in a decode
    step here, goes in one graphed launch, about half a carried launch's host time,
    for a little more GPU time that the overlap hides). In sync mode the GPU waits for
    the upload, and ``"auto"`` carries such a segment in the launch instead.

    In-place copies. A region of ``in_place_min_bytes`` or more of a pinned host buffer
    (the attention mask's ``[:q, :q + kv]``, ~1 MB in prefill; the bulk block
    ``[:, :q + 1]`` or an index row when that large) is copied
    ``copier.copy(site, dst, src, guard=g)``: one DMA from the engine's pinned buffer,
    issued at the call, no snapshot (snapshotting the mask cost more host time than the
    engine's whole upload). Each such buffer has one ``cc.HostGuard``, made with the
    route when the copier's backend says the buffer is pinned (else its regions are
    snapshotted like the rest). Smaller regions are merged into the step's one segment.

    The fence. The host writes a guarded buffer only inside its guards' ``write()``,
    which waits for exactly the copies that read it: sync mode in
    :meth:`RoutedIOs.prepare_batch_tensors` and :meth:`RoutedIOs.reset` (the host twin's
    preparation and reset); async mode in :meth:`RoutedAsyncIOs.prepare_batch_tensors`
    (the pair's ``host_io`` preparation and its carry-over row) and
    :meth:`RoutedIOPair.reset`; :meth:`uninstall` waits for them before the engine gets
    its buffers back. The engine fences these buffers itself too (async: the pair's
    ``d2h_over``, after its ``h2d_over``, is synchronized before its host buffers are
    prepared again; sync: the compute stream is synchronized every step), so ``write()``
    normally finds the copies done; it is there so that cucopy proves the fence: in check
    mode a host write of a guarded region a copy read, made outside ``write()``, raises
    ``CopyError`` naming the site at the next ``write()``, copy through the guard or flush.
    """

    def __init__(
        self,
        processor,
        copier=None,
        *,
        in_place_min_bytes: int = IN_PLACE_MIN_BYTES,
        **copier_options,
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
            if copier_options.get("flush_mode") is None:
                copier_options["flush_mode"] = "mapped" if self.is_async else "auto"
            copier = cc.DeviceCopier(
                PLAN, stream=self.stream, device=self.stream.device.index, **copier_options
            )
        self.copier = copier
        self.in_place_min_bytes = int(in_place_min_bytes)
        self.in_place = Counter()  # in-place (guarded) copies by site
        #: per upload while :attr:`timed`: ns in begin(), staging (in-place copies aside),
        #: in-place copies, flush()
        self.phases: list = []
        #: whether :meth:`upload` times its phases (off: no clock readings in the step)
        self.timed = False
        self._in_place_ns = 0
        self._io = io
        opts = {"is_pinned": copier.backend.is_pinned, "min_bytes": self.in_place_min_bytes}
        if self.is_async:
            self._targets = [
                (pair, _Buffers(pair.host_io, pair.device_io, **opts)) for pair in io.io_pairs
            ]
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
            self._targets = [(io, _Buffers(twin, io, **opts))]
        self.installed = False

    @property
    def guards(self) -> list:
        """Every ``cc.HostGuard`` of the route (one per host buffer read in place)."""
        return [g for _, bufs in self._targets for g in bufs.guards]

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
        if self.is_async:
            self._io.__class__ = RoutedAsyncIOs
        self.installed = True

    def uninstall(self) -> None:
        """Give the engine its own upload methods back (idempotent)."""
        if not self.installed:
            return
        plain = HostDeviceIOPair if self.is_async else ContinuousBatchingIOs
        for obj, _ in self._targets:
            obj.__class__ = plain
            del obj._cucopy_route
        if self.is_async:
            self._io.__class__ = ContinuousBatchingAsyncIOs
        self.installed = False
        for _, bufs in self._targets:  # the engine writes them unfenced from here on
            bufs.fence()

    def __enter__(self) -> CucopyRoute:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def close(self) -> None:
        """Uninstall, close the guards and the copier."""
        self.uninstall()
        for _, bufs in self._targets:
            bufs.close()
        self.copier.close()

    # -- one step ----------------------------------------------------------------------------

    def upload(self, bufs: _Buffers, *, carry_over: bool = False, reset_outputs: bool = False):
        """Upload what this step's ``prepare_batch_tensors`` rewrote in ``bufs.host``.

        Its reset ranges for ``q = num_q_tokens`` query tokens and ``kv = max_kv_read``
        cached ones hold everything it writes: bulk rows ``[:q + 1]``, the write index
        ``[:q]`` and read index ``[:q + kv]`` of every group (or the block table's
        ``[:b]`` rows, ``b = min(q, max_requests)``), and the mask's ``[:q, :q + kv]``.

        Parameters
        ----------
        bufs : _Buffers
        carry_over : bool
            Also the carry-over row past ``q + 1`` (async: the host rewrites it whole and
            the graph indexes it whole).
        reset_outputs : bool
            Also zero ``output_ids[:, :b]`` on the device (sync: the engine's step does).

        With :attr:`timed` set, each upload appends its phases to :attr:`phases` (ns in
        ``begin()``, in staging less the in-place copies, in those copies, in
        ``flush()``); unset, it takes no clock readings.
        """
        if not self.timed:
            with self.copier.step():
                self._stage(bufs, carry_over, reset_outputs)
            return
        c = self.copier
        clock = time.perf_counter_ns
        t0 = clock()
        step = c.step()
        step.__enter__()  # begin(): as ``with c.step():``, timed phase by phase
        t1 = clock()
        self._in_place_ns = 0
        try:
            self._stage(bufs, carry_over, reset_outputs)
        except BaseException:
            if not step.__exit__(*sys.exc_info()):
                raise
            return
        t2 = clock()
        step.__exit__(None, None, None)  # flush()
        t3 = clock()
        ns = self._in_place_ns
        self.phases.append((t1 - t0, t2 - t1 - ns, ns, t3 - t2))

    def _stage(self, bufs: _Buffers, carry_over: bool, reset_outputs: bool) -> None:
        """Stage one step's regions (see :meth:`upload`).

        The write and read indices go as one region each, every group's row up to
        ``q`` and ``q + kv``, as the engine's own copy uploads them (whole): its
        ``prepare_batch_tensors`` resets exactly those ranges to the cache's trash
        indices before writing the true ones, so past the true sizes the host holds the
        pad the model must see.
        """
        h = bufs.host
        q = h.num_q_tokens
        n = q + h.max_kv_read  # the read index's and the mask's columns
        b = min(q, h.max_requests_per_batch)
        put = self._put
        put(Site.BULK, *bufs.bulk(q + 1), bufs.g_bulk)
        if carry_over and q + 1 < bufs.tokens:
            put(Site.CARRY_OVER, *bufs.carry_tail(q + 1), bufs.g_bulk)
        if reset_outputs:
            for r, row in enumerate(bufs.d_out):
                self.copier.fill_tail(Site.OUTPUT_RESET, bufs.head(("out", r), row, b), 0, 0)
        if h.use_block_table:
            for g in range(len(bufs.d_table)):
                put(Site.BLOCK_TABLE, *bufs.table(g, b), bufs.g_table)
        else:
            if q:
                put(Site.WRITE_INDEX, *bufs.index("w", q), bufs.g_write)
            if n:
                put(Site.READ_INDEX, *bufs.index("r", n), bufs.g_read)
        if q and bufs.masks:
            for i in range(len(bufs.masks)):
                put(Site.MASK, *bufs.mask(i, q, n))

    def _put(self, site, dst, src, guard) -> None:
        """Copy host region ``src`` to ``dst``: in place through ``guard`` when it is at
        least ``in_place_min_bytes`` (see Notes), else merged (with :attr:`timed`, the
        in-place copy's ns are added to the step's)."""
        n = src.nbytes
        if guard is None or n < self.in_place_min_bytes or not n:
            self.copier.copy(site, dst, src)
            return
        self.in_place[site] += 1
        if not self.timed:
            self.copier.copy(site, dst, src, guard=guard)
            return
        t0 = time.perf_counter_ns()
        self.copier.copy(site, dst, src, guard=guard)
        self._in_place_ns += time.perf_counter_ns() - t0

    def stats_text(self) -> str:
        """``copier.stats`` and the in-place copies, for printing."""
        n = ", ".join(f"{s.label} {k}" for s, k in self.in_place.items()) or "none"
        return f"{self.copier.stats}\nin-place copies (guarded, no snapshot): {n}"


# -- a stand-in copier for machines without a GPU ------------------------------------------------


class _HostBackend:
    """What :class:`CucopyRoute` asks of a copier's backend, on host memory."""

    @staticmethod
    def is_pinned(ptr: int) -> bool:
        return True  # host memory: the guards are made and the in-place path is taken


class PlainCopier:
    """Stands in for a ``DeviceCopier``: each call issued at once as a plain torch op.

    Where the engine runs on the CPU (``--cpu``, the tests) it checks the seam and the
    site map, not cucopy: nothing is merged or snapshotted, :attr:`calls` records
    ``(site, dst)`` and :attr:`guarded` counts by site the copies given a ``guard=`` (a
    plain copy all the same: the guard is not used). On CUDA (``stream`` given,
    ``backend`` the route's copier's, for ``is_pinned``) it is the ``twin_plain``
    variant: the routed sync step's host twin, uploaded region by region with
    ``copy_(non_blocking=True)`` and ``fill_`` on the engine's stream, so the twin's share
    of a gain is told apart from cucopy's.

    Parameters
    ----------
    stream : torch.cuda.Stream, optional
        Where the ops go (None: the engine runs on the CPU).
    backend : optional
        What the route asks ``is_pinned`` of (to make its guards); None: host memory,
        taken as pinned.
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
        self.guarded: Counter = Counter()
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

    def copy(self, site, dst, src, *, guard=None, **_) -> bool:
        """``dst[...] = src``, issued now (``guard`` only counted)."""
        self._counts[site] += 1
        if guard is not None:
            self.guarded[site] += 1
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


# -- setting up a tiny engine ----------------------------------------------------------------


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


class Engine:
    """A tiny model with a kept continuous-batching manager (from :func:`build_manager`).

    Attributes
    ----------
    model : LlamaForCausalLM
    prompts : list of list of int
    processor : ContinuousBatchProcessor
        The kept manager's batch processor: what :class:`CucopyRoute` routes.
    mode : str
        ``"async"`` or ``"sync"``.
    """

    def __init__(self, model, prompts, generation_config, cb_config, mode):
        self.model, self.prompts, self.mode = model, prompts, mode
        self.generation_config, self.cb_config = generation_config, cb_config
        self.reference = self.generate()  # builds and warms the kept manager
        self.processor = model.init_continuous_batching().batch_processor

    def generate(self) -> list:
        """One ``generate_batch`` on the kept manager: tokens per request, in input order.

        Raises
        ------
        RuntimeError
            When a request failed.
        """
        out = self.model.generate_batch(
            self.prompts,
            generation_config=self.generation_config,
            continuous_batching_config=self.cb_config,
            persistent_manager=True,
        )
        errors = [f"{r.request_id}: {r.error}" for r in out.values() if r.error is not None]
        if errors:
            raise RuntimeError(f"generate_batch: {len(errors)} requests failed: {errors[:3]}")
        return [list(r.generated_tokens) for r in out.values()]

    def close(self) -> None:
        """Destroy the kept manager."""
        self.model.destroy_cached_continuous_batching_manager()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_manager(
    mode: str = "sync",
    steps: int = 16,
    *,
    requests: int = 8,
    device=None,
    seed: int = 0,
    block_size: int = 32,
    num_blocks: int = 100,
    max_batch_tokens: int = 64,
) -> Engine:
    """A tiny seeded Llama and its kept continuous-batching manager, warmed by one run.

    Parameters
    ----------
    mode : {"async", "sync"}
        The engine's upload path (async needs CUDA).
    steps : int
        New tokens per request in each :meth:`Engine.generate` (decode steps).
    requests : int
        Prompts of 16-32 token ids each.
    device : torch.device or str, optional
        Default: the current CUDA device, or the CPU without one.
    seed : int
    block_size, num_blocks, max_batch_tokens : int
        The engine's fixed sizes (no memory probing).

    Returns
    -------
    Engine
        ``engine.processor`` is what :class:`CucopyRoute` takes; ``engine.generate()``
        runs ``steps`` decode steps for every request.

    Raises
    ------
    ValueError
        On an unknown mode, async mode without CUDA, or ``steps``/``requests`` < 1.
    """
    if mode not in ("async", "sync"):
        raise ValueError(f"build_manager: mode must be 'async' or 'sync', got {mode!r}")
    if steps < 1 or requests < 1:
        raise ValueError(f"build_manager: steps and requests must be >= 1, got {steps}, {requests}")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if mode == "async" and device.type != "cuda":
        raise ValueError(f"build_manager: async batching needs a CUDA device, got {device}")
    args = SimpleNamespace(
        seed=seed,
        requests=requests,
        new_tokens=steps,
        block_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
    )
    gen = GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=-1)
    return Engine(make_model(args, device), make_prompts(args), gen, cb_config(args, mode), mode)


def main(argv=None) -> int:
    """Generate unmodified, then routed; compare tokens; print the copier's counters."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--mode", choices=("async", "sync"), default=None, help="default: async on a GPU"
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--cpu", action="store_true", help="no GPU: sync mode with PlainCopier")
    args = p.parse_args(argv)
    if args.cpu:
        if args.mode == "async":
            p.error("--cpu runs sync mode only (async batching needs CUDA)")
        mode, device = "sync", torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device visible to torch: run with --cpu (sync mode, the seam only)")
        mode, device = args.mode or "async", torch.device("cuda")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    with build_manager(mode, args.new_tokens, requests=args.requests, device=device) as engine:
        with CucopyRoute(engine.processor, PlainCopier() if args.cpu else None) as route:
            tokens = engine.generate()
        print(route.stats_text())
    if tokens != engine.reference:
        print(f"MISMATCH: routed tokens differ from the unmodified engine's ({mode})")
        return 1
    print(f"match: {mode} mode, {len(tokens)} requests, tokens identical to the unmodified engine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
