/* buffer.c: DeviceCopyBuffer.update()'s fast path
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

/* == DeviceCopyBuffer.update()'s fast path ==========================================
 *
 * A section of its own (cucopy/buffer.py holds its pure-Python reference,
 * _py_fast_update, and says which updates it takes). BufferCore is the base class of
 * DeviceCopyBuffer: the fields the fast path reads, set by buffer.py. SkipCounts counts
 * a copier's skips by site, folded into copier.stats when read. FastUpdate is
 * DeviceCopyBuffer.update: one record lookup and one memcmp for an unchanged update,
 * h2d_fast plus a memcpy into the record for a changed one; anything else calls the
 * Python _update (the general path) with the caller's arguments. */

#define NPY_WRITEABLE_FLAG 0x0400

typedef struct {
    PyObject_HEAD
    PyObject *fsite;  /* the H2D site, or None: no fast path */
    PyObject *fdtype; /* the buffer's dtype */
    Py_ssize_t fitem, fsize;
    PyObject *updates, *fills; /* the records (dicts) */
    Py_ssize_t pn;    /* the last prefix made: its length (0: none) */
    PyObject *pdst;   /* and the prefix itself */
    PyObject *froute; /* (weakref to the copier, its SkipCounts, its Segment) or None */
} BufferCore;

static int core_traverse(BufferCore *b, visitproc visit, void *arg) {
    Py_VISIT(b->fsite); Py_VISIT(b->fdtype); Py_VISIT(b->updates); Py_VISIT(b->fills);
    Py_VISIT(b->pdst); Py_VISIT(b->froute);
    return 0;
}

static int core_clear(BufferCore *b) {
    Py_CLEAR(b->fsite); Py_CLEAR(b->fdtype); Py_CLEAR(b->updates); Py_CLEAR(b->fills);
    Py_CLEAR(b->pdst); Py_CLEAR(b->froute);
    return 0;
}

static PyMemberDef core_members[] = {
    {"_fsite", T_OBJECT, offsetof(BufferCore, fsite), 0, "The H2D site, or None."},
    {"_fdtype", T_OBJECT, offsetof(BufferCore, fdtype), 0, "The buffer's dtype."},
    {"_fitem", T_PYSSIZET, offsetof(BufferCore, fitem), 0, "Bytes per element."},
    {"_fsize", T_PYSSIZET, offsetof(BufferCore, fsize), 0, "Elements in the buffer."},
    {"_updates", T_OBJECT, offsetof(BufferCore, updates), 0, "Update records."},
    {"_fills", T_OBJECT, offsetof(BufferCore, fills), 0, "Fill records."},
    {"_pn", T_PYSSIZET, offsetof(BufferCore, pn), 0, "Length of the last prefix made."},
    {"_pdst", T_OBJECT, offsetof(BufferCore, pdst), 0, "The last prefix made."},
    {"_froute", T_OBJECT, offsetof(BufferCore, froute), 0,
     "(weakref to a copier, its SkipCounts, its Segment), or None."},
    {NULL},
};

static PyTypeObject BufferCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment.BufferCore",
    .tp_basicsize = sizeof(BufferCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The fields DeviceCopyBuffer.update()'s fast path reads (base class).",
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_dealloc = cleared_dealloc,
    .tp_members = core_members,
    .tp_new = PyType_GenericNew,
};

/* -- SkipCounts: skips per site, by identity (as the segment's merged counts) -- */

typedef struct {
    PyObject_HEAD
    PyObject **keys;
    Py_ssize_t *vals;
    Py_ssize_t cap, used;
} SkipCounts;

