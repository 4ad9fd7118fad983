/* cache.c: cached geometry of destinations and sources
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

/* -- cached geometry (destinations and sources), validated by fingerprint ------ */

typedef struct {
    PyObject_HEAD
    PyObject *ref;    /* weakref to the array */
    PyObject *fp;     /* fingerprint function (used when spec is NULL) */
    PyObject *spec;   /* tuple of (name, call) pairs, or NULL */
    PyTypeObject *tp; /* the array's type when the spec was resolved on it */
    PyObject *descrs; /* the spec's descriptors on tp (read without a lookup), or NULL */
    PyObject *fpval;  /* fp(x), or the tuple of the spec's values */
    PyObject *dtype;
    PyObject *geom;   /* destinations: (ptr, rows, width, pitch) or None; sources: bytes */
    PyObject *vdtype; /* destinations with a view protocol: dtype attribute's value */
    addr_t ptr, lo, hi;
    int64_t rows, width, pitch, nbytes, itemsize;
    int kind; /* 0: no 2-D form (only a base for views) */
    int ndim; /* the array's shape (-1: unknown: only flat sources match it) */
    int64_t shape[MAXDIM];
    struct Native *nat; /* validated through native getters (then spec is unused), or NULL */
    PyObject *ndescr;   /* the handle attribute's descriptor on tp */
    struct NGeo *nval;  /* the geometry the native getters read when cached */
    int nat_word;       /* its handle read from the object's own word (native_word) */
    PyObject *flags;    /* with nat: descriptors of methods that must return False
                         * (``fp.__cucopy_flags__``: torch's is_conj, is_neg, which
                         * ``.data =`` may set in place), or NULL */
} Cached;

static void cached_dealloc(Cached *c) {
    Py_XDECREF(c->ref); Py_XDECREF(c->fp); Py_XDECREF(c->spec); Py_XDECREF(c->fpval);
    Py_XDECREF(c->descrs); Py_XDECREF((PyObject *)c->tp);
    Py_XDECREF(c->dtype); Py_XDECREF(c->geom); Py_XDECREF(c->vdtype);
    Py_XDECREF(c->ndescr); Py_XDECREF(c->flags);
    PyMem_Free(c->nval);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyTypeObject CachedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment._Cached",
    .tp_basicsize = sizeof(Cached),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)cached_dealloc,
};

/* the fingerprint values of x under spec: a new tuple */
static PyObject *spec_values(PyObject *spec, PyObject *x) {
    Py_ssize_t n = PyTuple_GET_SIZE(spec);
    PyObject *out = PyTuple_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(spec, i);
        PyObject *name = PyTuple_GET_ITEM(item, 0);
        PyObject *v = PyTuple_GET_ITEM(item, 1) == Py_True
                          ? PyObject_CallMethodNoArgs(x, name)
                          : PyObject_GetAttr(x, name);
        if (!v) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* whether weak reference ref still refers to x (alive: x holds it) */
static int weak_is(PyObject *ref, PyObject *x) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj;
    if (PyWeakref_GetRef(ref, &obj) < 0) { PyErr_Clear(); return 0; }
    Py_XDECREF(obj);
    return obj == x;
#else
    return PyWeakref_GET_OBJECT(ref) == x;
#endif
}

/* The spec's names resolved on type tp once: a tuple of descriptors, each read
 * straight (a method called with x, an attribute through its getter) instead of
 * looked up on the instance every call; NULL when a name is not a plain type
 * attribute. A torch tensor's data_ptr(), shape, stride() and dtype cost about
 * half as much this way. */
static PyObject *spec_descrs(PyObject *spec, PyTypeObject *tp) {
    Py_ssize_t n = PyTuple_GET_SIZE(spec);
    PyObject *out = PyTuple_New(n);
    if (!out) { PyErr_Clear(); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(spec, i);
        PyObject *d = type_lookup(tp, PyTuple_GET_ITEM(item, 0)); /* borrowed */
        int call = PyTuple_GET_ITEM(item, 1) == Py_True;
        if (!d || (call ? !PyCallable_Check(d) : !Py_TYPE(d)->tp_descr_get) ||
            (!call && !Py_TYPE(d)->tp_descr_set)) { /* a data descriptor, or give up */
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, Py_NewRef(d));
    }
    return out;
}

static inline PyObject *spec_read(Cached *c, Py_ssize_t i, PyObject *x, PyObject *name,
                                  int call) {
    if (c->descrs && Py_TYPE(x) == c->tp) {
        PyObject *d = PyTuple_GET_ITEM(c->descrs, i);
        if (call) return PyObject_Vectorcall(d, &x, 1, NULL);
        return Py_TYPE(d)->tp_descr_get(d, x, (PyObject *)c->tp);
    }
    return call ? PyObject_CallMethodNoArgs(x, name) : PyObject_GetAttr(x, name);
}

