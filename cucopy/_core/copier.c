/* copier.c: the copier's per-step core: begin/flush, step, activation
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

/* -- CopierCore: the copier's per-step fields, and begin()'s common case -----------
 *
 * ``cucopy.copier.DeviceCopier`` subclasses it (``copier.PyCopierCore`` is the Python
 * twin: the same fields in ``__slots__``). ``_begin_fast()`` is ``begin()`` when
 * nothing is unusual: the copier open and the step its thread's, nothing staged, no
 * check mode, the stream not capturing (asked through ``_cap_query(_cap_arg)``, the
 * backend's cheapest form of the query), and the ring's common step
 * (``RingCore.advance_fast``) taken. It checks all of that before changing anything
 * and returns False when any of it fails: ``begin()`` then runs its Python body,
 * whole. It returns True when the step is open.
 *
 * These types (SlotCore, RingCore, CopierCore, StepCore, Activation) are the ring's
 * and the copier's compiled parts, built into this module so that one extension holds
 * the whole per-step path; they import nothing: the copier hands them what they read
 * (the capture query, the launcher; check mode is pushed into the module's state by
 * cucopy.check whenever CHECK_MODE is set).
 *
 * The fields are the compiled class's own, typed: flags are C booleans (T_BOOL: Python
 * must assign a bool), the owner a thread id (0: none), sizes and limits C integers, the
 * flush mode an enum behind its attribute. Only references to objects stay objects. */

typedef struct {
    PyObject_HEAD
    char closed, in_step, capturing, stepping; /* _closed, _in_step, _capturing, _stepping */
    char guarded; /* _guarded: HostGuard events owed (_guards_owed: recorded at the flush) */
    char watching; /* _watching: check mode's guards to verify (_guards_watched: Python's) */
    char tags; /* _tags: a graphed launch writes its slot's completion tag (no event) */
    unsigned long long owner; /* _owner: the thread whose step is open (thread_id; 0: none) */
    long long cap_for, cap;   /* the slot size the table reservation is for, and it */
    long long carry_max;      /* the largest carried launch (0: none) */
    long long mapped_max;     /* the largest segment a mapped launch reads (-1: none) */
    long long graph_cap;      /* the graph kernel's first read (core.h's graph_reach) */
    int mode;                 /* flush_mode as MODE_* */
    PyObject *mode_str;       /* flush_mode as set (the interned literal) */
    PyObject *seg, *checker, *feed, *feed_pending, *ring, *slot, *tables, *stats;
    PyObject *cap_query, *cap_arg, *launcher, *handle;
    /* launcher's CarriedLauncher, read once when _launcher is set (NULL: not a launcher
     * capsule): PyCapsule_GetPointer compares the capsule's name each call, two lines of
     * two modules' constants on a cold host */
    CarriedLauncher *lp;
    long long fast_begins, fast_flushes;
    /* counts of stats' totals the fast paths took, not yet folded into stats (a
     * Python attribute += costs ~0.1 us a time): _take_counts() hands them over */
    long long n_steps, n_segments, n_bytes, n_inline, n_mapped;
    /* the Context its open step() block was entered in (0: none), and that step's
     * sequence number (see current_context) */
    long long step_ctx, step_seq;
    /* which of begin(), flush() and copy() the copier's class leaves as DeviceCopier's
     * (PLAIN_* bits, resolved once when the copier is made: copiercore_new): a class
     * that overrides one has it called, never the compiled path */
    int plain;
    PyObject *fastcopy; /* the class's copy when it is a FastCopy (cucopy.copy calls it) */
    /* what a guarded copy's compiled case (guard.c) reads and writes: the copier's
     * serial (never reused, unlike its address), wait_timeout, and _guards_owed (the
     * (guard, use) pairs whose events flush() records) */
    unsigned long long serial;
    PyObject *wait_timeout, *guards_owed;
    long long fast_guarded; /* guarded copies the compiled case issued */
    long long fast_fenced;  /* guard events the compiled flush recorded (guard.c) */
} CopierCore;
#define PLAIN_BEGIN 1
#define PLAIN_FLUSH 2

#define COPIER_FIELDS(X) X(mode_str) X(seg) X(checker) X(feed) X(feed_pending) X(ring) \
    X(slot) X(tables) X(stats) X(cap_query) X(cap_arg) X(launcher) X(handle) X(fastcopy) \
    X(wait_timeout) X(guards_owed)

GC_FIELDS(copiercore, CopierCore, COPIER_FIELDS)


static PyTypeObject CopierCoreType;

/* 1: not capturing; 0: capturing, or cannot tell (the Python path asks again); -1: a
 * BaseException raised by the query (propagated). With
 * the launcher's own capture query and a raw stream handle, straight from C (the same
 * query as cap_query, the Driver's is_capturing, without a Python call). L: the
 * copier's launcher when the caller has it already, else NULL (looked up here).
 * c_only: never call Python (0 when only the Python query could tell): a caller
 * holding borrowed pointers into the copier's state asks this way. */
static int not_capturing(CopierCore *c, CarriedLauncher *L, int c_only) {
    if (!c->cap_query || c->cap_query == Py_None || !c->cap_arg) return 0;
    if (!L && c->launcher) L = c->lp;
    unsigned long long stream;
    if (L && c->handle == c->cap_arg && L->abi == LAUNCHER_ABI && L->capturing &&
        u64_field(c->handle, &stream)) {
        int status = -1;
        return L->capturing(L->drv, stream, &status) == 0 && status == 0;
    }
    if (c_only) return 0;
    PyObject *st = PyObject_CallOneArg(c->cap_query, c->cap_arg);
    if (!st) return soft_clear(); /* 0 (the Python path asks again), or -1 */
    int idle = st == Py_False;
    if (!idle && PyLong_CheckExact(st)) {
        int overflow;
        idle = PyLong_AsLongLongAndOverflow(st, &overflow) == 0 && !overflow;
        PyErr_Clear();
    }
    Py_DECREF(st);
    return idle;
}

/* 1: no step is open, or the open one is thread me's (as the Python
 * ``not (c._in_step and c._owner != me)``); 0: another thread's, or not plain fields */
static int step_is_callers(CopierCore *c, uint64_t me) {
    return !c->in_step || c->owner == me;
}

/* what begin()'s and flush()'s fast paths need of the copier, each read afresh: open,
 * a compiled segment and ring, no checker, stats, and no other thread's step */