static int skips_count(SkipCounts *k, PyObject *site) {
    if (2 * (k->used + 1) > k->cap) { /* grow: at most half full */
        Py_ssize_t cap = k->cap ? 2 * k->cap : 16;
        PyObject **keys = PyMem_Calloc((size_t)cap, sizeof(PyObject *));
        Py_ssize_t *vals = PyMem_Calloc((size_t)cap, sizeof(Py_ssize_t));
        if (!keys || !vals) { PyMem_Free(keys); PyMem_Free(vals); PyErr_NoMemory(); return -1; }
        for (Py_ssize_t i = 0; i < k->cap; i++) {
            if (!k->keys[i]) continue;
            Py_ssize_t j = count_slot(keys, cap, k->keys[i]);
            keys[j] = k->keys[i];
            vals[j] = k->vals[i];
        }
        PyMem_Free(k->keys);
        PyMem_Free(k->vals);
        k->keys = keys;
        k->vals = vals;
        k->cap = cap;
    }
    Py_ssize_t i = count_slot(k->keys, k->cap, site);
    if (!k->keys[i]) {
        k->keys[i] = Py_NewRef(site);
        k->used++;
    }
    k->vals[i]++;
    return 0;
}

static PyObject *skips_count_py(SkipCounts *k, PyObject *site) {
    if (skips_count(k, site) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *skips_fold(SkipCounts *k, PyObject *unused) {
    /* {site: skips counted since the last fold}; the counts restart at 0 */
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < k->cap; i++) {
        if (!k->keys[i] || !k->vals[i]) continue;
        PyObject *v = PyLong_FromSsize_t(k->vals[i]);
        if (!v || PyDict_SetItem(out, k->keys[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
        k->vals[i] = 0;
    }
    return out;
}

static int skips_traverse(SkipCounts *k, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < k->cap; i++) Py_VISIT(k->keys[i]);
    return 0;
}

static int skips_clear(SkipCounts *k) {
    for (Py_ssize_t i = 0; i < k->cap; i++) Py_CLEAR(k->keys[i]);
    k->used = 0;
    return 0;
}

static void skips_dealloc(SkipCounts *k) {
    PyObject_GC_UnTrack(k);
    skips_clear(k);
    PyMem_Free(k->keys);
    PyMem_Free(k->vals);
    Py_TYPE(k)->tp_free((PyObject *)k);
}

static PyMethodDef skips_methods[] = {
    {"count", (PyCFunction)skips_count_py, METH_O, "Count one more skip of a site."},
    {"fold", (PyCFunction)skips_fold, METH_NOARGS,
     "Skips per site since the last fold (the counts restart)."},
    {NULL},
};

static PyTypeObject SkipCountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment.SkipCounts",
    .tp_basicsize = sizeof(SkipCounts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Skips a copier's buffers counted on update()'s fast path, by site.",
    .tp_traverse = (traverseproc)skips_traverse,
    .tp_clear = (inquiry)skips_clear,
    .tp_dealloc = (destructor)skips_dealloc,
    .tp_methods = skips_methods,
    .tp_new = PyType_GenericNew,
};

/* -- FastUpdate: DeviceCopyBuffer.update ------------------------------------------ */

/* -- UpdateCore: an issued update's record, the fields update()'s fast path reads --
 * ``buffer._Update`` subclasses it (``buffer._PyUpdateCore`` is the Python twin: the same
 * two slots). ``data``: the uint8 bytes written; ``owned``: a private copy the buffer may
 * overwrite in place. */
typedef struct {
    PyObject_HEAD
    PyObject *data;
    char owned;
} UpdateCore;

#define UPDATE_FIELDS(X) X(data)
GC_FIELDS(updatecore, UpdateCore, UPDATE_FIELDS)

static PyMemberDef updatecore_members[] = {
    {"data", T_OBJECT_EX, offsetof(UpdateCore, data), 0, "The uint8 bytes written."},
    {"owned", T_BOOL, offsetof(UpdateCore, owned), 0,
     "data is a private copy this buffer made (the fast path may overwrite it)."},
    {NULL},
};

static PyTypeObject UpdateCoreType = CORE_TYPE(updatecore, UpdateCore, NULL,
    "An issued update's record: the fields DeviceCopyBuffer.update()'s fast path reads "
    "(compiled twin of cucopy.buffer._PyUpdateCore).");

typedef struct {
    PyObject_HEAD
    PyObject *full, *rest, *var; /* the Python update, _update, the active-copier variable */
    PyObject *prefix; /* the record key of prefix updates (buffer._PREFIX: an identity hash) */
    PyTypeObject *rectype; /* buffer._Update: an UpdateCore whose fields it leaves as they are */
    vectorcallfunc vectorcall;
} FastUpdate;

/* a record's data: its typed field for an exact rectype, else by name (new reference) */
static inline PyObject *rec_data(FastUpdate *f, PyObject *rec) {
    if (Py_TYPE(rec) == f->rectype) {
        PyObject *v = ((UpdateCore *)rec)->data;
        if (v) return Py_NewRef(v);
    }
    return PyObject_GetAttr(rec, S->s_data);
}

/* a record's owned flag: 1, 0, or -1 with an error set */
static inline int rec_owned(FastUpdate *f, PyObject *rec) {
    if (Py_TYPE(rec) == f->rectype) return ((UpdateCore *)rec)->owned;
    PyObject *v = PyObject_GetAttr(rec, S->s_owned);
    if (!v) return -1;
    Py_DECREF(v);
    return v == Py_True;
}



/* the object a weak reference refers to (borrowed; NULL when dead) */
static inline PyObject *weak_target(PyObject *ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *x = NULL;
    if (PyWeakref_GetRef(ref, &x) < 0) { PyErr_Clear(); return NULL; }
    Py_XDECREF(x); /* whoever holds the other end keeps it; compared by identity only */
    return x;
#else
    PyObject *x = PyWeakref_GetObject(ref);
    return x == Py_None ? NULL : x;
#endif
}

/* The buffer's fields update() reads, taken once as strong references: Python code the
 * body runs (a fingerprint, h2d_fast's) may replace any of them on the buffer (another
 * prefix length, a route learnt anew, another thread's update). */
typedef struct {
    PyObject *route, *fsite, *fdtype, *updates, *fills, *pdst, *copier; /* copier: owned */
    Py_ssize_t fitem, fsize, pn;
    int held; /* the others owned too: taken before the first call into Python (a skip
               * from a NumPy array makes none, and pays no reference counting) */
} BufSnap;

static void snap_hold(BufSnap *k) {
    if (k->held) return;
    Py_XINCREF(k->route); Py_XINCREF(k->fsite); Py_XINCREF(k->fdtype);
    Py_XINCREF(k->updates); Py_XINCREF(k->fills); Py_XINCREF(k->pdst);
    k->held = 1;
}

static void snap_release(BufSnap *k) {
    if (k->held) {
        Py_XDECREF(k->route); Py_XDECREF(k->fsite); Py_XDECREF(k->fdtype);
        Py_XDECREF(k->updates); Py_XDECREF(k->fills); Py_XDECREF(k->pdst);
    }
    Py_XDECREF(k->copier);
}

/* host's bytes for update(): an exact C-contiguous ndarray's, or a cached source's
 * (sc, held by the caller, validated): 1, or 0 when they are not readable so */
HOT_INLINE int host_bytes(PyObject *host, Cached *sc, Py_ssize_t fitem, const char **data,
                      Py_ssize_t *n, int *nd) {
    if (!sc) {
        NpArray *a = (NpArray *)host;
        if (!(a->flags & NPY_C_CONTIGUOUS_FLAG)) return 0;
        Py_ssize_t k = 1;
        for (int i = 0; i < a->nd; i++) k *= a->dimensions[i];
        *data = a->data;
        *n = k;
        *nd = a->nd;
        return 1;
    }
    if (sc->ndim < 0 || sc->nbytes % fitem) return 0;
    *data = (const char *)(uintptr_t)sc->ptr;
    *n = (Py_ssize_t)(sc->nbytes / fitem);
    *nd = sc->ndim;
    return 1;
}

/* a record's bytes: an exact 1-D C-contiguous uint8 array (its length in *len) */
HOT_INLINE int record_bytes(PyObject *data, Py_ssize_t *len) {
    NpArray *d = (NpArray *)data;
    if ((PyObject *)Py_TYPE(data) != S->ndarray_type || !(S->foreign & FOREIGN_NUMPY) || d->nd != 1 || d->descr != S->uint8_descr ||
        !(d->flags & NPY_C_CONTIGUOUS_FLAG))
        return 0;
    *len = d->dimensions[0];
    return 1;
}

static PyObject *fastupdate_body(FastUpdate *f, BufSnap *k, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 2 || nargs > 6) goto rest;
    /* update(self, host, force=False, view=None, key=None, exact=False) */
    PyObject *opt[4] = {Py_False, Py_None, Py_None, Py_False};
    for (Py_ssize_t i = 2; i < nargs; i++) opt[i - 2] = args[i];
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *kw = PyTuple_GET_ITEM(kwnames, i);
            int at = kw == S->s_force ? 0 : kw == S->s_viewkw ? 1 : kw == S->s_key ? 2 : kw == S->s_exact ? 3 : -1;
            if (at < 0 || at < nargs - 2) goto rest; /* unknown or repeated: Python says */
            opt[at] = args[nargs + i];
        }
    }
    if (opt[0] != Py_False || opt[1] != Py_None || opt[2] != Py_None ||
        (opt[3] != Py_False && opt[3] != Py_True))
        goto rest;
    int exact = opt[3] == Py_True;
    PyObject *self = args[0], *host = args[1];
    if (!PyObject_TypeCheck(self, &BufferCoreType)) goto rest;
    BufferCore *b = (BufferCore *)self;
    if (!b->froute || !PyTuple_CheckExact(b->froute) || PyTuple_GET_SIZE(b->froute) != 3 ||
        !b->fsite || b->fsite == Py_None || !b->updates || !PyDict_CheckExact(b->updates) ||
        b->fitem <= 0)
        goto rest;
    k->route = b->froute; /* borrowed until snap_hold */
    k->fsite = b->fsite;
    k->fdtype = b->fdtype;
    k->updates = b->updates;
    k->fills = b->fills;
    k->pdst = b->pdst;
    k->fitem = b->fitem;
    k->fsize = b->fsize;
    k->pn = b->pn;
    /* the active copier: the one this buffer's route was learnt through (held) */
    if (PyContextVar_Get(f->var, NULL, &k->copier) < 0) return NULL;
    if (!k->copier) goto rest;
    PyObject *ref = PyTuple_GET_ITEM(k->route, 0), *sego = PyTuple_GET_ITEM(k->route, 2);
    int same_copier = k->copier != Py_None && PyWeakref_Check(ref) && weak_target(ref) == k->copier;
    if (!same_copier || Py_TYPE(sego) != &SegmentType) goto rest;
    Segment *s = (Segment *)sego; /* held by the route */
    if (!seg_usable(s)) goto rest;
    /* the host values: a NumPy array, or a source the segment knows (a torch CPU tensor) */
    const char *hdata;
    Py_ssize_t n;
    int hnd;
    PyObject *hdtype;
    Cached *sc = NULL; /* held while its bytes are read */
    if ((PyObject *)Py_TYPE(host) == S->ndarray_type && (S->foreign & FOREIGN_NUMPY)) {
        hdtype = ((NpArray *)host)->descr;
    } else {
        sc = (Cached *)front_get(&s->sfront, s->scache, host);
        if (!sc) { if (PyErr_Occurred()) return NULL; goto rest; }
        Py_INCREF(sc);
        hdtype = sc->dtype;
        snap_hold(k); /* its fingerprint runs Python code below */
    }
    if (hdtype != k->fdtype) {
        snap_hold(k); /* a dtype's compare may run Python code */
        int eq = k->fdtype ? PyObject_RichCompareBool(hdtype, k->fdtype, Py_EQ) : 0;
        if (eq != 1) {
            if (eq < 0 && soft_clear() < 0) goto fail_sc;
            goto rest_sc;
        }
    }
    /* the record (its slots read at their offsets: no Python for an exact _Update) */
    PyObject *rec = PyDict_GetItemWithError(k->updates, f->prefix); /* (its hash: identity) */
    if (!rec) { if (PyErr_Occurred()) goto fail_sc; goto rest_sc; }
    Py_INCREF(rec);
    if (Py_TYPE(rec) != f->rectype) snap_hold(k); /* its fields read by name: Python */
    PyObject *data = rec_data(f, rec);
    if (!data) { Py_DECREF(rec); goto fail_sc; }
    Py_ssize_t hn;
    if (!record_bytes(data, &hn)) goto rest_rec;
    if (sc) { /* the last Python before the bytes are read: the source's fingerprint */
        int v = cached_valid(sc, host);
        if (v < 0) goto fail_rec;
        if (!v) goto rest_rec;
    }
    /* read now, after every call into Python (what they may have changed is read afresh;
     * with none made, k->held is 0 and the step and the record are as checked above) */
    if ((k->held && (!seg_usable(s) || !record_bytes(data, &hn))) ||
        !host_bytes(host, sc, k->fitem, &hdata, &n, &hnd))
        goto rest_rec;
    if (n <= 0 || n > k->fsize) goto rest_rec;
    NpArray *d = (NpArray *)data;
    Py_ssize_t nb = n * k->fitem;
    if ((hn == nb || (hn > nb && !exact)) && memcmp(d->data, hdata, (size_t)nb) == 0) {
        Py_DECREF(data);
        Py_DECREF(rec);
        Py_XDECREF(sc);
        PyObject *counts = PyTuple_GET_ITEM(k->route, 1);
        if (Py_TYPE(counts) == &SkipCountsType) {
            if (skips_count((SkipCounts *)counts, k->fsite) < 0) return NULL;
        } else {
            snap_hold(k);
            PyObject *x = PyObject_CallMethod(counts, "count", "O", k->fsite);
            if (!x) return NULL;
            Py_DECREF(x);
        }
        Py_RETURN_FALSE;
    }
    /* changed: staged through the segment, then copied into the record's own bytes */
    if (hn != nb || hnd != 1 || PyDict_GET_SIZE(k->updates) != 1 || !k->fills ||
        !PyDict_CheckExact(k->fills) || PyDict_GET_SIZE(k->fills) != 0 || k->pn != n ||
        !k->pdst || !(d->flags & NPY_WRITEABLE_FLAG))
        goto rest_rec;
    int owned = rec_owned(f, rec);
    if (owned < 0) goto fail_rec;
    if (!owned) goto rest_rec;
    snap_hold(k); /* from here on Python code runs */
    PyObject *drop = PyObject_GetAttr(self, S->s_invalidate);
    if (!drop) goto fail_rec;
    int code = h2d_fast(s, k->fsite, k->pdst, host, drop, 0);
    Py_DECREF(drop);
    if (code < 0) goto fail_rec;
    if (code != STAGED && code != BARRIER) goto rest_rec;
    /* staged: the record takes the bytes h2d_fast staged, read again (no Python since
     * its staging); a record or source that changed meanwhile is dropped instead, so the
     * next update uploads again */
    Py_ssize_t hn2, n2;
    int keep = record_bytes(data, &hn2) && hn2 == nb && (d->flags & NPY_WRITEABLE_FLAG) &&
               host_bytes(host, sc, k->fitem, &hdata, &n2, &hnd) && n2 == n;
    if (keep) memcpy(d->data, hdata, (size_t)nb);
    if (code == BARRIER || !keep) {
        /* as the general path: no record while the barrier flushes */
        int r = PyDict_DelItem(k->updates, f->prefix);
        if (r < 0) goto fail_rec;
    }
    if (code == BARRIER) {
        PyObject *x = PyObject_CallMethodOneArg(k->copier, S->s_after_barrier, k->fsite);
        if (!x) goto fail_rec;
        Py_DECREF(x);
        if (keep && PyDict_SetItem(k->updates, f->prefix, rec) < 0) goto fail_rec;
    }
    Py_DECREF(data);
    Py_DECREF(rec);
    Py_XDECREF(sc);
    Py_RETURN_TRUE;
fail_rec:
    Py_DECREF(data);
    Py_DECREF(rec);
fail_sc:
    Py_XDECREF(sc);
    return NULL;
rest_rec:
    Py_DECREF(data);
    Py_DECREF(rec);
rest_sc:
    Py_XDECREF(sc);
rest:
    return PyObject_Vectorcall(f->rest, args, nargsf, kwnames);
}