/* 1 when each of c's flag methods returns False on x, 0 when one does not (an
 * Exception cleared), -1 with another BaseException set */
static int flags_clear(Cached *c, PyObject *x) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(c->flags); i++) {
        PyObject *v = PyObject_Vectorcall(PyTuple_GET_ITEM(c->flags, i), &x, 1, NULL);
        if (!v) return soft_clear();
        Py_DECREF(v);
        if (v != Py_False) return 0;
    }
    return 1;
}

/* 1 when x's fingerprint still matches, 0 when not (an Exception cleared: a miss),
 * -1 with another BaseException set (KeyboardInterrupt: propagated). The caller holds
 * c: the fingerprint may run Python code that empties the caches. */
static int cached_valid(Cached *c, PyObject *x) {
    if (!weak_is(c->ref, x)) return 0;
    if (c->nat && Py_TYPE(x) == c->tp) {
        void *impl = NULL;
        if (c->nat_word) {
            impl = native_word(c->nat, x);
            S->native_word_reads++;
        }
        if (!impl) {
            impl = native_handle(c->nat, c->ndescr, c->tp, x);
            if (!impl && PyErr_Occurred()) return -1;
        }
        if (!native_same(c->nat, impl, c->nval)) return 0;
        return c->flags ? flags_clear(c, x) : 1;
    }
    if (c->spec) {
        Py_ssize_t n = PyTuple_GET_SIZE(c->spec);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyTuple_GET_ITEM(c->spec, i);
            PyObject *v = spec_read(c, i, x, PyTuple_GET_ITEM(item, 0),
                                    PyTuple_GET_ITEM(item, 1) == Py_True);
            if (!v) return soft_clear();
            PyObject *want = PyTuple_GET_ITEM(c->fpval, i);
            int eq = v == want ? 1 : PyObject_RichCompareBool(v, want, Py_EQ);
            Py_DECREF(v);
            if (eq != 1) return eq < 0 ? soft_clear() : 0;
        }
        return 1;
    }
    PyObject *v = PyObject_CallOneArg(c->fp, x);
    if (!v) return soft_clear();
    int eq = PyObject_RichCompareBool(v, c->fpval, Py_EQ);
    Py_DECREF(v);
    if (eq < 0) return soft_clear();
    return eq;
}


/* c->flags from fp's ``__cucopy_flags__`` (names of methods of tp that must return
 * False: their bits change what the bytes mean, and the native getters do not read
 * them): 0 resolved (or none declared), 1 not usable (the spec validates instead),
 * -1 with a BaseException set */
static int native_flags(Cached *c, PyObject *fp, PyTypeObject *tp) {
    PyObject *names = PyObject_GetAttr(fp, S->s_flags);
    if (!names) return soft_clear() < 0 ? -1 : 0;
    int r = 1;
    if (PyTuple_Check(names)) {
        Py_ssize_t n = PyTuple_GET_SIZE(names);
        PyObject *out = PyTuple_New(n);
        r = out ? 0 : -1;
        for (Py_ssize_t i = 0; out && i < n; i++) {
            PyObject *d = PyObject_GetAttr((PyObject *)tp, PyTuple_GET_ITEM(names, i));
            if (!d || !PyCallable_Check(d)) {
                Py_XDECREF(d);
                r = soft_clear() < 0 ? -1 : 1;
                break;
            }
            PyTuple_SET_ITEM(out, i, d);
        }
        if (r == 0) c->flags = out;
        else Py_XDECREF(out);
    }
    Py_DECREF(names);
    return r;
}