static int core_usable(CopierCore *c, uint64_t me) {
    return !c->closed && c->seg && Py_TYPE(c->seg) == &SegmentType && c->checker == Py_None &&
           c->ring && PyObject_TypeCheck(c->ring, &RingCoreType) && c->stats &&
           step_is_callers(c, me);
}

static int64_t nt_from_for(CopierCore *c);

static PyObject *copiercore_begin_fast(CopierCore *c, PyObject *unused) {
    uint64_t me = thread_id();
    if (!core_usable(c, me)) Py_RETURN_FALSE;
    Segment *seg = (Segment *)c->seg;
    if (nstaged(seg)) Py_RETURN_FALSE; /* staged: flushed first */
    if (S->check_mode) Py_RETURN_FALSE; /* (pushed by cucopy.check: _set_check_mode) */
    int idle = not_capturing(c, NULL, 0);
    if (idle < 0) return NULL;
    if (!idle) Py_RETURN_FALSE;
    /* the query may have been Python code: what was checked above is checked again (seg
     * compared by address first: dereferenced only while the copier still holds it) */
    if ((PyObject *)seg != c->seg || !core_usable(c, me) || S->check_mode || nstaged(seg))
        Py_RETURN_FALSE;
    long long cap_for = c->cap_for, cap = c->cap;
    if (!c->tables) Py_RETURN_FALSE;
    PyObject *slot;
    int adv = ring_advance((RingCore *)c->ring, c->seg, c->tables, &cap_for, &cap, &slot);
    if (adv < 0) {
        /* the ring took its step but binding failed: as begin() leaves it */
        c->in_step = 0;
        seg->fast = 0;
        Py_SETREF(c->feed, Py_NewRef(Py_None));
        Py_SETREF(c->feed_pending, Py_NewRef(Py_None));
        c->capturing = 0;
        Py_SETREF(c->slot, Py_NewRef(Py_None));
        seg_release(seg);
        seg->seg = -1;
        seg->cursor = 0;
        return NULL;
    }
    if (adv == 0) Py_RETURN_FALSE;
    /* the step is open from here: the fields as DeviceCopier._advance sets them */
    c->cap_for = cap_for; /* (another size when the slot is: rare) */
    c->cap = cap;
    seg->nt_from = nt_from_for(c);
    c->n_steps++; /* stats.steps += 1, folded when stats is read */
    Py_SETREF(c->slot, Py_NewRef(slot));
    Py_SETREF(c->feed, Py_NewRef(Py_None));
    Py_SETREF(c->feed_pending, Py_NewRef(Py_None));
    c->capturing = 0;
    c->owner = me;
    c->in_step = 1;
    seg->fast = 1;
    seg->owner = me;
    c->fast_begins++;
    Py_RETURN_TRUE;
}

/* stats.modes[how] += 1, stats.segments += 1, stats.bytes_staged += total: counted
 * here, folded into stats when it is read (CopyStats.pending_totals) */

/* The copier's flush mode as its enum: read once, when flush_mode is set (the literal
 * itself is kept for Python to read back). */
enum { MODE_OTHER, MODE_AUTO, MODE_INLINE, MODE_MAPPED, MODE_DMA };
static int flush_mode_kind(PyObject *fm) {
    if (fm == S->s_auto) return MODE_AUTO;
    if (fm == S->s_inline) return MODE_INLINE;
    if (fm == S->s_mapped) return MODE_MAPPED;
    if (fm == S->s_dma) return MODE_DMA;
    if (!fm || !PyUnicode_Check(fm)) return MODE_OTHER;
    if (!PyUnicode_CompareWithASCIIString(fm, "auto")) return MODE_AUTO;
    if (!PyUnicode_CompareWithASCIIString(fm, "inline")) return MODE_INLINE;
    if (!PyUnicode_CompareWithASCIIString(fm, "mapped")) return MODE_MAPPED;
    if (!PyUnicode_CompareWithASCIIString(fm, "dma")) return MODE_DMA;
    return MODE_OTHER;
}

/* DeviceCopier._nt_from: where the step's segments start staging with streaming stores.
 * mapped and dma: the GPU reads all of a segment; auto and inline: what lies past the
 * largest carry (the rest may travel in a launch, which the driver copies on the host). */
static int64_t nt_from_for(CopierCore *c) {
    if (S->nt_off) return -1;
    int kind = c->mode;
    if (kind == MODE_MAPPED || kind == MODE_DMA) return 0;
    return kind == MODE_OTHER ? -1 : c->carry_max;
}

static void count_segment(CopierCore *c, PyObject *how, int64_t total) {
    c->n_segments++;
    c->n_bytes += total;
    if (how == S->s_inline) c->n_inline++;
    else c->n_mapped++;
}

static PyObject *copiercore_take_counts(CopierCore *c, PyObject *unused) {
    PyObject *r = Py_BuildValue("(LLLLL)", c->n_steps, c->n_segments, c->n_bytes, c->n_inline,
                                c->n_mapped);
    if (r) c->n_steps = c->n_segments = c->n_bytes = c->n_inline = c->n_mapped = 0;
    return r;
}

/* the copier's launcher (ABI checked), or NULL */
static CarriedLauncher *core_launcher(CopierCore *c) {
    CarriedLauncher *L = c->launcher ? c->lp : NULL; /* (read once: _launcher's setter) */
    return L && L->abi == LAUNCHER_ABI ? L : NULL;
}

/* StagingRing.record after a launch or copies that read the slot: the slot's event
 * recorded (E->record), the ring's bookkeeping as record() keeps it. 1 recorded, 0 not
 * (the Python path records it). */
static int record_slot(RingCore *ring, SlotCore *slot, CarriedLauncher *E,
                       unsigned long long event, unsigned long long stream) {
    if (E->record(E->drv, event, stream) != 0) return 0;
    Py_SETREF(slot->recorded, Py_NewRef(Py_True));
    Py_SETREF(slot->dirty, Py_NewRef(Py_False));
    long long acquires, index;
    if (int_field(ring->acquires, &acquires) && int_field(ring->index, &index)) {
        slot->stamp = acquires;
        ring->newest = index;
        ring->newest_stamp = acquires;
    } else { /* cannot happen (checked by the callers); forget what is known, to be safe */
        PyErr_Clear();
        slot->stamp = -1;
        ring->newest = -1;
        ring->certified = -1;
    }
    return 1;
}

