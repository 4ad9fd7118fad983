/* guard.c: HostGuard's fields and a guarded copy's common case, compiled
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

/* -- UseCore: what a guard knows of one copier's copies (guard._Use's fields) -------
 *
 * ``cucopy.guard._Use`` subclasses it. The fields a guarded copy and the compiled flush
 * update are typed: ``owed`` and ``recorded`` C booleans, ``ticket`` a C integer,
 * ``timeout`` and ``sites`` (site -> copies not known complete) the objects Python
 * assigned; ``_serial`` the copier's (CopierCore's serial, taken when the use is made: a
 * copier's address may be reused, its serial never). ``event`` and ``stream`` keep the
 * objects Python assigned and, read once at the assignment, their raw handles when they
 * are exact ints (the CUDA backend's events and streams; the simulator's are objects):
 * what the compiled flush records the event with (fence_guards below). */

typedef struct {
    PyObject_HEAD
    char owed;     /* owed: copies issued since the event was last recorded */
    char recorded; /* recorded: the event was recorded after copies not known complete */
    char raw_event, raw_stream; /* event, stream: exact ints (their raw handles below) */
    long long ticket;          /* ticket: records made (a wait clears what it covered) */
    unsigned long long serial; /* _serial: the copier's (0: not a CopierCore) */
    unsigned long long event_h, stream_h; /* the raw handles (when raw_event, raw_stream) */
    PyObject *timeout, *sites, *event, *stream;
} UseCore;

#define USE_FIELDS(X) X(timeout) X(sites) X(event) X(stream)
GC_FIELDS(usecore, UseCore, USE_FIELDS)

static PyObject *usecore_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    UseCore *u = (UseCore *)PyType_GenericNew(tp, args, kw);
    if (!u) return NULL;
    if (PyTuple_Check(args) && PyTuple_GET_SIZE(args) >= 1) {
        PyObject *copier = PyTuple_GET_ITEM(args, 0);
        if (is_core(copier)) u->serial = ((CopierCore *)copier)->serial;
    }
    return (PyObject *)u;
}

static PyMemberDef usecore_members[] = {
    {"owed", T_BOOL, offsetof(UseCore, owed), 0, NULL},
    {"recorded", T_BOOL, offsetof(UseCore, recorded), 0, NULL},
    {"ticket", T_LONGLONG, offsetof(UseCore, ticket), 0, NULL},
    {"timeout", T_OBJECT_EX, offsetof(UseCore, timeout), 0, NULL},
    {"sites", T_OBJECT_EX, offsetof(UseCore, sites), 0, NULL},
    {"_serial", T_ULONGLONG, offsetof(UseCore, serial), READONLY,
     "The serial of the copier the use was made for (0: none)."},
    {NULL},
};

/* event and stream: the object, and its raw handle read once here (an exact int of 64
 * bits: the compiled flush's; anything else: Python's) */
static PyObject *usecore_get_handle(UseCore *u, void *which) {
    PyObject *v = which ? u->stream : u->event;
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, which ? "stream" : "event");
        return NULL;
    }
    return Py_NewRef(v);
}

static int usecore_set_handle(UseCore *u, PyObject *v, void *which) {
    unsigned long long h = 0;
    int raw = v && u64_field(v, &h);
    PyErr_Clear();
    if (which) {
        Py_XSETREF(u->stream, Py_XNewRef(v));
        u->raw_stream = (char)raw;
        u->stream_h = h;
    } else {
        Py_XSETREF(u->event, Py_XNewRef(v));
        u->raw_event = (char)raw;
        u->event_h = h;
    }
    return 0;
}

static PyGetSetDef usecore_getset[] = {
    {"event", (getter)usecore_get_handle, (setter)usecore_set_handle,
     "The guard's event for the copier's copies (a raw handle the compiled flush records).",
     NULL},
    {"stream", (getter)usecore_get_handle, (setter)usecore_set_handle,
     "The copier's stream the copies went on.", (void *)1},
    {NULL},
};

static PyTypeObject UseCoreType = CORE_TYPE(usecore, UseCore, NULL,
    "A guard's bookkeeping of one copier's in-place copies (guard._Use's typed fields).");

/* -- GuardCore: HostGuard's fields a guarded copy reads --------------------------- */