/* update(): the body, with the buffer's fields it reads held while it runs */
static PyObject *fastupdate_call(FastUpdate *f, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    BufSnap k = {0};
    PyObject *r = fastupdate_body(f, &k, args, nargsf, kwnames);
    snap_release(&k);
    return r;
}

static PyObject *fastupdate_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    /* FastUpdate(update, _update, active-copier ContextVar, prefix record key, record type) */
    PyObject *full, *rest, *var, *prefix;
    PyTypeObject *rectype;
    if (!PyArg_ParseTuple(args, "OOOOO!:FastUpdate", &full, &rest, &var, &prefix, &PyType_Type,
                          &rectype))
        return NULL;
    if (!PyContextVar_CheckExact(var)) {
        PyErr_SetString(PyExc_TypeError, "FastUpdate: expected a ContextVar");
        return NULL;
    }
    if (PyObject_Hash(prefix) == -1) return NULL; /* (hashable: the look-ups need it) */
    /* the record type's fields are UpdateCore's own (a subclass that redefines data or
     * owned is read by name: no record is of rectype then) */
    if (!PyType_IsSubtype(rectype, &UpdateCoreType) ||
        type_lookup(rectype, S->s_data) != type_lookup(&UpdateCoreType, S->s_data) ||
        type_lookup(rectype, S->s_owned) != type_lookup(&UpdateCoreType, S->s_owned)) {
        PyErr_SetString(PyExc_TypeError,
                        "FastUpdate: the record type must be an UpdateCore that keeps its "
                        "data and owned fields");
        return NULL;
    }
    FastUpdate *f = (FastUpdate *)tp->tp_alloc(tp, 0);
    if (!f) return NULL;
    f->full = Py_NewRef(full);
    f->rest = Py_NewRef(rest);
    f->var = Py_NewRef(var);
    f->prefix = Py_NewRef(prefix);
    f->rectype = (PyTypeObject *)Py_NewRef(rectype);
    f->vectorcall = (vectorcallfunc)fastupdate_call;
    return (PyObject *)f;
}