/* the event of the ring's current slot (c->slot) as a raw handle: 1 found, else 0 */
static int current_event(CopierCore *c, RingCore *ring, unsigned long long *event) {
    long long index;
    int ok = ring->current == c->slot && ring->events && PyList_CheckExact(ring->events) &&
             int_field(ring->index, &index) && index >= 0 &&
             index < PyList_GET_SIZE(ring->events) &&
             u64_field(PyList_GET_ITEM(ring->events, index), event);
    PyErr_Clear();
    return ok;
}

/* the HostGuard events the step owes (guard.c: DeviceCopier._fence_guards' common
 * case): whether any is owed; whether the compiled flush may record them all (checked
 * before it changes anything); recording them (after the step's work: the launch and
 * the slot's event) */
static int guards_owe(CopierCore *c);
static int guards_ready(CopierCore *c, CarriedLauncher *E, unsigned long long stream);
static int fence_guards(CopierCore *c, CarriedLauncher *E, unsigned long long stream);

/* flush() with nothing staged and the slot dirtied by eager or guarded copies (or only
 * guard events owed): flush()'s body (the capture query, then the slot's event and the
 * guards' events recorded), from C. 1 done, 0 the body's (nothing changed, or the
 * events not recorded left owed), -1 an error the query raised. */
static int flush_dirty(CopierCore *c) {
    CarriedLauncher *E = core_launcher(c);
    if (!E || !E->record || !E->query || !c->handle) return 0;
    int idle = not_capturing(c, E, 0);
    if (idle <= 0) return idle; /* (-1: an error the query raised) */
    /* the query may have been Python code: everything below is read afresh */
    if (!core_usable(c, thread_id()) || c->watching || nstaged((Segment *)c->seg)) return 0;
    E = core_launcher(c);
    if (!E || !E->record || !E->query || !c->handle) return 0;
    RingCore *ring = (RingCore *)c->ring;
    unsigned long long stream, event;
    if (!c->slot || !PyObject_TypeCheck(c->slot, &SlotCoreType) ||
        !u64_field(c->handle, &stream)) {
        PyErr_Clear();
        return 0;
    }
    SlotCore *slot = (SlotCore *)c->slot;
    int owes = guards_owe(c);
    if (owes && !guards_ready(c, E, stream)) return 0;
    if (slot->dirty == Py_True) {
        if (!current_event(c, ring, &event) || !record_slot(ring, slot, E, event, stream)) {
            PyErr_Clear();
            return 0;
        }
    } else if (slot->dirty != Py_False || !owes) {
        return 0;
    }
    /* the slot's event first, as _flush_rest records it (ring.record, then
     * _fence_guards) */
    return owes ? fence_guards(c, E, stream) : 1;
}

