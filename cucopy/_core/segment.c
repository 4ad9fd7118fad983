/* segment.c: the open segment: entries, binding, staging bytes
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

/* -- Entry ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *site, *on_drop, *index, *geom, *data, *snap, *ssnap, *value;
    unsigned long long lo, hi, slo, shi;
} Entry;

static PyTypeObject EntryType;

static int entry_traverse(Entry *e, visitproc visit, void *arg) {
    Py_VISIT(e->site); Py_VISIT(e->on_drop); Py_VISIT(e->index); Py_VISIT(e->geom);
    Py_VISIT(e->data); Py_VISIT(e->snap); Py_VISIT(e->ssnap); Py_VISIT(e->value);
    return 0;
}

static int entry_clear(Entry *e) {
    Py_CLEAR(e->site); Py_CLEAR(e->on_drop); Py_CLEAR(e->index); Py_CLEAR(e->geom);
    Py_CLEAR(e->data); Py_CLEAR(e->snap); Py_CLEAR(e->ssnap); Py_CLEAR(e->value);
    return 0;
}

/* Entries no one else holds any more, cleared, kept for the next steps: a copy
 * allocates no GC-tracked object on the fast path, so its steps do not set off the
 * garbage collector's young-generation passes (one every ~700 allocations, which
 * cost several percent of a step once a framework's objects are about). */
#define ENTRY_POOL_MAX 4096

static int entry_clear(Entry *e);

/* e: a reference the caller owns and the only one left (refcount 1) */
static void entry_recycle(Entry *e) {
    entry_clear(e);
    if (S->entry_npool == ENTRY_POOL_MAX) { Py_DECREF(e); return; }
    S->entry_pool[S->entry_npool++] = (PyObject *)e; /* still GC-tracked; all its fields NULL */
}

/* site, on_drop (a callable or None: wrapped in a list), lo, hi, index (stolen) */
static Entry *entry_new(PyObject *site, PyObject *on_drop, addr_t lo, addr_t hi,
                        PyObject *index) {
    Entry *e;
    int pooled = S->entry_npool > 0;
    if (pooled) e = (Entry *)S->entry_pool[--S->entry_npool];
    else e = PyObject_GC_New(Entry, &EntryType);
    if (!e) { Py_DECREF(index); return NULL; }
    Py_INCREF(site);
    e->site = site;
    if (on_drop != Py_None && on_drop != NULL) {
        e->on_drop = PyList_New(1);
        if (!e->on_drop) { e->index = index; e->geom = e->data = e->snap = e->ssnap = e->value = NULL;
            Py_DECREF(e); return NULL; }
        Py_INCREF(on_drop);
        PyList_SET_ITEM(e->on_drop, 0, on_drop);
    } else {
        e->on_drop = Py_NewRef(Py_None);
    }
    e->index = index;
    e->geom = Py_NewRef(Py_None);
    e->data = Py_NewRef(Py_None);
    e->snap = Py_NewRef(Py_None);
    e->ssnap = Py_NewRef(Py_None);
    e->value = Py_NewRef(Py_None);
    e->lo = lo; e->hi = hi; e->slo = e->shi = 0;
    if (!pooled) PyObject_GC_Track(e);
    return e;
}