typedef struct {
    PyObject_HEAD
    char closed;                /* _closed */
    unsigned long long lo, hi;  /* _lo, _hi: the buffer's bytes */
    PyObject *buf, *geom;       /* _buf (None once closed), _geom (ptr, shape, strides, dtype) */
    PyObject *active;           /* _active: the uses whose copies may be in flight */
    PyObject *fast_use;         /* _fast_use: the use the last copier found pinned (or None) */
} GuardCore;

#define GUARD_FIELDS(X) X(buf) X(geom) X(active) X(fast_use)
GC_FIELDS(guardcore, GuardCore, GUARD_FIELDS)

static PyMemberDef guardcore_members[] = {
    {"_closed", T_BOOL, offsetof(GuardCore, closed), 0, NULL},
    {"_lo", T_ULONGLONG, offsetof(GuardCore, lo), 0, NULL},
    {"_hi", T_ULONGLONG, offsetof(GuardCore, hi), 0, NULL},
    {"_buf", T_OBJECT, offsetof(GuardCore, buf), 0, NULL},
    {"_geom", T_OBJECT_EX, offsetof(GuardCore, geom), 0, NULL},
    {"_active", T_OBJECT_EX, offsetof(GuardCore, active), 0, NULL},
    {"_fast_use", T_OBJECT, offsetof(GuardCore, fast_use), 0, NULL},
    {NULL},
};

static PyTypeObject GuardCoreType = CORE_TYPE(guardcore, GuardCore, NULL,
    "HostGuard's typed fields, which a guarded copy's compiled common case reads.");

/* whether int object o is v (0 for anything else) */
static int int_is(PyObject *o, long long v) {
    if (!PyLong_CheckExact(o)) return 0;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (x == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return !overflow && x == v;
}

/* whether tuple t holds exactly the n values v */
static int tuple_is(PyObject *t, int n, const Py_ssize_t *v) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != n) return 0;
    for (int i = 0; i < n; i++)
        if (!int_is(PyTuple_GET_ITEM(t, i), (long long)v[i])) return 0;
    return 1;
}

/* The guard's buffer is the NumPy array it was made over, unchanged: what _check_alive
 * compares (ptr, shape, strides, dtype), read from the array's fields. 0 for anything
 * else (another kind of buffer: the Python path checks it). Runs no Python code. */