static PyObject *copiercore_flush_fast(CopierCore *c, PyObject *unused) {
    uint64_t me = thread_id();
    /* (check mode's guards to verify: _fence_guards, which clears them once it is off) */
    if (!core_usable(c, me) || c->watching) Py_RETURN_FALSE;
    Segment *seg = (Segment *)c->seg;
    RingCore *ring = (RingCore *)c->ring;
    if (!nstaged(seg)) {
        /* nothing staged and no event owed (a step whose every copy was skipped as
         * unchanged): flush()'s body would return at once, so return here */
        PyObject *cur = ring->current;
        if ((!cur || cur == Py_None ||
             (is_slot(cur) && ((SlotCore *)cur)->dirty == Py_False)) &&
            !guards_owe(c))
            Py_RETURN_TRUE;
        /* eager or guarded copies only (a plan that merges nothing, a step whose one
         * copy reads a HostGuard's buffer): their events, from C */
        int done = flush_dirty(c);
        if (done < 0) return NULL;
        if (done) Py_RETURN_TRUE;
        Py_RETURN_FALSE;
    }
    if (!c->lp || !c->launcher) Py_RETURN_FALSE; /* (no C launch) */
    /* asked before any of the state read below is used: the query may be Python code
     * (then everything checked above is checked again, read afresh) */
    int idle = not_capturing(c, NULL, 0);
    if (idle < 0) return NULL;
    if (!idle) Py_RETURN_FALSE;
    if (!core_usable(c, me) || !nstaged((Segment *)c->seg)) Py_RETURN_FALSE;
    seg = (Segment *)c->seg;
    ring = (RingCore *)c->ring;
    if (!c->lp || !c->launcher || !c->handle || !c->slot || !is_slot(c->slot))
        Py_RETURN_FALSE;
    /* carried whole when it fits (inline, auto); else read mapped (mapped, auto) */
    int kind = c->mode;
    int carries = kind == MODE_AUTO || kind == MODE_INLINE;
    int mapped_only = kind == MODE_MAPPED;
    int is_auto = kind == MODE_AUTO;
    if (!carries && !mapped_only) Py_RETURN_FALSE;
    SlotCore *slot = (SlotCore *)c->slot;
    if (!seg->bound || seg->slot != c->slot || !slot->base) Py_RETURN_FALSE;
    CarriedLauncher *L = c->lp;
    unsigned long long stream, dev;
    long long inline_max = c->carry_max;
    if (!L || !u64_field(c->handle, &stream) || !u64_field(slot->base, &dev)) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    /* a mapped launch needs the slot's event recorded after it, from C */
    long long mapped_max = -1;
    unsigned long long event = 0;
    CarriedLauncher *E = L->abi == LAUNCHER_ABI && L->record && L->query ? L : NULL;
    int have_event = E && current_event(c, ring, &event);
    if (!have_event || (mapped_max = c->mapped_max) < 0) mapped_max = -1;
    if (mapped_only && mapped_max < 0) Py_RETURN_FALSE;
    /* the guards' events the step owes: recorded after the launch and the slot's event,
     * from C when each can be; else the whole flush is the Python body's */
    int owes = guards_owe(c);
    if (owes && (c->watching || !have_event || !guards_ready(c, E, stream)))
        Py_RETURN_FALSE;
    /* from here on as _flush_segment: an error is flush()'s to report (the segment cut) */
    int64_t off, end, nblocks;
    Py_ssize_t n;
    long long gcap = c->graph_cap;
    /* mapped: the table compacted when the segment then fits a graphed launch's read (a
     * table reserved for a longer step leaves a gap), as _flush_segment cuts it */
    long long compact = carries ? inline_max : mapped_only && gcap > 0 ? graph_max(gcap) : -1;
    if (cut_impl(seg, compact, &off, &end, &nblocks, &n) < 0) return NULL;
    int64_t total = end - off, head = HEADER_BYTES + (int64_t)n * DESC_BYTES;
    PyObject *how = NULL;
    int64_t reach = graph_reach(gcap, total, is_auto); /* (pack.graph_reach) */
    if (mapped_max >= 0 && (mapped_only || (is_auto && total <= mapped_max)) && E->graphed &&
        gcap > 0 && (size_t)gcap <= E->graph_cap && reach > 0 &&
        off + reach <= (int64_t)seg->view.len && off + reach <= seg->top) {
        /* _land's graphed launch (mapped, and auto: half a carried launch's host
         * time): its kernel reads reach bytes at the segment when it runs (gcap, or
         * all of a longer segment), so the slot's next segment starts past them. The
         * step's first reader of the slot is tagged (the slot's completion tag armed
         * with the step, here): when it is also the last, the flush records no event
         * and the next turn asks none */
        long long step = -1;
        int tag = c->tags && E->graphed_tag && slot->dirty == Py_False && slot->tag < 0 &&
                  slot->tag_host && int_field(ring->acquires, &step) && step >= 0;
        PyErr_Clear();
        int rc;
        if (tag) {
            ((volatile uint64_t *)(uintptr_t)slot->tag_host)[0] = (uint64_t)step;
            rc = E->graphed_tag(E->drv, stream, dev + (unsigned long long)off,
                                dev + (unsigned long long)(long long)TAG_AT);
        } else {
            rc = E->graphed(E->drv, stream, dev + (unsigned long long)off);
        }
        if (rc == 0) {
            if (seg->cursor < off + reach) seg->cursor = off + reach;
            how = S->s_mapped;
            if (tag)
                slot->tag = step;
            else
                Py_SETREF(slot->dirty, Py_NewRef(Py_True));
        } else if (rc != -1) {
            goto cut; /* the driver's error (or another context): flush()'s body's */
        }
        /* -1: no graph may launch on this stream (every graph of the driver's pool last
         * launched on another stream): the branches below launch it, as if it were
         * never graphed (_land's scatter_graphed launches it mapped, uncarried, then).
         * Nothing above changed but the tag's armed host word, which is harmless: no
         * kernel was handed the cell to copy it, slot->tag stays -1 so no wait reads
         * the tag, and the slot's next arming writes the word anew */
    }
    if (how) {
        /* launched graphed: nothing more to launch */
    } else if (carries && total <= inline_max) {
        if (launch_carried(seg, L, nblocks, stream, dev + (unsigned long long)off, total) != 0)
            goto cut;
        how = S->s_inline; /* carried whole: no event needed for it */
    } else if (mapped_max >= 0 && head <= inline_max &&
               (mapped_only || total <= mapped_max)) {
        /* _land's mapped launch carrying the header and the table (head <= the largest
         * carry); the uncarried kernel's case stays _land's */
        if (launch_carried(seg, L, nblocks, stream, dev + (unsigned long long)off,
                           align_up(head, ALIGN)) != 0)
            goto cut;
        how = S->s_mapped;
        /* the launch reads the slot when it runs: its event follows it */
        Py_SETREF(slot->dirty, Py_NewRef(Py_True));
    } else {
        goto cut;
    }
    count_segment(c, how, total);
    PyObject *f = seg_finish(seg, NULL);
    if (!f) return NULL;
    Py_DECREF(f);
    c->fast_flushes++;
    if (how == S->s_mapped && slot->dirty == Py_True)
        record_slot(ring, slot, E, event, stream); /* StagingRing.record */
    else if (how == S->s_inline && slot->dirty == Py_True && have_event)
        /* a carried launch after eager copies: their event, from C as well */
        record_slot(ring, slot, E, event, stream);
    /* the slot dirtied in the step (an eager copy, or a record that failed):
     * flush()'s body records it (and the guards' events after it) */
    if (ring->current && is_slot(ring->current) &&
        ((SlotCore *)ring->current)->dirty != Py_False)
        Py_RETURN_FALSE;
    if (owes) { /* (_fence_guards' common case; 0: left owed, for the body's to report) */
        int r = fence_guards(c, E, stream);
        if (r < 0) return NULL;
        if (!r) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
cut:
    return Py_BuildValue("(LLLn)", (long long)off, (long long)end, (long long)nblocks, n);
}

/* whether self is a CopierCore: the copier's class (a subclass: an MRO walk each time)
 * remembered once seen; the reference keeps it alive, so no other type takes its address */
static int is_core(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (tp == (PyTypeObject *)S->known_core || tp == &CopierCoreType) return 1;
    if (!PyType_IsSubtype(tp, &CopierCoreType)) return 0;
    Py_XSETREF(S->known_core, Py_NewRef((PyObject *)tp));
    return 1;
}

static PyObject *core_seg(PyObject *self) {
    return is_core(self) ? ((CopierCore *)self)->seg : NULL;
}

static PyObject *core_fastcopy(PyObject *self) {
    return is_core(self) ? ((CopierCore *)self)->fastcopy : NULL;
}

/* -- the eager path, compiled (DeviceCopier._eager_h2d's common case) ---------------
 *
 * An H2D copy through a site the plan does not merge, in this thread's open step (not
 * under capture, not in check mode), of a cached destination from a NumPy array or a
 * cached source: its bytes snapshotted into the slot's top at the call (the promise
 * that rules out the refilled-buffer race), then one driver copy from there (the
 * launcher's copy(); the backend's copy2d without one), the slot marked dirty (its
 * event is recorded once, at the flush), the copy counted (fold_eager). Anything else
 * is the Python path's (MISS), which asks everything again. STAGED: issued. */
/* one H2D copy of rows rows of width bytes (pitches dpitch, spitch) on the copier's
 * stream: one driver copy through the launcher's copy(), else (no C copy: the simulator,
 * another context current; or a failed one) the backend's copy2d, which copies or
 * raises the error it reports. 0, or -1 with the error set (the eager and the guarded
 * copy's common cases) */
static int copier_copy2d(PyObject *self, CopierCore *c, CarriedLauncher *L, addr_t dst,
                         int64_t dpitch, addr_t src, int64_t spitch, int64_t width,
                         int64_t rows) {
    unsigned long long stream;
    int rc = -1;
    if (L && L->copy && c->handle && u64_field(c->handle, &stream))
        rc = L->copy(L->drv, dst, (unsigned long long)dpitch, (const void *)(uintptr_t)src,
                     (unsigned long long)spitch, (unsigned long long)width,
                     (unsigned long long)rows, stream);
    PyErr_Clear(); /* (u64_field on a handle that is not an int) */
    if (rc == 0) return 0;
    PyObject *be = PyObject_GetAttr(self, S->s_backend_attr);
    PyObject *fn = be ? PyObject_GetAttr(be, S->s_copy2d) : NULL;
    PyObject *st = fn ? PyObject_GetAttr(self, S->s_stream_attr) : NULL;
    PyObject *a1 = st ? PyLong_FromUnsignedLongLong(dst) : NULL;
    PyObject *a2 = a1 ? PyLong_FromLongLong(dpitch) : NULL;
    PyObject *a3 = a2 ? PyLong_FromUnsignedLongLong(src) : NULL;
    PyObject *a4 = a3 ? PyLong_FromLongLong(spitch) : NULL;
    PyObject *a5 = a4 ? PyLong_FromLongLong(width) : NULL;
    PyObject *a6 = a5 ? PyLong_FromLongLong(rows) : NULL;
    PyObject *res = NULL;
    if (a6) {
        PyObject *v[8] = {Py_True, a1, a2, a3, a4, a5, a6, st};
        res = PyObject_Vectorcall(fn, v, 8, NULL);
    }
    Py_XDECREF(be); Py_XDECREF(fn); Py_XDECREF(st);
    Py_XDECREF(a1); Py_XDECREF(a2); Py_XDECREF(a3); Py_XDECREF(a4); Py_XDECREF(a5);
    Py_XDECREF(a6);
    if (!res) return -1;
    Py_DECREF(res);
    return 0;
}

static int core_eager(PyObject *self, PyObject *site, PyObject *dst, PyObject *src,
                      PyObject *on_drop) {
    if (!is_core(self)) return MISS;
    CopierCore *c = (CopierCore *)self;
    uint64_t me = thread_id();
    if (!core_usable(c, me) || !c->in_step || c->capturing || S->check_mode) return MISS;
    Segment *s = (Segment *)c->seg;
    if (!seg_usable(s) || !s->slot || !PyObject_TypeCheck(s->slot, &SlotCoreType) ||
        (on_drop != Py_None && !PyCallable_Check(on_drop)))
        return MISS;
    int fl = site_flags(s, site);
    if (fl < 0) return soft_clear() < 0 ? -1 : MISS;
    if (!(fl & SITE_EAGER)) return MISS;
    Py_INCREF(s); /* held: what follows may run Python code (a fingerprint, the query) */
    int out = MISS;
    if (!s->pinned_ptr) { /* the slot's pinned.ptr, once a binding */
        PyObject *pin = PyObject_GetAttrString(s->slot, "pinned");
        PyObject *p = pin ? PyObject_GetAttrString(pin, "ptr") : NULL;
        unsigned long long v = p && PyLong_Check(p) ? PyLong_AsUnsignedLongLong(p) : 0;
        Py_XDECREF(pin);
        Py_XDECREF(p);
        if (PyErr_Occurred() || !v) { out = soft_clear() < 0 ? -1 : MISS; goto done; }
        if (!seg_usable(s)) goto done;
        s->pinned_ptr = v;
    }
    /* the capture state first (a capture begun since begin() is the Python path's
     * to refuse), then nothing but the source's checks before the snapshot */
    CarriedLauncher *L = core_launcher(c);
    int idle = not_capturing(c, L, 0);
    if (idle <= 0) { out = idle < 0 ? -1 : MISS; goto done; }
    if (c->seg != (PyObject *)s || !core_usable(c, me) || !c->in_step || c->capturing ||
        S->check_mode)
        goto done;
    Eager e;
    int r = eager_source(s, dst, src, &e);
    if (r <= 0) { out = r < 0 ? -1 : MISS; goto done; }
    if (c->seg != (PyObject *)s || !core_usable(c, me) || !s->slot ||
        !PyObject_TypeCheck(s->slot, &SlotCoreType)) {
        Py_DECREF(e.g.hold);
        goto done;
    }
    /* the slot's top taken (take_top), nothing can fail from here until the copy */
    PyObject *topv = PyLong_FromLongLong(e.top);
    if (!topv) { Py_DECREF(e.g.hold); out = -1; goto done; }
    SlotCore *slot = (SlotCore *)s->slot;
    Py_SETREF(slot->top, topv);
    s->top = e.top;
    char *snap = (char *)s->view.buf + e.top;
    if (e.spitch)
        for (int64_t i = 0; i < e.g.rows; i++)
            memcpy(snap + i * e.g.width, e.src + i * e.spitch, (size_t)e.g.width);
    else
        memcpy(snap, e.src, (size_t)e.g.nbytes);
    /* work reading the slot is enqueued below: its event follows, at the flush */
    Py_SETREF(slot->dirty, Py_NewRef(Py_True));
    addr_t host = s->pinned_ptr + (addr_t)e.top;
    if (copier_copy2d(self, c, L, e.g.ptr, e.g.pitch, host, e.g.width, e.g.width, e.g.rows) < 0) {
        Py_DECREF(e.g.hold);
        out = -1;
        goto done;
    }
    Py_DECREF(e.g.hold);
    Py_ssize_t i = count_index(s, site); /* its eager count (stats.sites[site].eager) */
    if (i < 0) { out = -1; goto done; }
    s->evals[i]++;
    out = STAGED;
done:
    Py_DECREF(s);
    return out;
}

static PyObject *copiercore_begin(CopierCore *c, PyObject *unused);
static PyObject *copiercore_flush(CopierCore *c, PyObject *unused);

static PyMethodDef copiercore_methods[] = {
    {"begin", (PyCFunction)copiercore_begin, METH_NOARGS,
     "begin($self, /)\n--\n\n"
     "Start a step: advance the ring (waiting only if the next slot is in flight).\n\n"
     "Anything still staged from the previous step is flushed first, and in check mode its "
     "``unchanged`` claims are verified (the common step in C, the rest in ``_begin_body``).\n\n"
     "Raises\n------\nCopyError\n    From that flush (nothing staged is lost), or a false "
     "claim in check mode."},
    {"flush", (PyCFunction)copiercore_flush, METH_NOARGS,
     "flush($self, /)\n--\n\n"
     "Barrier: land everything staged (one upload + one launch per open segment).\n\n"
     "Also records the slot's event where one is owed. Does nothing while the stream is "
     "capturing (the common case in C, the rest in ``_flush_rest``)."},
    {"_flush_fast", (PyCFunction)copiercore_flush_fast, METH_NOARGS,
     "flush()'s common case: True when done, False for flush()'s Python body, or the cut "
     "(seg, end, nblocks, n) of a segment it could not launch carried whole."},
    {"_begin_fast", (PyCFunction)copiercore_begin_fast, METH_NOARGS,
     "begin()'s common case: True when the step is open, False for begin()'s Python body "
     "(nothing changed)."},
    {"_take_counts", (PyCFunction)copiercore_take_counts, METH_NOARGS,
     "(steps, segments, bytes_staged, inline, mapped) the fast paths counted since the "
     "last call; zeroes them."},
    {NULL},
};

#define MEMBER(name, f) {name, T_OBJECT_EX, offsetof(CopierCore, f), 0, NULL},
#define TYPED(name, T, f) {name, T, offsetof(CopierCore, f), 0, NULL},
static PyMemberDef copiercore_members[] = {
    TYPED("_closed", T_BOOL, closed) TYPED("_in_step", T_BOOL, in_step)
    TYPED("_capturing", T_BOOL, capturing) TYPED("_stepping", T_BOOL, stepping)
    TYPED("_guarded", T_BOOL, guarded) TYPED("_watching", T_BOOL, watching)
    TYPED("_tags", T_BOOL, tags)
    TYPED("_owner", T_ULONGLONG, owner) TYPED("_cap_for", T_LONGLONG, cap_for)
    TYPED("_cap", T_LONGLONG, cap) TYPED("_carry_max", T_LONGLONG, carry_max)
    TYPED("_mapped_max", T_LONGLONG, mapped_max) TYPED("_graph_cap", T_LONGLONG, graph_cap)
    MEMBER("_seg", seg) MEMBER("_checker", checker) MEMBER("_feed", feed)
    MEMBER("_feed_pending", feed_pending) MEMBER("_ring", ring) MEMBER("_slot", slot)
    MEMBER("_tables", tables) MEMBER("stats", stats) MEMBER("_cap_query", cap_query)
    MEMBER("_cap_arg", cap_arg) MEMBER("_handle", handle)
    MEMBER("wait_timeout", wait_timeout) MEMBER("_guards_owed", guards_owed)
    {"_serial", T_ULONGLONG, offsetof(CopierCore, serial), READONLY,
     "The copier's serial number (never reused): a HostGuard's use names its copier by it."},
    {"_fast_begins", T_LONGLONG, offsetof(CopierCore, fast_begins), READONLY,
     "Steps begun by _begin_fast."},
    {"_fast_flushes", T_LONGLONG, offsetof(CopierCore, fast_flushes), READONLY,
     "Segments landed by _flush_fast."},
    {"_fast_guarded", T_LONGLONG, offsetof(CopierCore, fast_guarded), READONLY,
     "copy(guard=) calls the compiled case issued (guard.c)."},
    {"_fast_fenced", T_LONGLONG, offsetof(CopierCore, fast_fenced), READONLY,
     "HostGuard events the compiled flush recorded (guard.c, fence_guards)."},
    {"_step_ctx", T_LONGLONG, offsetof(CopierCore, step_ctx), READONLY,
     "The Context (its address) the open step() block was entered in; 0: none."},
    {"_plain_bits", T_INT, offsetof(CopierCore, plain), READONLY,
     "Which of begin() (1) and flush() (2) the class leaves as DeviceCopier's."},
    {"_step_seq", T_LONGLONG, offsetof(CopierCore, step_seq), READONLY,
     "The open step() block's sequence number (the innermost step has the largest)."},
    {NULL},
};
#undef MEMBER
#undef TYPED

static PyObject *copiercore_get_flush_mode(CopierCore *c, void *unused) {
    if (!c->mode_str) {
        PyErr_SetString(PyExc_AttributeError, "flush_mode");
        return NULL;
    }
    return Py_NewRef(c->mode_str);
}

static int copiercore_set_flush_mode(CopierCore *c, PyObject *v, void *unused) {
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "flush_mode cannot be deleted");
        return -1;
    }
    c->mode = flush_mode_kind(v); /* (DeviceCopier validates it first) */
    Py_XSETREF(c->mode_str, Py_NewRef(v));
    return 0;
}