static int fastupdate_traverse(FastUpdate *f, visitproc visit, void *arg) {
    Py_VISIT(f->full); Py_VISIT(f->rest); Py_VISIT(f->var); Py_VISIT(f->prefix);
    Py_VISIT(f->rectype);
    return 0;
}

static int fastupdate_clear(FastUpdate *f) {
    Py_CLEAR(f->full); Py_CLEAR(f->rest); Py_CLEAR(f->var); Py_CLEAR(f->prefix);
    Py_CLEAR(f->rectype);
    return 0;
}

static PyObject *fastupdate_getattro(FastUpdate *f, PyObject *name) {
    return wrapper_getattro((PyObject *)f, f->full, name);
}

static PyTypeObject FastUpdateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment.FastUpdate",
    .tp_basicsize = sizeof(FastUpdate),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "DeviceCopyBuffer.update with its fast path compiled (see the Python update()).",
    .tp_vectorcall_offset = offsetof(FastUpdate, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = fastcopy_get,
    .tp_getattro = (getattrofunc)fastupdate_getattro,
    .tp_traverse = (traverseproc)fastupdate_traverse,
    .tp_clear = (inquiry)fastupdate_clear,
    .tp_dealloc = cleared_dealloc,
    .tp_new = fastupdate_new,
};

/* the section's types and names, added to the module by PyInit__segment */
static int buffer_section_init(PyObject *m) {
    if (PyType_Ready(&BufferCoreType) < 0 || PyType_Ready(&SkipCountsType) < 0 ||
        PyType_Ready(&FastUpdateType) < 0 || PyType_Ready(&UpdateCoreType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "UpdateCore", (PyObject *)&UpdateCoreType) < 0 ||
        PyModule_AddObjectRef(m, "BufferCore", (PyObject *)&BufferCoreType) < 0 ||
        PyModule_AddObjectRef(m, "SkipCounts", (PyObject *)&SkipCountsType) < 0 ||
        PyModule_AddObjectRef(m, "FastUpdate", (PyObject *)&FastUpdateType) < 0)
        return -1;
    return 0;
}