static Cached *cached_new(PyObject *x, PyObject *fp, PyObject *dtype) {
    PyObject *ref = PyWeakref_NewRef(x, NULL);
    if (!ref) { PyErr_Clear(); return NULL; } /* not weakly referenceable: not cached */
    Cached *c = PyObject_New(Cached, &CachedType);
    if (!c) { Py_DECREF(ref); return NULL; }
    c->ref = ref;
    c->fp = Py_NewRef(fp);
    c->spec = NULL;
    c->tp = NULL;
    c->descrs = NULL;
    c->fpval = NULL;
    c->geom = NULL;
    c->vdtype = NULL;
    c->kind = 0;
    c->ndim = -1;
    c->nat = NULL;
    c->ndescr = NULL;
    c->nval = NULL;
    c->nat_word = 0;
    c->flags = NULL;
    c->dtype = Py_NewRef(dtype);
    Native *nat = (S->foreign & FOREIGN_NATIVE) ? native_for(fp) : NULL;
    if (!nat && PyErr_Occurred()) { Py_DECREF(c); return NULL; }
    if (nat) {
        c->ndescr = native_descr(nat, Py_TYPE(x));
        c->nval = c->ndescr ? PyMem_Malloc(sizeof(NGeo)) : NULL;
        void *impl = c->nval ? native_handle(nat, c->ndescr, Py_TYPE(x), x) : NULL;
        if (!impl && PyErr_Occurred()) { Py_DECREF(c); return NULL; }
        if (impl && native_geo(nat, impl, c->nval) &&
            ((nat->flag_off >= 0 && (S->foreign & FOREIGN_FLAGWORD)) ||
             native_flags(c, fp, Py_TYPE(x)) == 0)) {
            c->nat = nat; /* else the spec below validates it */
            c->nat_word = nat->word_off >= 0 && (S->foreign & FOREIGN_WORD) &&
                          Py_TYPE(x)->tp_basicsize >= nat->word_off + (Py_ssize_t)sizeof(void *) &&
                          native_word(nat, x) == impl;
        }
        if (PyErr_Occurred()) { Py_DECREF(c); return NULL; }
    }
    PyObject *spec = PyObject_GetAttr(fp, S->s_spec);
    if (spec && PyTuple_Check(spec)) {
        c->spec = spec;
        c->fpval = spec_values(spec, x);
        c->tp = (PyTypeObject *)Py_NewRef((PyObject *)Py_TYPE(x));
        c->descrs = spec_descrs(spec, c->tp);
    } else {
        Py_XDECREF(spec);
        if (soft_clear() < 0) { Py_DECREF(c); return NULL; }
        c->fpval = PyObject_CallOneArg(fp, x);
    }
    if (!c->fpval) { Py_DECREF(c); return NULL; }
    if (c->nat && !c->tp) c->tp = (PyTypeObject *)Py_NewRef((PyObject *)Py_TYPE(x));
    return c;
}

/* -- per-site merged counters -------------------------------------------------- */

typedef struct {
    PyObject *site;
    Py_ssize_t count;
} Count;

/* -- front caches ------------------------------------------------------------------
 * The destination and source caches are dicts keyed by id(x) (a new int per lookup
 * and a dict probe: ~40 ns a copy). In front of each, a table by the object's
 * address holds a strong reference to the entry last found there; a hit costs a few
 * compares. It is 4-way set-associative: 512 sets of 4, so a step's few hundred
 * objects rarely evict one another (direct-mapped, 2048 slots, a step of 512
 * destinations missed a quarter of its lookups). A stale way (the address reused by
 * another object) is caught as any stale entry is: its weak reference no longer
 * names x (cached_valid). */
#define FRONT_WAYS 4
#define FRONT_SETS 512
#define FRONT_SIZE (FRONT_WAYS * FRONT_SETS)
typedef struct {
    PyObject *key[FRONT_SIZE]; /* identity only, not owned; a set's ways side by side */
    PyObject *val[FRONT_SIZE]; /* owned Cached */
    unsigned char next[FRONT_SETS]; /* the way a set replaces next (round robin) */
    long long misses;               /* lookups that went on to the dict */
} Front;

static inline size_t front_set(PyObject *x) {
    /* Fibonacci hashing of the address (objects are 16-byte aligned) */
    uint64_t p = (uint64_t)(uintptr_t)x >> 4;
    return (size_t)((p * 0x9E3779B97F4A7C15ull) >> 55) & (FRONT_SETS - 1);
}

static void front_clear(Front *f) {
    for (size_t i = 0; i < FRONT_SIZE; i++) {
        f->key[i] = NULL;
        Py_CLEAR(f->val[i]);
    }
    memset(f->next, 0, sizeof f->next);
}

static void front_put(Front *f, PyObject *x, PyObject *c) {
    size_t set = front_set(x), base = set * FRONT_WAYS, i;
    for (i = base; i < base + FRONT_WAYS; i++)
        if (f->key[i] == x) break; /* already there: refresh its entry */
    if (i == base + FRONT_WAYS) {
        i = base + f->next[set];
        f->next[set] = (unsigned char)((f->next[set] + 1) & (FRONT_WAYS - 1));
    }
    f->key[i] = x;
    Py_XSETREF(f->val[i], Py_NewRef(c));
}

/* the cached entry for x (borrowed), or NULL (an error set, or none) */
static PyObject *front_get(Front *f, PyObject *dict, PyObject *x) {
    size_t base = front_set(x) * FRONT_WAYS;
    for (size_t i = base; i < base + FRONT_WAYS; i++)
        if (f->key[i] == x) return f->val[i];
    f->misses++;
    PyObject *key = PyLong_FromVoidPtr(x);
    if (!key) return NULL;
    PyObject *c = PyDict_GetItemWithError(dict, key);
    Py_DECREF(key);
    if (c) front_put(f, x, c);
    return c;
}