static PyObject *copiercore_get_launcher(CopierCore *c, void *unused) {
    if (!c->launcher) {
        PyErr_SetString(PyExc_AttributeError, "_launcher");
        return NULL;
    }
    return Py_NewRef(c->launcher);
}

/* the launcher capsule (or None), and its struct, read here once */
static int copiercore_set_launcher(CopierCore *c, PyObject *v, void *unused) {
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "_launcher cannot be deleted");
        return -1;
    }
    CarriedLauncher *L = NULL;
    if (PyCapsule_CheckExact(v)) {
        L = PyCapsule_GetPointer(v, LAUNCHER_NAME);
        if (!L) PyErr_Clear();
    }
    Py_XSETREF(c->launcher, Py_NewRef(v));
    c->lp = L;
    return 0;
}

static PyGetSetDef copiercore_getset[] = {
    {"flush_mode", (getter)copiercore_get_flush_mode, (setter)copiercore_set_flush_mode,
     "How a segment lands: 'dma', 'mapped', 'inline' or 'auto'.", NULL},
    {"_launcher", (getter)copiercore_get_launcher, (setter)copiercore_set_launcher,
     "The compiled launcher (a capsule from the backend's carried_launcher()), or None.", NULL},
    {NULL},
};

/* A new copier core: its class's plain methods resolved once (public look-ups on its
 * MRO; per step the core reads the bits, not the class) */