static int guard_alive(GuardCore *gd) {
    PyObject *buf = gd->buf, *geom = gd->geom;
    if (!buf || (PyObject *)Py_TYPE(buf) != S->ndarray_type || !(S->foreign & FOREIGN_NUMPY) ||
        !geom || !PyTuple_CheckExact(geom) || PyTuple_GET_SIZE(geom) != 4)
        return 0;
    NpArray *a = (NpArray *)buf;
    PyObject *ptr = PyTuple_GET_ITEM(geom, 0);
    if (!PyLong_CheckExact(ptr)) return 0;
    unsigned long long p = PyLong_AsUnsignedLongLong(ptr);
    if (p == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return p == (unsigned long long)(uintptr_t)a->data &&
           tuple_is(PyTuple_GET_ITEM(geom, 1), a->nd, a->dimensions) &&
           tuple_is(PyTuple_GET_ITEM(geom, 2), a->nd, a->strides) &&
           PyTuple_GET_ITEM(geom, 3) == a->descr;
}

/* the guard's use for copier c when the compiled path may take the copy, else NULL
 * (borrowed): the copier open, in this thread's step, not capturing, not in check
 * mode; the guard open over its buffer alive, the buffer found pinned for this copier
 * (the use Python's _use() left in _fast_use, made for this copier), the fields the
 * bookkeeping writes of the types it writes. Runs no Python code. */
static UseCore *guard_use(CopierCore *c, GuardCore *gd, uint64_t me) {
    if (!core_usable(c, me) || !c->in_step || c->capturing || S->check_mode || gd->closed ||
        !c->serial || !c->guards_owed || !PyList_CheckExact(c->guards_owed) ||
        !c->wait_timeout || !gd->active || !PyList_CheckExact(gd->active) || !gd->fast_use ||
        !PyObject_TypeCheck(gd->fast_use, &UseCoreType))
        return NULL;
    UseCore *u = (UseCore *)gd->fast_use;
    if (u->serial != c->serial || !u->sites || !PyDict_CheckExact(u->sites) || !guard_alive(gd))
        return NULL;
    return u;
}

/* One in-place copy: dst's rows from src's, read where src lies. */
typedef struct {
    Geo g;           /* the destination (g.hold held) */
    addr_t src;      /* the source's first byte */
    int64_t dpitch, spitch, width, rows;
    addr_t slo, shi; /* the bytes the copy reads */
} InPlace;

/* The copy of a cached destination from a NumPy array (contiguous, or rows of packed
 * elements: buf[:r, :c]) or a cached source, as _in_place makes it when it is one
 * 2-D copy (_pair's three cases); 1 (p->g.hold held), 0 a miss, -1 an error. */
static int inplace_pair(Segment *s, PyObject *dst, PyObject *src, InPlace *p) {
    Geo *g = &p->g;
    int r = dst_geo(s, dst, g);
    if (r <= 0) return r;
    int64_t srows = 1, swidth = g->nbytes, spitch = g->nbytes;
    if ((PyObject *)Py_TYPE(src) == S->ndarray_type && (S->foreign & FOREIGN_NUMPY)) {
        NpArray *a = (NpArray *)src;
        if (a->descr != g->dtype || a->nd > MAXDIM) goto miss;
        int64_t n = 1;
        for (int i = 0; i < a->nd; i++) n *= a->dimensions[i];
        if (n * g->itemsize != g->nbytes || !shape_fits(a->nd, a->dimensions, g->ndim, g->shape))
            goto miss;
        p->src = (addr_t)(uintptr_t)a->data;
        if (a->flags & NPY_C_CONTIGUOUS_FLAG) {
            /* packed: one row */
        } else if (a->nd == 2 && a->dimensions[0] > 1 && a->dimensions[1] > 1 &&
                   a->strides[1] == g->itemsize &&
                   a->strides[0] >= a->dimensions[1] * g->itemsize) {
            srows = a->dimensions[0]; /* rows of packed elements, a pitch apart */
            swidth = a->dimensions[1] * g->itemsize;
            spitch = a->strides[0];
        } else
            goto miss;
    } else if ((PyObject *)Py_TYPE(src) != S->ndarray_type) {
        int v = cached_source(s, src, g, &p->src); /* a cached source is packed */
        if (v < 0) goto fail;
        if (v == 0) goto miss;
    } else {
        goto miss; /* a NumPy array read through the public path: the Python path's */
    }
    if (!g->nbytes) goto miss; /* nothing to copy: the Python path answers False */
    if (g->rows == srows && g->width == swidth) { /* the same rows */
        p->rows = srows; p->width = swidth; p->dpitch = g->pitch; p->spitch = spitch;
    } else if (srows == 1 && g->rows * g->width == swidth) { /* a packed source */
        p->rows = g->rows; p->width = g->width; p->dpitch = g->pitch; p->spitch = g->width;
    } else if (g->rows == 1 && srows * swidth == g->width) { /* a packed destination */
        p->rows = srows; p->width = swidth; p->dpitch = swidth; p->spitch = spitch;
    } else
        goto miss;
    p->slo = p->src;
    p->shi = p->src + (addr_t)((srows - 1) * spitch + swidth);
    return 1;
miss:
    Py_DECREF(g->hold);
    return 0;
fail:
    Py_DECREF(g->hold);
    return -1;
}

/* use->sites[site] += 1 (a CopySite hashes by identity: no Python code); -1 on error */
static int use_count(UseCore *u, PyObject *site) {
    PyObject *n = PyDict_GetItemWithError(u->sites, site);
    if (!n && PyErr_Occurred()) return -1;
    Py_ssize_t v = 0;
    if (n) {
        if (!PyLong_CheckExact(n)) { PyErr_SetString(PyExc_TypeError, "use.sites"); return -1; }
        v = PyLong_AsSsize_t(n);
        if (v == -1 && PyErr_Occurred()) return -1;
    }
    PyObject *m = PyLong_FromSsize_t(v + 1);
    if (!m) return -1;
    int rc = PyDict_SetItem(u->sites, site, m);
    Py_DECREF(m);
    return rc;
}

/* -- a guarded copy's common case (DeviceCopier._copy_guarded's step branch) --------
 *
 * ``copy(site, dst, src, guard=g)`` of an H2D site (merged or not) in this thread's
 * open step (not under capture, not in check mode), of a cached destination from a
 * view of the guard's buffer that guard_use and inplace_pair take, the destination
 * over nothing staged: one driver copy from the buffer itself (the launcher's copy();
 * the backend's copy2d without one), the slot marked dirty, the guard's bookkeeping
 * as guard._issued keeps it (use.sites, use.timeout; the first copy of a step makes
 * the use owed, puts it in the guard's _active and (guard, use) in the copier's
 * _guards_owed, whose event the step's flush records: fence_guards below, else
 * _fence_guards), the copy counted eager
 * (fold_eager; a merged site's with fallback "in_place"). Anything else is the Python
 * path's (MISS), which asks everything again and names the site and the buffer in its
 * errors. STAGED: issued. */
static int core_guarded(PyObject *self, PyObject *site, PyObject *dst, PyObject *src,
                        PyObject *guard, PyObject *on_drop) {
    if (!is_core(self) || !PyObject_TypeCheck(guard, &GuardCoreType)) return MISS;
    CopierCore *c = (CopierCore *)self;
    GuardCore *gd = (GuardCore *)guard;
    uint64_t me = thread_id();
    if (!guard_use(c, gd, me)) return MISS;
    Segment *s = (Segment *)c->seg;
    if (!seg_usable(s) || !s->slot || !PyObject_TypeCheck(s->slot, &SlotCoreType) ||
        (on_drop != Py_None && !PyCallable_Check(on_drop)))
        return MISS;
    int fl = site_flags(s, site);
    if (fl < 0) return soft_clear() < 0 ? -1 : MISS;
    if (!(fl & (SITE_MERGE | SITE_EAGER))) return MISS; /* (the plan merges H2D sites only) */
    Py_INCREF(s); /* held: what follows may run Python code (a fingerprint, the query) */
    Py_INCREF(gd);
    int out = MISS;
    CarriedLauncher *L = core_launcher(c);
    int idle = not_capturing(c, L, 0);
    if (idle <= 0) { out = idle < 0 ? -1 : MISS; goto done; }
    InPlace p;
    int r = inplace_pair(s, dst, src, &p);
    if (r <= 0) { out = r < 0 ? -1 : MISS; goto done; }
    /* the fingerprints may have run Python code: everything asked again, then nothing
     * but C until the copy is issued */
    UseCore *u = c->seg == (PyObject *)s && seg_usable(s) ? guard_use(c, gd, me) : NULL;
    if (!u || !s->slot || !PyObject_TypeCheck(s->slot, &SlotCoreType) ||
        p.slo < gd->lo || p.shi > gd->hi ||      /* not a view of the buffer: Python's error */
        staged_overlaps(s, p.g.lo, p.g.hi, 1)) { /* staged copies land first: Python's */
        Py_DECREF(p.g.hold);
        goto done;
    }
    Py_INCREF(u);
    SlotCore *slot = (SlotCore *)s->slot;
    /* the copy reads no slot bytes; the slot is marked dirty so that its event (and the
     * guard's, recorded after it at the flush) follows the step's work */
    Py_SETREF(slot->dirty, Py_NewRef(Py_True));
    Py_DECREF(p.g.hold);
    if (copier_copy2d(self, c, L, p.g.ptr, p.dpitch, p.src, p.spitch, p.width, p.rows) < 0) {
        Py_DECREF(u);
        out = -1;
        goto done;
    }
    /* guard._issued(copier, use, site, reads, True), outside check mode */
    out = -1;
    if (!PyDict_CheckExact(u->sites) || use_count(u, site) < 0) goto issued;
    if (c->wait_timeout) Py_SETREF(u->timeout, Py_NewRef(c->wait_timeout));
    if (!u->owed) {
        if (!gd->active || !PyList_CheckExact(gd->active) || !c->guards_owed ||
            !PyList_CheckExact(c->guards_owed)) {
            PyErr_SetString(PyExc_TypeError, "guard._active, copier._guards_owed: lists");
            goto issued;
        }
        PyObject *active = gd->active;
        Py_ssize_t k = 0, n = PyList_GET_SIZE(active);
        while (k < n && PyList_GET_ITEM(active, k) != (PyObject *)u) k++;
        if (k == n && PyList_Append(active, (PyObject *)u) < 0) goto issued;
        PyObject *pair = PyTuple_Pack(2, (PyObject *)gd, (PyObject *)u);
        if (!pair) goto issued;
        int ap = PyList_Append(c->guards_owed, pair);
        Py_DECREF(pair);
        if (ap < 0) goto issued;
        u->owed = 1;
    }
    c->guarded = 1; /* the guard's event owed: recorded at the flush (fence_guards) */
    Py_ssize_t i = count_index(s, site); /* its eager count (stats.sites[site].eager) */
    if (i < 0) goto issued;
    s->evals[i]++;
    if (fl & SITE_MERGE) s->cflags[i] |= SITE_IN_PLACE; /* fallback["in_place"] too */
    c->fast_guarded++;
    out = STAGED;
issued:
    Py_DECREF(u);
done:
    Py_DECREF(gd);
    Py_DECREF(s);
    return out;
}

/* -- the flush's guard events (DeviceCopier._fence_guards' common case) -------------
 *
 * A step's guarded copies owe each guard's event once, at the step's flush: the
 * (guard, use) pairs in the copier's _guards_owed. The compiled flush (copier.c: after
 * the launch and the slot's event, or with nothing staged, flush_dirty) records each
 * owed use's event through the launcher's record() (cuEventRecord, as record_slot
 * records the slot's), then keeps the use's bookkeeping as guard._record does (owed
 * cleared, recorded set, ticket + 1), empties _guards_owed and clears _guarded. It
 * takes them only when every pair is its to take, asked before anything changes
 * (guards_ready): not in check mode, no check-mode guard to verify (_watching), not
 * capturing, each use made for this copier (its serial) with an event that is a raw
 * handle (the CUDA backend's; the simulator's are objects) on the copier's own stream.
 * Else the whole flush is the Python body's, which records them as it always did.
 *
 * The guard's lock is not taken (neither does core_guarded): the copies and writes
 * through one guard are its owner's to order, from one thread (docs/host_guard.md);
 * the GIL is held from the first record to the last bookkeeping, so a write() on
 * another thread sees the uses before or after, never between. */

/* whether the step owes guard events (or _guards_owed is not a list: the body's) */
static int guards_owe(CopierCore *c) {
    PyObject *o = c->guards_owed;
    if (!o || !PyList_CheckExact(o)) return c->guarded;
    return c->guarded || PyList_GET_SIZE(o) > 0;
}

/* the use of pair p when the compiled flush may record its event on stream, else NULL
 * (borrowed) */
static UseCore *owed_use(CopierCore *c, PyObject *p, unsigned long long stream) {
    if (!PyTuple_CheckExact(p) || PyTuple_GET_SIZE(p) != 2 ||
        !PyObject_TypeCheck(PyTuple_GET_ITEM(p, 0), &GuardCoreType) ||
        !PyObject_TypeCheck(PyTuple_GET_ITEM(p, 1), &UseCoreType))
        return NULL;
    UseCore *u = (UseCore *)PyTuple_GET_ITEM(p, 1);
    if (u->serial != c->serial || !c->serial || !u->raw_event || !u->raw_stream ||
        u->stream_h != stream)
        return NULL;
    return u;
}

/* 1: every owed pair's event may be recorded from C (E's record(), on stream); 0: the
 * Python body's. Runs no Python code, changes nothing. */
static int guards_ready(CopierCore *c, CarriedLauncher *E, unsigned long long stream) {
    PyObject *owed = c->guards_owed;
    if (!owed || !PyList_CheckExact(owed) || S->check_mode || c->watching || c->capturing ||
        !E || !E->record)
        return 0;
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(owed); i < n; i++)
        if (!owed_use(c, PyList_GET_ITEM(owed, i), stream)) return 0;
    return 1;
}