static PyMemberDef entry_members[] = {
    {"site", T_OBJECT, offsetof(Entry, site), 0, NULL},
    {"on_drop", T_OBJECT, offsetof(Entry, on_drop), 0, NULL},
    {"index", T_OBJECT, offsetof(Entry, index), 0, NULL},
    {"geom", T_OBJECT, offsetof(Entry, geom), 0, NULL},
    {"data", T_OBJECT, offsetof(Entry, data), 0, NULL},
    {"snap", T_OBJECT, offsetof(Entry, snap), 0, NULL},
    {"ssnap", T_OBJECT, offsetof(Entry, ssnap), 0, NULL},
    {"value", T_OBJECT, offsetof(Entry, value), 0, NULL},
    {"lo", T_ULONGLONG, offsetof(Entry, lo), 0, NULL},
    {"hi", T_ULONGLONG, offsetof(Entry, hi), 0, NULL},
    {"slo", T_ULONGLONG, offsetof(Entry, slo), 0, NULL},
    {"shi", T_ULONGLONG, offsetof(Entry, shi), 0, NULL},
    {NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One staged copy's bookkeeping: site, drop callbacks, ranges, check data.",
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_dealloc = cleared_dealloc,
    .tp_members = entry_members,
};

/* A fast-path copy's bookkeeping before anything asks for its Entry: the same fields
 * in a C array, no object allocated (an Entry, its index int and its geometry tuple
 * cost ~180 instructions a copy, a tenth of a step). The segment's entries are its
 * `entries` list followed by these, in staging order; `materialize` turns them into
 * Entry objects at the list's end when Python, or a slower path, reads the list. */
typedef struct {
    PyObject *site;    /* owned */
    PyObject *on_drop; /* owned, or NULL (None) */
    addr_t lo, hi, ptr;
    int64_t rows, width, pitch;
    Py_ssize_t index; /* its descriptor */
} Raw;

/* -- Segment ---------------------------------------------------------------------- */

/* -- SlotCore's fields ------------------------------------------------------------
 *
 * A ring slot's per-step fields (``cucopy.ring.Slot`` subclasses the type; ring.c
 * defines its members and the ring's step). Here because a Segment binds a slot: it
 * borrows the slot's export of its bytes and reads and writes its sizes directly,
 * where attribute look-ups and a fresh buffer export each step touched ~70 cache lines
 * more of a cold host's memory (bench/probes/cold_lines.py). */

typedef struct {
    PyObject_HEAD
    /* Python objects, as a ``__slots__`` class holds them: the Python code that reads
     * and writes these fields on every other path keeps its specialized attribute
     * access (a C integer member would build an int at every read) */
    PyObject *size, *bottom, *top, *recorded, *dirty, *temps, *frees;
    PyObject *base; /* the pinned buffer's device address (what a launch reads it at) */
    long long stamp; /* the ring's acquires when its event was last recorded (-1: never) */
    /* the step a tagged launch armed the slot's completion tag with (-1: none since the
     * slot was acquired), and the tag's host address (pack.TAG_AT; 0: none, or freed):
     * the slot is in flight until the tag's second word says that step (ring.Slot) */
    long long tag;
    unsigned long long tag_host;
    /* the pinned bytes (ring.Slot's array; None once closed), the bytes before them no
     * segment uses, and the export a Segment binds to, made at the slot's first bind
     * and kept while array is that object (see seg_bind) */
    PyObject *array;
    Py_ssize_t headroom;
    Py_buffer view;
    int exported;
} SlotCore;

static PyTypeObject SlotCoreType; /* (ring.c: its members, and the ring's use of it) */

static void slot_unexport(SlotCore *s) {
    if (s->exported) {
        s->exported = 0;
        PyBuffer_Release(&s->view);
    }
}

/* the slot's bytes exported (its array, once): 0, or -1 with an exception set (a
 * closed slot's array is None) */
static int slot_export(SlotCore *s) {
    if (s->exported && s->view.obj == s->array) return 0;
    slot_unexport(s);
    if (!s->array) {
        PyErr_SetString(PyExc_TypeError, "bind: the slot has no array");
        return -1;
    }
    if (PyObject_GetBuffer(s->array, &s->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    s->exported = 1;
    return 0;
}

/* whether o is a SlotCore (ring.Slot: its subclass, remembered once seen) */
static int is_slot(PyObject *o) {
    PyTypeObject *tp = Py_TYPE(o);
    if (tp == (PyTypeObject *)S->known_slot || tp == &SlotCoreType) return 1;
    if (!PyType_IsSubtype(tp, &SlotCoreType)) return 0;
    Py_XSETREF(S->known_slot, Py_NewRef((PyObject *)tp));
    return 1;
}

/* slot.<name> = v (name: top or bottom): a SlotCore's field directly, else setattr */
static int slot_set(PyObject *slot, PyObject *name, PyObject *v) {
    if (is_slot(slot) && (name == S->s_top || name == S->s_bottom)) {
        SlotCore *sc = (SlotCore *)slot;
        Py_XSETREF(*(name == S->s_top ? &sc->top : &sc->bottom), Py_NewRef(v));
        return 0;
    }
    return PyObject_SetAttr(slot, name, v);
}

/* whether slot s's completion tag, if armed, has arrived: 1 yes (or none armed), 0 not
 * yet, -1 armed but unreadable (the Python path decides). A load of host memory that
 * the device writes, with acquire order: the slot's bytes are rewritten only after it
 * (x86 keeps that order anyway; a weakly ordered host, an Arm one, would not). */
static inline int slot_tag_done(const SlotCore *s) {
    if (s->tag < 0) return 1;
    if (!s->tag_host) return -1;
    const uint64_t *at = (const uint64_t *)(uintptr_t)s->tag_host + 1;
#if defined(__GNUC__) || defined(__clang__)
    uint64_t done = __atomic_load_n(at, __ATOMIC_ACQUIRE);
#else
    uint64_t done = *(const volatile uint64_t *)at;
#endif
    return done >= (uint64_t)s->tag;
}


typedef struct {
    PyObject_HEAD
    PyObject *merge, *barriers, *fills;
    PyObject **ckeys; /* per-site merged counts: an open-addressed table by site identity */
    Py_ssize_t *cvals;
    Py_ssize_t *evals; /* per-site eager copies the compiled eager path issued (fold_eager) */
    unsigned char *cflags; /* the site's plan, once asked: SITE_KNOWN | SITE_MERGE | SITE_BARRIER
                            * | SITE_EAGER */
    Py_ssize_t ccap, cused;
    PyObject *slot;
    /* the slot's pinned bytes while bound: the Segment's own export, or (borrowed) a
     * SlotCore's, which the slot (held in slot) keeps */
    Py_buffer view;
    int bound, borrowed;
    addr_t pinned_ptr; /* the bound slot's pinned.ptr (the eager copy's source), 0: not read */
    PyObject *site_type, *h2d; /* set_eager(CopySite, H2D): which sites copy eagerly in C */
    int fast, wide;
    int64_t headroom; /* free bytes the bound slot has before its first byte (slot.headroom) */
    int64_t open_lo;  /* the first free byte when the open segment was opened */
    uint64_t owner; /* the thread whose step is open (thread_id) */
    int64_t top, bottom, cursor, seg, data0, reserve, size;
    int64_t peak; /* the largest table cut since the copier last read it */
    /* streaming stores (a cache hint, see stage_nt): data staged at or past this many
     * bytes into the open segment bypasses the host's caches (-1: never) */
    int64_t nt_from;
    int nt_used; /* streaming stores since the last cut (an sfence owed before a launch) */
    DescVec descs;
    DescVec scratch; /* cut_impl's split descriptors, kept with their capacity */
    PyObject *entries; /* list of Entry: the open segment's first entries (then raw's) */
    PyObject *spare;   /* an empty list kept with its capacity for the next segment, or NULL */
    Raw *raw;          /* the entries after the list's, not yet objects (see Raw) */
    Py_ssize_t nraw, rawcap;
    int listed; /* Python holds the list this segment: fast copies append to it at once */
    Ranges writes, reads;
    PyObject *dcache, *scache; /* id -> Cached */
    PyObject *capq, *caparg;   /* the stream's capture query (set_capture_query), or NULL */
    PyObject *vtypes;          /* type -> view protocol (see view_geo) */
    Front dfront, sfront;      /* direct-mapped caches in front of dcache and scache */
} Segment;

/* drop the raw entries (a segment landed or reset: nothing reads them any more) */
static void raw_drop(Segment *s) {
    /* the array is taken out first: a reference dropped here may run Python code (an
     * on_drop's __del__) that stages into this segment again */
    Raw *raw = s->raw;
    Py_ssize_t n = s->nraw, cap = s->rawcap;
    s->raw = NULL;
    s->nraw = s->rawcap = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(raw[i].site);
        Py_XDECREF(raw[i].on_drop);
    }
    if (!s->raw) { /* nothing staged meanwhile: the array is kept with its capacity */
        s->raw = raw;
        s->rawcap = cap;
    } else {
        PyMem_Free(raw);
    }
}

static int raw_reserve(Segment *s, Py_ssize_t n) {
    return array_reserve((void **)&s->raw, &s->rawcap, n, sizeof(Raw));
}

/* entries staged, objects or not */
static inline Py_ssize_t nstaged(const Segment *s) {
    return PyList_GET_SIZE(s->entries) + s->nraw;
}

static Entry *entry_new(PyObject *site, PyObject *on_drop, addr_t lo, addr_t hi,
                        PyObject *index);

/* The raw entries as Entry objects at the list's end, in order. On an error (out of
 * memory) those not yet made stay raw, in order, and -1 is returned. */
static int materialize(Segment *s) {
    Py_ssize_t i = 0, n = s->nraw;
    int err = 0;
    for (; i < n; i++) {
        Raw *r = &s->raw[i];
        PyObject *index = PyLong_FromSsize_t(r->index);
        if (!index) { err = 1; break; }
        PyObject *geom = Py_BuildValue("(KLLL)", (unsigned long long)r->ptr, (long long)r->rows,
                                       (long long)r->width, (long long)r->pitch);
        if (!geom) { Py_DECREF(index); err = 1; break; }
        Entry *e = entry_new(r->site, r->on_drop ? r->on_drop : Py_None, r->lo, r->hi, index);
        if (!e) { Py_DECREF(geom); err = 1; break; }
        Py_SETREF(e->geom, geom);
        int a = PyList_Append(s->entries, (PyObject *)e);
        Py_DECREF(e);
        if (a < 0) { err = 1; break; }
        Py_DECREF(r->site);
        Py_XDECREF(r->on_drop);
    }
    if (i && i < n) memmove(s->raw, s->raw + i, (size_t)(n - i) * sizeof(Raw));
    s->nraw = n - i;
    return err ? -1 : 0;
}

static int seg_traverse(Segment *s, visitproc visit, void *arg) {
    Py_VISIT(s->merge); Py_VISIT(s->barriers); Py_VISIT(s->fills); Py_VISIT(s->slot);
    for (Py_ssize_t i = 0; i < s->ccap; i++) Py_VISIT(s->ckeys[i]);
    Py_VISIT(s->entries); Py_VISIT(s->spare);
    for (Py_ssize_t i = 0; i < s->nraw; i++) { Py_VISIT(s->raw[i].site); Py_VISIT(s->raw[i].on_drop); }
    Py_VISIT(s->dcache); Py_VISIT(s->scache); Py_VISIT(s->vtypes);
    Py_VISIT(s->capq); Py_VISIT(s->caparg);
    Py_VISIT(s->site_type); Py_VISIT(s->h2d);
    return 0; /* the fronts hold Cached entries only: they reference nothing back */
}

static void seg_release(Segment *s) {
    if (s->bound) {
        if (!s->borrowed) PyBuffer_Release(&s->view);
        s->bound = s->borrowed = 0;
    }
    s->pinned_ptr = 0; /* (the next slot's is read at its first eager copy) */
    Py_CLEAR(s->slot);
}

static int seg_clear(Segment *s) {
    seg_release(s);
    Py_CLEAR(s->merge); Py_CLEAR(s->barriers); Py_CLEAR(s->fills);
    Py_CLEAR(s->site_type); Py_CLEAR(s->h2d);
    for (Py_ssize_t i = 0; i < s->ccap; i++) Py_CLEAR(s->ckeys[i]);
    Py_CLEAR(s->entries); Py_CLEAR(s->spare);
    raw_drop(s);
    Py_CLEAR(s->dcache); Py_CLEAR(s->scache); Py_CLEAR(s->vtypes);
    Py_CLEAR(s->capq); Py_CLEAR(s->caparg);
    front_clear(&s->dfront);
    front_clear(&s->sfront);
    return 0;
}

static void seg_dealloc(Segment *s) {
    PyObject_GC_UnTrack(s);
    seg_clear(s);
    PyMem_Free(s->descs.v);
    PyMem_Free(s->scratch.v);
    PyMem_Free(s->raw);
    PyMem_Free(s->ckeys);
    PyMem_Free(s->cvals);
    PyMem_Free(s->evals);
    PyMem_Free(s->cflags);
    PyMem_Free(s->writes.lo); PyMem_Free(s->writes.hi);
    PyMem_Free(s->reads.lo); PyMem_Free(s->reads.hi);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* Copy n bytes into the slot with streaming (non-temporal) stores, whole cache lines at
 * a time: they go to memory without taking the lines into the host's caches. The GPU
 * (a mapped read, a DMA upload) then reads them from memory instead of snooping lines
 * the host just dirtied, which cost an H200 about 2 us at 87 KB and 8 at 343 KB
 * (bench/results/2026-11-30-h200-variants3). Only for bytes the GPU reads: a carried
 * launch's driver copies the segment on the host, which wants them cached. x86-64
 * only; elsewhere memcpy. */
static int stage_nt(char *dst, const char *src, size_t n) {
#if CUCOPY_NT
    /* whole 64-byte lines only: a line written in part by streaming stores leaves the
     * write-combining buffer as a partial write, far slower than a cached one (an H200's
     * host: 0.3 us a copy more at N = 512 with the lines' ends streamed too, session 12).
     * The first and last lines of a copy go through the cache. */
    size_t head = (size_t)(-(uintptr_t)dst & 63u);
    if (n < head + 128) {
        memcpy(dst, src, n);
        return 0;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    if (i < n) memcpy(dst + i, src + i, n - i);
    return 1;
#else
    memcpy(dst, src, n);
    return 0;
#endif
}

/* Streaming stores are weakly ordered: fenced before anything may launch a read of
 * them (cut_impl, which every landing of a segment starts with). */
static inline void stage_fence(Segment *s) {
#if CUCOPY_NT
    if (s->nt_used) {
        _mm_sfence();
        s->nt_used = 0;
    }
#else
    (void)s;
#endif
}

static int seg_init(Segment *s, PyObject *args, PyObject *kw) {
    PyObject *merge, *barriers, *fills = NULL;
    static char *kwlist[] = {"merge", "barriers", "fills", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O", kwlist, &merge, &barriers, &fills))
        return -1;
    if (!fills) fills = PyFrozenSet_New(NULL);
    else Py_INCREF(fills);
    if (!fills) return -1;
    Py_XSETREF(s->fills, fills);
    Py_XSETREF(s->merge, Py_NewRef(merge));
    Py_XSETREF(s->barriers, Py_NewRef(barriers));
    if (s->cflags) memset(s->cflags, 0, (size_t)s->ccap); /* another plan: asked again */
    Py_XSETREF(s->entries, PyList_New(0));
    raw_drop(s);
    s->listed = 0;
    Py_XSETREF(s->dcache, PyDict_New());
    Py_XSETREF(s->scache, PyDict_New());
    front_clear(&s->dfront);
    front_clear(&s->sfront);
    Py_XSETREF(s->vtypes, PyDict_New());
    if (!s->entries || !s->dcache || !s->scache || !s->vtypes) return -1;
    s->seg = -1;
    s->reserve = 16;
    s->nt_from = -1;
    return 0;
}

static int contains(PyObject *set, PyObject *key) {
    return PyAnySet_Check(set) ? PySet_Contains(set, key) : PySequence_Contains(set, key);
}

#define SITE_KNOWN 1
#define SITE_MERGE 2
#define SITE_BARRIER 4
#define SITE_EAGER 8 /* an H2D site the plan does not merge: the compiled eager path's */
#define SITE_IN_PLACE 16 /* a merged site with copies read in place (guard.c): its eager
                          * count is folded with fallback["in_place"] */
static int site_flags(Segment *s, PyObject *site);


/* bind a SlotCore: its export (made once) borrowed, its sizes read from its fields */
static PyObject *seg_bind_slot(Segment *s, SlotCore *sc) {
    if (slot_export(sc) < 0) {
        seg_release(s);
        return NULL;
    }
    if (!s->bound || (PyObject *)sc != s->slot || !s->borrowed || s->view.buf != sc->view.buf ||
        s->view.len != sc->view.len) {
        seg_release(s);
        s->view.buf = sc->view.buf;
        s->view.len = sc->view.len;
        s->view.obj = NULL; /* (the slot's export holds the array) */
        s->bound = s->borrowed = 1;
        s->slot = Py_NewRef((PyObject *)sc);
        s->size = s->view.len;
        s->headroom = sc->headroom > 0 ? sc->headroom : 0;
    }
    if (!sc->top || !sc->bottom) {
        PyErr_SetString(PyExc_TypeError, "bind: the slot's top and bottom are not set");
        seg_release(s);
        return NULL;
    }
    long long top = PyLong_AsLongLong(sc->top), bottom = PyLong_AsLongLong(sc->bottom);
    if ((top == -1 || bottom == -1) && PyErr_Occurred()) {
        seg_release(s);
        return NULL;
    }
    s->top = top;
    s->bottom = bottom;
    return Py_None; /* (not a new reference: seg_bind returns its own) */
}

/* the bound slot's sizes clamped to its bytes (a slot whose top claims more is not
 * trusted); the segment starts empty */
static PyObject *seg_bound(Segment *s) {
    if (s->top > s->size) s->top = s->size;
    if (s->top < 0) s->top = 0;
    if (s->bottom > s->top) s->bottom = s->top;
    if (s->bottom < 0) s->bottom = 0;
    s->cursor = 0;
    s->seg = -1;
    Py_RETURN_NONE;
}

static PyObject *seg_bind(Segment *s, PyObject *slot) {
    if (is_slot(slot)) return seg_bind_slot(s, (SlotCore *)slot) ? seg_bound(s) : NULL;
    PyObject *arr = PyObject_GetAttr(slot, S->s_array);
    if (!arr) { seg_release(s); return NULL; }
    /* The export (~0.05 us) is kept for the slot bound last: binding that slot
     * again (a ring of one slot, a re-bind) reuses it; the next slot of a rotating
     * ring is exported afresh. A slot the ring replaced is another object, and a
     * closed slot's array is None: both are exported afresh (or fail). */
    if (!s->bound || slot != s->slot || s->borrowed || arr != s->view.obj) {
        seg_release(s);
        int r = PyObject_GetBuffer(arr, &s->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
        if (r < 0) { Py_DECREF(arr); return NULL; }
        s->bound = 1;
        s->slot = Py_NewRef(slot);
        s->pinned_ptr = 0; /* read at the slot's first eager copy */
        s->size = s->view.len;
        /* the bytes a carried launch may write before offset 0 (see launch_carried) */
        PyObject *h = PyObject_GetAttr(slot, S->s_headroom);
        s->headroom = h && PyLong_CheckExact(h) ? PyLong_AsLongLong(h) : 0;
        Py_XDECREF(h);
        if (s->headroom < 0 || PyErr_Occurred()) {
            if (soft_clear() < 0) { seg_release(s); return NULL; }
            s->headroom = 0;
        }
    }
    Py_DECREF(arr);
    /* read every time: the ring resets them when it hands the slot out again */
    PyObject *top = PyObject_GetAttr(slot, S->s_top);
    PyObject *bottom = top ? PyObject_GetAttr(slot, S->s_bottom) : NULL;
    if (!bottom) { Py_XDECREF(top); seg_release(s); return NULL; }
    s->top = PyLong_AsLongLong(top);
    s->bottom = PyLong_AsLongLong(bottom);
    Py_DECREF(top);
    Py_DECREF(bottom);
    if (PyErr_Occurred()) { seg_release(s); return NULL; }
    return seg_bound(s);
}

static PyObject *seg_unbind(Segment *s, PyObject *unused) {
    seg_release(s);
    s->seg = -1;
    s->cursor = 0;
    Py_RETURN_NONE;
}

static PyObject *seg_set_cursor(Segment *s, PyObject *arg) {
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    s->cursor = v;
    Py_RETURN_NONE;
}

static int64_t reserve_tail(Segment *s) {
    int64_t extra = (int64_t)s->descs.n + 2 - s->reserve;
    return extra > 0 ? extra * DESC_BYTES + ALIGN : 0;
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static PyObject *seg_room(Segment *s, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(s->top - n >= max64(s->bottom, s->cursor));
}

/* where an eager snapshot of n bytes goes: the slot's top, aligned, above what is staged
 * and the table it may still grow; -1 when it does not fit (take_top and core_eager) */
static inline int64_t top_room(Segment *s, int64_t n) {
    int64_t top = (s->top - n) & -(int64_t)ALIGN;
    int64_t tail = nstaged(s) ? reserve_tail(s) : 0;
    return top >= max64(s->cursor, s->bottom) + tail ? top : -1;
}

static PyObject *seg_take_top(Segment *s, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (!s->bound || !s->slot || n < 0) return PyLong_FromLong(-1); /* nothing to take */
    int64_t top = top_room(s, n);
    if (top >= 0) {
        PyObject *v = PyLong_FromLongLong(top);
        if (!v || slot_set(s->slot, S->s_top, v) < 0) { Py_XDECREF(v); return NULL; }
        s->top = top;
        return v;
    }
    return PyLong_FromLong(-1);
}

static int ints(PyObject *seq, int64_t *out, int max);

static PyObject *seg_remember(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "remember(dst, fp, f, dtype, size, shape)");
        return NULL;
    }
    int64_t shape[MAXDIM];
    int ndim = ints(args[5], shape, MAXDIM);
    if (ndim < 0) {
        if (PyErr_Occurred()) return NULL;
        ndim = -1; /* more dimensions than the fast path follows */
    }
    PyObject *dst = args[0], *fp = args[1], *f = args[2], *dtype = args[3];
    long long g[4] = {0};
    addr_t ptr = 0;
    if (f != Py_None) {
        if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) != 4) {
            PyErr_SetString(PyExc_TypeError, "remember: f is (ptr, rows, width, pitch) or None");
            return NULL;
        }
        ptr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(f, 0));
        for (int i = 1; i < 4; i++) g[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(f, i));
        if (PyErr_Occurred()) return NULL;
    }
    PyObject *isz = PyObject_GetAttrString(dtype, "itemsize");
    if (!isz) return NULL;
    long long itemsize = PyLong_AsLongLong(isz);
    Py_DECREF(isz);
    if (itemsize == -1 && PyErr_Occurred()) return NULL;
    Cached *c = cached_new(dst, fp, dtype);
    if (!c) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    c->itemsize = itemsize;
    c->ndim = ndim;
    if (ndim > 0) memcpy(c->shape, shape, (size_t)ndim * sizeof(int64_t));
    c->geom = Py_NewRef(f);
    if (f != Py_None) {
        c->ptr = ptr; c->rows = g[1]; c->width = g[2]; c->pitch = g[3];
        c->lo = ptr;
        c->hi = ptr + (addr_t)((g[1] - 1) * g[3] + g[2]);
        c->nbytes = g[1] * g[2];
        c->kind = g[1] == 1 ? KIND_H2D : KIND_H2D_2D;
    }
    PyObject *vspec = PyObject_GetAttr(fp, S->s_view);
    if (!vspec) {
        if (soft_clear() < 0) { Py_DECREF(c); return NULL; }
    } else if (PyTuple_Check(vspec) && PyTuple_GET_SIZE(vspec) == 9) {
        /* views of this array may be made afresh each step: remember how to read one */
        c->vdtype = PyObject_GetAttr(dst, PyTuple_GET_ITEM(vspec, 7));
        if (!c->vdtype || PyDict_SetItem(s->vtypes, (PyObject *)Py_TYPE(dst), vspec) < 0) {
            Py_DECREF(vspec);
            Py_DECREF(c);
            return NULL;
        }
    }
    Py_XDECREF(vspec);
    if (PyDict_GET_SIZE(s->dcache) >= DCACHE_MAX) {
        PyDict_Clear(s->dcache);
        front_clear(&s->dfront);
    }
    PyObject *key = PyLong_FromVoidPtr(dst);
    int r = key ? PyDict_SetItem(s->dcache, key, (PyObject *)c) : -1;
    if (r == 0) front_put(&s->dfront, dst, (PyObject *)c);
    Py_XDECREF(key);
    Py_DECREF(c);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *seg_remember_src(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    /* remember_src(src, fp, host, dtype): host is a C-contiguous view of src's bytes */
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "remember_src(src, fp, host, dtype)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(args[2], &b, PyBUF_C_CONTIGUOUS) < 0) {
        if (soft_clear() < 0) return NULL;
        Py_RETURN_NONE; /* not C-contiguous: never on the fast path */
    }
    addr_t ptr = (addr_t)(uintptr_t)b.buf;
    int64_t nbytes = b.len;
    int64_t shape[MAXDIM];
    int ndim = b.ndim <= MAXDIM ? b.ndim : -1;
    for (int i = 0; i < ndim; i++) shape[i] = b.shape[i];
    PyBuffer_Release(&b);
    Cached *c = cached_new(args[0], args[1], args[3]);
    if (!c) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    c->ndim = ndim;
    if (ndim > 0) memcpy(c->shape, shape, (size_t)ndim * sizeof(int64_t));
    /* no reference to the bytes' owner (the view holds the tensor): the entry is used
     * only while its weak reference still names src, whose bytes are then alive at
     * the address its fingerprint still gives (a dropped input is not kept) */
    c->ptr = ptr;
    c->nbytes = nbytes;
    if (PyDict_GET_SIZE(s->scache) >= DCACHE_MAX) {
        PyDict_Clear(s->scache);
        front_clear(&s->sfront);
    }
    PyObject *key = PyLong_FromVoidPtr(args[0]);
    int r = key ? PyDict_SetItem(s->scache, key, (PyObject *)c) : -1;
    if (r == 0) front_put(&s->sfront, args[0], (PyObject *)c);
    Py_XDECREF(key);
    Py_DECREF(c);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *seg_forget(Segment *s, PyObject *unused) {
    PyDict_Clear(s->dcache);
    PyDict_Clear(s->scache);
    front_clear(&s->dfront);
    front_clear(&s->sfront);
    Py_RETURN_NONE;
}

#if defined(__GNUC__)
#define HOT_INLINE static inline __attribute__((always_inline))
#else
#define HOT_INLINE static inline
#endif

HOT_INLINE int append_raw_rows(Segment *s, PyObject *site, PyObject *on_drop, addr_t ptr,
                               int64_t rows, int64_t width, int64_t pitch, addr_t lo, addr_t hi,
                               int64_t nbytes, int kind, const void *data, int64_t spitch);

/* append_raw_rows with the source's rows packed (the usual case) */
HOT_INLINE int append_raw(Segment *s, PyObject *site, PyObject *on_drop, addr_t ptr,
                          int64_t rows, int64_t width, int64_t pitch, addr_t lo, addr_t hi,
                          int64_t nbytes, int kind, const void *data) {
    return append_raw_rows(s, site, on_drop, ptr, rows, width, pitch, lo, hi, nbytes, kind, data,
                           0);
}

/* Stage one copy of rows x width bytes (the destination's geometry: ptr, pitch; its
 * bytes [lo, hi)) from data: 1 staged, 0 not (no open segment, no room, an overlap:
 * the caller's general path), -1 an error (nothing staged). Its entry is a Raw one.
 * spitch: bytes between the source's rows when they are not packed (a NumPy array's
 * column slice, table[:, :n]: rows gathered into the slot), else 0 */
HOT_INLINE int append_raw_rows(Segment *s, PyObject *site, PyObject *on_drop, addr_t ptr,
                               int64_t rows, int64_t width, int64_t pitch, addr_t lo, addr_t hi,
                               int64_t nbytes, int kind, const void *data, int64_t spitch) {
    if (s->seg < 0) return 0;
    if (s->reads.n && ranges_overlaps(&s->reads, lo, hi)) return 0;
    int64_t off = (s->cursor + 15) & -16;
    int64_t grow = (int64_t)s->descs.n + 2 - s->reserve;
    if (off + nbytes + (grow > 0 ? grow * DESC_BYTES + 16 : 0) > s->top) return 0;
    /* room first: nothing below can fail once the range is claimed */
    if ((s->nraw == s->rawcap && raw_reserve(s, s->nraw + 1) < 0) ||
        (s->descs.n == s->descs.cap && descs_reserve(&s->descs, s->descs.n + 1) < 0))
        return -1;
    int r = ranges_claim(&s->writes, lo, hi);
    if (r <= 0) return r;
    Raw *e = &s->raw[s->nraw++];
    e->site = Py_NewRef(site);
    e->on_drop = on_drop == Py_None ? NULL : Py_NewRef(on_drop);
    e->lo = lo; e->hi = hi; e->ptr = ptr;
    e->rows = rows; e->width = width; e->pitch = pitch;
    e->index = s->descs.n;
    Desc *d = &s->descs.v[s->descs.n++];
    d->dst = ptr; d->src = (uint64_t)off; d->value = 0;
    d->dpitch = pitch; d->spitch = width; d->width = width; d->rows = rows;
    d->kind = kind; d->elem = 0;
    int nt = s->nt_from >= 0 && off - s->seg >= s->nt_from;
    if (spitch && spitch != width && rows > 1) {
        for (int64_t i = 0; i < rows; i++) {
            char *to = (char *)s->view.buf + off + i * width;
            const char *from = (const char *)data + i * spitch;
            if (nt) s->nt_used |= stage_nt(to, from, (size_t)width);
            else memcpy(to, from, (size_t)width);
        }
    } else if (nt) {
        s->nt_used |= stage_nt((char *)s->view.buf + off, data, (size_t)nbytes);
    } else {
        memcpy((char *)s->view.buf + off, data, (size_t)nbytes);
    }
    if (hi - lo > BLOCK_BYTES) s->wide = 1;
    s->cursor = off + nbytes;
    /* Python holds this segment's list: the entry joins it now (on an error it stays
     * raw, staged all the same, and the next read of the list makes it) */
    if (s->listed && materialize(s) < 0) PyErr_Clear();
    return 1;
}

static PyObject *seg_append_h2d(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    /* append_h2d(site, on_drop, f, lo, hi, nbytes, kind, host) -> bool */
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "append_h2d takes 8 arguments");
        return NULL;
    }
    PyObject *f = args[2];
    long long g[4], v[4];
    if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) != 4) {
        PyErr_SetString(PyExc_TypeError, "append_h2d: f is (ptr, rows, width, pitch)");
        return NULL;
    }
    addr_t ptr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(f, 0));
    addr_t lo = PyLong_AsUnsignedLongLong(args[3]), hi = PyLong_AsUnsignedLongLong(args[4]);
    for (int i = 1; i < 4; i++) g[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(f, i));
    for (int i = 2; i < 4; i++) v[i] = PyLong_AsLongLong(args[3 + i]);
    if (PyErr_Occurred()) return NULL;
    if (s->seg < 0) Py_RETURN_FALSE;
    Py_buffer b;
    if (PyObject_GetBuffer(args[7], &b, PyBUF_C_CONTIGUOUS) < 0) {
        if (soft_clear() < 0) return NULL;
        Py_RETURN_FALSE;
    }
    int r = 0;
    if (b.len == v[2])
        r = append_raw(s, args[0], args[1], ptr, g[1], g[2], g[3], lo, hi, v[2], (int)v[3],
                       b.buf);
    PyBuffer_Release(&b);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static void seg_open(Segment *s);