static PyObject *copiercore_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    CopierCore *c = (CopierCore *)PyType_GenericNew(tp, args, kw);
    if (!c) return NULL;
    c->cap_for = c->cap = c->mapped_max = -1; /* (DeviceCopier.__init__ sets them all) */
    static unsigned long long serials; /* (the GIL is held) */
    c->serial = ++serials;
    PyObject *m;
    if (S->plain_begin && type_lookup(tp, S->s_begin) == S->plain_begin) c->plain |= PLAIN_BEGIN;
    if (S->plain_flush && type_lookup(tp, S->s_flush) == S->plain_flush) c->plain |= PLAIN_FLUSH;
    if ((m = type_lookup(tp, S->s_copy)) && Py_IS_TYPE(m, &FastCopyType))
        c->fastcopy = Py_NewRef(m);
    return (PyObject *)c;
}

static PyTypeObject CopierCoreType = CORE_TYPE(copiercore, CopierCore, copiercore_methods,
    "The copier's per-step fields and begin()'s common case (compiled twin of "
              "cucopy.copier.PyCopierCore).");

/* -- StepCore: what DeviceCopier.step() returns, its common case compiled ----------
 *
 * ``cucopy.copier._Step`` subclasses it (``copier.PyStepCore`` is the Python twin).
 * ``__enter__`` of a plain step opens it with ``_begin_fast`` when that takes it,
 * ``__exit__`` of a step that raised nothing calls ``flush()`` and closes the step;
 * anything else (a graph step, an exception, a nested or foreign step, a begin the
 * fast path declines) goes to ``_Step._enter`` / ``_exit``, the Python bodies. */