/* Record the owed uses' events in order (a use no longer owed, recorded since by a
 * write() in the step, is passed as _record_owed passes it), then drop the pairs
 * recorded. 1: all (_guards_owed empty, _guarded cleared); 0: a record failed, or a
 * pair is no longer the compiled flush's (the rest left owed, from that pair on: the
 * Python body records them, or reports the error, as _fence_guards does); -1: an error
 * (emptying the list). */
static int fence_guards(CopierCore *c, CarriedLauncher *E, unsigned long long stream) {
    PyObject *owed = c->guards_owed;
    if (!owed || !PyList_CheckExact(owed)) return 0;
    Py_ssize_t n = PyList_GET_SIZE(owed), i;
    for (i = 0; i < n; i++) {
        UseCore *u = owed_use(c, PyList_GET_ITEM(owed, i), stream);
        if (!u) break;
        if (!u->owed) continue;
        if (E->record(E->drv, u->event_h, stream) != 0) break;
        u->owed = 0;
        u->recorded = 1;
        u->ticket++;
        c->fast_fenced++;
    }
    int all = i == n;
    if (all) c->guarded = 0;
    if (!i) return all;
    /* (the pairs dropped may be the last references to a guard and its use: their
     * deallocation may run Python code, after the bookkeeping above) */
    Py_INCREF(owed);
    int rc = PyList_SetSlice(owed, 0, i, NULL);
    Py_DECREF(owed);
    return rc < 0 ? -1 : all;
}