typedef struct {
    PyObject_HEAD
    PyObject *copier, *graph;
} StepCore;

#define STEP_FIELDS(X) X(copier) X(graph)
GC_FIELDS(stepcore, StepCore, STEP_FIELDS)

static int stepcore_init(StepCore *st, PyObject *args, PyObject *kw) {
    PyObject *copier, *graph = Py_None;
    static char *kwlist[] = {"copier", "graph", NULL};
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (!kw && (n == 1 || n == 2)) { /* step()'s own call: no argument parsing */
        copier = PyTuple_GET_ITEM(args, 0);
        if (n == 2) graph = PyTuple_GET_ITEM(args, 1);
    } else if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:_Step", kwlist, &copier, &graph)) {
        return -1;
    }
    Py_XSETREF(st->copier, Py_NewRef(copier));
    Py_XSETREF(st->graph, Py_NewRef(graph));
    return 0;
}


static PyObject *stepcore_plain_begin(PyObject *type, PyObject *func) {
    Py_XSETREF(S->plain_begin, Py_NewRef(func));
    Py_RETURN_NONE;
}

static PyObject *stepcore_plain_flush(PyObject *type, PyObject *func) {
    Py_XSETREF(S->plain_flush, Py_NewRef(func));
    Py_RETURN_NONE;
}

/* -- a step activates its copier (issue 30: no silent bypass) -----------------------
 * For the block's duration the copier is the one cucopy.copy routes to in the
 * context the step was entered in. Setting the context variable cucopy.copy reads
 * costs ~1.4k instructions a step (PyContextVar_Set + Reset: a HAMT node and a
 * token), so the step records its context instead (the thread state's current
 * Context object, and a sequence number: the innermost step wins), a few
 * instructions; cucopy.copy's Python fallback, taken only when no copier is
 * activated, finds the copier by it (copier._step_copier). */

/* (current_context: foreign.c, it reads CPython's thread state) */

static PyObject *mod_context_id(PyObject *m, PyObject *unused) {
    PyObject *ctx = current_context();
    return ctx ? PyLong_FromVoidPtr(ctx) : NULL;
}

/* DeviceCopier.flush: _flush_fast, then _flush_failed on an error or _flush_rest when it
 * did not land the step; True (a new reference) when _flush_fast did */
static PyObject *flush_body(CopierCore *c) {
    PyObject *o = (PyObject *)c;
    PyObject *done = copiercore_flush_fast(c, NULL);
    if (!done) {
        /* flush(): except BaseException as exc: self._flush_failed(exc) (raises) */
        PyObject *tp, *exc, *tb;
        PyErr_Fetch(&tp, &exc, &tb);
        PyErr_NormalizeException(&tp, &exc, &tb);
        if (tb && exc) PyException_SetTraceback(exc, tb);
        Py_XDECREF(tp);
        Py_XDECREF(tb);
        if (!exc) return NULL; /* (no exception after all: cannot happen) */
        PyObject *r = PyObject_CallMethodOneArg(o, S->s_flush_failed, exc);
        Py_DECREF(exc);
        Py_XDECREF(r);
        if (r) {
            PyErr_SetString(PyExc_SystemError, "_flush_failed() returned");
        }
        return NULL;
    }
    if (done == Py_True) return done;
    PyObject *r = PyObject_CallMethodOneArg(o, S->s_flush_rest, done);
    Py_DECREF(done);
    return r;
}

/* flush() of copier c: its body from here (no Python frame a step), or the copier's
 * own flush() when a subclass has one */
static PyObject *step_flush(CopierCore *c) {
    if (!(c->plain & PLAIN_FLUSH)) return PyObject_CallMethodNoArgs((PyObject *)c, S->s_flush);
    return flush_body(c);
}

/* DeviceCopier.begin and .flush themselves (cucopy.copier leaves them to these when the
 * core is compiled): a call of either runs no Python frame in the common step, which on
 * a cold host's first call into cucopy after an engine's own work saved ~50 cache lines
 * of the interpreter's code and data (bench/probes/cold_lines.py) */
static PyObject *copiercore_begin(CopierCore *c, PyObject *unused) {
    PyObject *r = copiercore_begin_fast(c, NULL);
    if (!r) return NULL;
    Py_DECREF(r);
    if (r == Py_True) Py_RETURN_NONE;
    return PyObject_CallMethodNoArgs((PyObject *)c, S->s_begin_body);
}

static PyObject *copiercore_flush(CopierCore *c, PyObject *unused) {
    PyObject *r = flush_body(c);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *stepcore_enter(StepCore *st, PyObject *unused) {
    PyObject *ctx = current_context();
    if (!ctx) return NULL;
    PyObject *o = st->copier;
    if (o && st->graph == Py_None && PyObject_TypeCheck(o, &CopierCoreType) &&
        (((CopierCore *)o)->plain & PLAIN_BEGIN)) {
        CopierCore *c = (CopierCore *)o;
        if (!c->stepping && !c->closed) {
            Py_INCREF(o); /* held: begin runs Python code on some backends */
            PyObject *r = copiercore_begin_fast(c, NULL);
            if (!r) {
                Py_DECREF(o);
                return NULL;
            }
            Py_DECREF(r);
            if (r == Py_True) {
                c->stepping = 1;
                c->step_ctx = (long long)(uintptr_t)ctx; /* the block's context */
                c->step_seq = ++S->step_counter;
                return o; /* (the reference held above) */
            }
            Py_DECREF(o);
        }
    }
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)st, S->s_enter);
    if (r && o && PyObject_TypeCheck(o, &CopierCoreType)) {
        ((CopierCore *)o)->step_ctx = (long long)(uintptr_t)ctx;
        ((CopierCore *)o)->step_seq = ++S->step_counter;
    }
    return r;
}

static PyObject *stepcore_exit(StepCore *st, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__(type, value, traceback)");
        return NULL;
    }
    PyObject *o = st->copier;
    int core = o && PyObject_TypeCheck(o, &CopierCoreType);
    /* another thread's exit: _exit refuses it, leaving the owner's step as it is */
    int foreign = core && !step_is_callers((CopierCore *)o, thread_id());
    if (args[0] != Py_None || st->graph != Py_None || !core || foreign ||
        !((CopierCore *)o)->seg || Py_TYPE(((CopierCore *)o)->seg) != &SegmentType) {
        if (core && !foreign) ((CopierCore *)o)->step_ctx = 0; /* the block ends */
        return PyObject_VectorcallMethod(
            S->s_exit, (PyObject *[]){(PyObject *)st, args[0], args[1], args[2]}, 4, NULL);
    }
    CopierCore *c = (CopierCore *)Py_NewRef(o); /* held: flush() runs Python code */
    c->step_ctx = 0;
    c->stepping = 0;
    PyObject *r = step_flush(c);
    /* finally: the step is over, whatever flush() did (its segment read again: that
     * code may have replaced it) */
    c->in_step = 0;
    if (c->seg && Py_TYPE(c->seg) == &SegmentType) ((Segment *)c->seg)->fast = 0;
    Py_DECREF(c);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyMethodDef stepcore_methods[] = {
    {"_plain_begin", (PyCFunction)stepcore_plain_begin, METH_O | METH_CLASS,
     "_plain_begin(DeviceCopier.begin): __enter__'s compiled path runs only for a copier "
     "whose begin() is this one (a subclass's own begin() is called)."},
    {"_plain_flush", (PyCFunction)stepcore_plain_flush, METH_O | METH_CLASS,
     "_plain_flush(DeviceCopier.flush): __exit__ calls _flush_fast itself only for a "
     "copier whose flush() is this one (a subclass's own flush() is called)."},
    {"__enter__", (PyCFunction)stepcore_enter, METH_NOARGS, "begin(); the copier."},
    {"__exit__", (PyCFunction)(void (*)(void))stepcore_exit, METH_FASTCALL,
     "flush(), or discard() on an exception; False."},
    {NULL},
};

static PyMemberDef stepcore_members[] = {
    {"_copier", T_OBJECT_EX, offsetof(StepCore, copier), 0, NULL},
    {"_graph", T_OBJECT_EX, offsetof(StepCore, graph), 0, NULL},
    {NULL},
};

static PyTypeObject StepCoreType = CORE_TYPE(stepcore, StepCore, stepcore_methods,
    "What DeviceCopier.step() returns, its common case compiled (twin of "
    "cucopy.copier.PyStepCore).");

/* -- Activation: what DeviceCopier.activate() returns, compiled ---------------------
 * The active copier is a context variable (cucopy.copy routes through it); entering
 * sets it, leaving resets it to what it was. Twin of cucopy.copier._PyActivation. */

typedef struct {
    PyObject_HEAD
    PyObject *copier, *var, *token;
} Activation;

#define ACTIVATION_FIELDS(X) X(copier) X(var) X(token)
GC_FIELDS(activation, Activation, ACTIVATION_FIELDS)

static int activation_init(Activation *a, PyObject *args, PyObject *kw) {
    PyObject *copier, *var;
    if (!PyArg_ParseTuple(args, "OO:Activation", &copier, &var)) return -1;
    if (!PyContextVar_CheckExact(var)) {
        PyErr_SetString(PyExc_TypeError, "Activation(copier, var): var is a ContextVar");
        return -1;
    }
    Py_XSETREF(a->copier, Py_NewRef(copier));
    Py_XSETREF(a->var, Py_NewRef(var));
    Py_CLEAR(a->token);
    return 0;
}

static PyObject *activation_enter(Activation *a, PyObject *unused) {
    if (!a->var || !a->copier) {
        PyErr_SetString(PyExc_RuntimeError, "Activation: not initialized");
        return NULL;
    }
    PyObject *token = PyContextVar_Set(a->var, a->copier);
    if (!token) return NULL;
    Py_XSETREF(a->token, token);
    return Py_NewRef(a->copier);
}

static PyObject *activation_exit(Activation *a, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *token = a->token;
    a->token = NULL;
    if (token) {
        int r = PyContextVar_Reset(a->var, token);
        Py_DECREF(token);
        if (r < 0) return NULL;
    }
    Py_RETURN_FALSE;
}

static PyMethodDef activation_methods[] = {
    {"__enter__", (PyCFunction)activation_enter, METH_NOARGS, "Activate; the copier."},
    {"__exit__", (PyCFunction)(void (*)(void))activation_exit, METH_FASTCALL,
     "Restore the copier active before; False."},
    {NULL},
};

static PyMemberDef activation_members[] = {{NULL}};

static PyTypeObject ActivationType = CORE_TYPE(activation, Activation, activation_methods,
    "What DeviceCopier.activate() returns (compiled twin of cucopy.copier._PyActivation).");

static PyObject *mod_native_word_reads(PyObject *m, PyObject *unused) {
    return PyLong_FromLongLong(S->native_word_reads);
}

static PyObject *mod_thread_id(PyObject *m, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(thread_id());
}

static PyObject *mod_set_foreign(PyObject *m, PyObject *arg) {
    unsigned long bits = PyLong_AsUnsignedLong(arg);
    if (bits == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    if (bits & ~(unsigned long)FOREIGN_ALL) {
        PyErr_Format(PyExc_ValueError, "_set_foreign: bits %lu outside %u", bits, FOREIGN_ALL);
        return NULL;
    }
    unsigned old = S->foreign;
    S->foreign = (unsigned)bits;
    return PyLong_FromUnsignedLong(old);
}

static PyObject *mod_set_check_mode(PyObject *m, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    S->check_mode = on;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_set_check_mode", mod_set_check_mode, METH_O,
     "_set_check_mode(on): check mode as cucopy.check.CHECK_MODE says (its module pushes "
     "every assignment here; the compiled begin() declines while it is on)."},
    {"_set_foreign", mod_set_foreign, METH_O,
     "_set_foreign(bits) -> the bits before: which reads of other libraries' internals the "
     "core makes (1 NumPy's array fields, 2 native getters, 4 a tensor's handle word, 8 its "
     "key-set flag word; 15 all, the default). A cleared bit takes the public path; it "
     "applies to cache entries made after the call."},
    {"thread_id", mod_thread_id, METH_NOARGS,
     "The calling thread's id for step ownership: never reused by a later thread "
     "(twin of cucopy.segment.py_thread_id)."},
    {"_context_id", mod_context_id, METH_NOARGS,
     "The calling thread's current Context object's address (steps record theirs)."},
    {"_native_word_reads", mod_native_word_reads, METH_NOARGS,
     "Cached tensors validated through the handle word they hold (native_word), so far."},
    {NULL},
};
