/* The open segment, compiled: the twin of cucopy/segment.py (PySegment).
 *
 * Same bytes, same descriptors, same counters as the pure-Python reference;
 * the whole test suite runs on both (CUCOPY_PURE_PYTHON=1 selects the
 * reference). Where the two differ it is only in which copies the fast path
 * takes (try_h2d): this one also takes torch CPU tensors and other sources it
 * has seen before, validated by their fingerprint. Everything the fast path
 * does not take goes to the copier's general path, which calls the same
 * methods here (stage, append_h2d, cut, finish).
 *
 * The wire format is cucopy/pack.py's (header "<IHHIIIIQ", descriptor
 * "<QQQIIIIHHI"); tests/test_segment.py compares the encoded bytes of both
 * twins on random programs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define CUCOPY_NT 1
#else
#define CUCOPY_NT 0
#endif
#include "_carried_launcher.h"

#define HEADER_BYTES 32
#define DESC_BYTES 48
#define ALIGN 16
#define MAGIC 0x59504343u
#define VERSION 1
#define KIND_H2D 1
#define KIND_H2D_2D 2
#define KIND_D2D 3
#define KIND_FILL 4
#define WINDOWS_PER_BLOCK 256
#define BLOCK_BYTES (WINDOWS_PER_BLOCK * 16)
#define DCACHE_MAX 4096
#define MAXDIM 16 /* dimensions of a shape the fast path compares */
_Static_assert(sizeof(Py_ssize_t) == sizeof(int64_t), "shapes are compared as int64_t");
#define MAX_FIELD 0xFFFFFFFFLL /* pack.MAX_FIELD: a descriptor's 32-bit fields */

enum { MISS = 0, STAGED = 1, BARRIER = 2, FULL = -1, ORDER = -2 };

static PyObject *ndarray_type; /* numpy.ndarray */

/* An error raised by Python code the fast path called (a fingerprint, an attribute
 * of the documented view protocol): an Exception is a miss (cleared, 0; the general
 * path asks again and reports it), anything else (KeyboardInterrupt, SystemExit)
 * stays set and is propagated (-1), as the pure-Python twin propagates it. */
static inline int soft_clear(void) {
    if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* The calling thread's identity for step ownership: the thread state's id, which,
 * unlike the thread ident, is never reused by a later thread (twin:
 * cucopy.segment.thread_id). */
static inline uint64_t thread_id(void) {
    return PyThreadState_GetID(PyThreadState_Get());
}

/* tp_dealloc of a GC type whose tp_clear releases every field it holds */
static void cleared_dealloc(PyObject *o) {
    PyObject_GC_UnTrack(o);
    Py_TYPE(o)->tp_clear(o);
    Py_TYPE(o)->tp_free(o);
}

/* The leading fields of a NumPy array object (PyArrayObject_fields, numpy/ndarraytypes.h,
 * the same in NumPy 1.x and 2.x: part of its C ABI). Read only for exact ndarrays. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} NpArray;
#define NPY_C_CONTIGUOUS_FLAG 0x0001
static PyObject *s_dtype, *s_spec, *s_view;

static inline int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) & -a; }

/* -- descriptors ---------------------------------------------------------------- */

typedef struct {
    uint64_t dst, src, value;
    int64_t dpitch, spitch, width, rows, kind, elem;
} Desc;

typedef struct {
    Desc *v;
    Py_ssize_t n, cap;
} DescVec;

/* room for n items of size bytes in the array *v of *cap (doubling from 64) */
static int array_reserve(void **v, Py_ssize_t *cap, Py_ssize_t n, size_t size) {
    if (n <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 64;
    while (c < n) c *= 2;
    void *p = PyMem_Realloc(*v, (size_t)c * size);
    if (!p) { PyErr_NoMemory(); return -1; }
    *v = p;
    *cap = c;
    return 0;
}

static int descs_reserve(DescVec *d, Py_ssize_t n) {
    return array_reserve((void **)&d->v, &d->cap, n, sizeof(Desc));
}

static int descs_push(DescVec *d, const Desc *x) {
    if (d->n == d->cap && descs_reserve(d, d->n + 1) < 0) return -1;
    d->v[d->n++] = *x;
    return 0;
}

static int parse_desc(PyObject *t, Desc *d) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 9) {
        PyErr_SetString(PyExc_TypeError, "internal: a descriptor is a tuple of 10 ints");
        return -1;
    }
    uint64_t u[3];
    int64_t s[6];
    for (int i = 0; i < 3; i++) {
        u[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, i));
        if (u[i] == (uint64_t)-1 && PyErr_Occurred()) return -1;
    }
    for (int i = 0; i < 6; i++) {
        s[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 3 + i));
        if (s[i] == -1 && PyErr_Occurred()) return -1;
    }
    d->dst = u[0]; d->src = u[1]; d->value = u[2];
    d->dpitch = s[0]; d->spitch = s[1]; d->width = s[2]; d->rows = s[3];
    d->kind = s[4]; d->elem = s[5];
    return 0;
}

static PyObject *desc_tuple(const Desc *d) {
    return Py_BuildValue("(KKKLLLLLLi)", (unsigned long long)d->dst,
                         (unsigned long long)d->src, (unsigned long long)d->value,
                         (long long)d->dpitch, (long long)d->spitch, (long long)d->width,
                         (long long)d->rows, (long long)d->kind, (long long)d->elem, 0);
}

/* -- range sets (sorted, disjoint, touching ranges merged) -------------------- */

typedef uint64_t addr_t; /* device addresses: the sim's may pass 2**63 */

typedef struct {
    addr_t *lo, *hi;
    Py_ssize_t n, cap;
} Ranges;

static Py_ssize_t bisect_right(const addr_t *a, Py_ssize_t n, addr_t x) {
    Py_ssize_t l = 0, h = n;
    while (l < h) {
        Py_ssize_t m = (l + h) >> 1;
        if (x < a[m]) h = m; else l = m + 1;
    }
    return l;
}

static Py_ssize_t bisect_left(const addr_t *a, Py_ssize_t n, addr_t x) {
    Py_ssize_t l = 0, h = n;
    while (l < h) {
        Py_ssize_t m = (l + h) >> 1;
        if (a[m] < x) l = m + 1; else h = m;
    }
    return l;
}

static int ranges_grow_slow(Ranges *r);

static inline int ranges_grow(Ranges *r) {
    return r->n < r->cap ? 0 : ranges_grow_slow(r);
}

static int ranges_grow_slow(Ranges *r) {
    Py_ssize_t cap = r->cap ? r->cap * 2 : 64;
    addr_t *lo = PyMem_Realloc(r->lo, cap * sizeof(addr_t));
    if (!lo) { PyErr_NoMemory(); return -1; }
    r->lo = lo;
    addr_t *hi = PyMem_Realloc(r->hi, cap * sizeof(addr_t));
    if (!hi) { PyErr_NoMemory(); return -1; }
    r->hi = hi;
    r->cap = cap;
    return 0;
}

static int ranges_overlaps(const Ranges *r, addr_t lo, addr_t hi) {
    Py_ssize_t i = bisect_right(r->lo, r->n, lo);
    if (i && r->hi[i - 1] > lo) return 1;
    return i < r->n && r->lo[i] < hi;
}

static inline void ranges_insert(Ranges *r, Py_ssize_t i, addr_t lo, addr_t hi) {
    if (i < r->n) { /* (at the end, the usual case, nothing moves) */
        memmove(r->lo + i + 1, r->lo + i, (r->n - i) * sizeof(addr_t));
        memmove(r->hi + i + 1, r->hi + i, (r->n - i) * sizeof(addr_t));
    }
    r->lo[i] = lo;
    r->hi[i] = hi;
    r->n++;
}

static void ranges_delete(Ranges *r, Py_ssize_t i, Py_ssize_t j) { /* drop [i, j) */
    memmove(r->lo + i, r->lo + j, (r->n - j) * sizeof(addr_t));
    memmove(r->hi + i, r->hi + j, (r->n - j) * sizeof(addr_t));
    r->n -= j - i;
}

/* 1 claimed, 0 overlaps (nothing changed), -1 error */
static int ranges_claim(Ranges *r, addr_t lo, addr_t hi) {
    addr_t *los = r->lo, *his = r->hi;
    /* bisect_right, which is n when lo is at or past the last range's start (copies in
     * the order of their destinations' addresses: no search) */
    Py_ssize_t n = r->n, i = n && lo < los[n - 1] ? bisect_right(los, n, lo) : n;
    if (i && his[i - 1] >= lo) {
        if (his[i - 1] > lo) return 0;
        if (i < n && los[i] <= hi) {
            if (los[i] < hi) return 0;
            his[i - 1] = his[i];
            ranges_delete(r, i, i + 1);
        } else {
            his[i - 1] = hi;
        }
        return 1;
    }
    if (i < n && los[i] <= hi) {
        if (los[i] < hi) return 0;
        los[i] = lo;
        return 1;
    }
    if (ranges_grow(r) < 0) return -1;
    ranges_insert(r, i, lo, hi);
    return 1;
}

static int ranges_add(Ranges *r, addr_t lo, addr_t hi) {
    Py_ssize_t i = bisect_left(r->hi, r->n, lo);
    Py_ssize_t j = bisect_right(r->lo, r->n, hi);
    if (i < j) {
        if (r->lo[i] < lo) lo = r->lo[i];
        if (r->hi[j - 1] > hi) hi = r->hi[j - 1];
        r->lo[i] = lo;
        r->hi[i] = hi;
        ranges_delete(r, i + 1, j);
        return 0;
    }
    if (ranges_grow(r) < 0) return -1;
    ranges_insert(r, i, lo, hi);
    return 0;
}

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
static Entry *entry_pool[ENTRY_POOL_MAX];
static int entry_npool;

static int entry_clear(Entry *e);

/* e: a reference the caller owns and the only one left (refcount 1) */
static void entry_recycle(Entry *e) {
    entry_clear(e);
    if (entry_npool == ENTRY_POOL_MAX) { Py_DECREF(e); return; }
    entry_pool[entry_npool++] = e; /* still GC-tracked; all its fields NULL */
}

/* site, on_drop (a callable or None: wrapped in a list), lo, hi, index (stolen) */
static Entry *entry_new(PyObject *site, PyObject *on_drop, addr_t lo, addr_t hi,
                        PyObject *index) {
    Entry *e;
    int pooled = entry_npool > 0;
    if (pooled) e = entry_pool[--entry_npool];
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
        PyObject *d = _PyType_Lookup(tp, PyTuple_GET_ITEM(item, 0)); /* borrowed */
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

/* -- native geometry getters ----------------------------------------------------
 * A fingerprint function may declare ``__cucopy_native__ = (attr, data_ptr, dim,
 * sizes, strides, dtype)``: reading ``x.attr`` gives an int handle h, and each of
 * the others is the address of a C function ``int f(void **tensor, T *out)``
 * (0 on success) called with a pointer to a word holding h. The torch adapter
 * declares it with ``_cdata`` (the TensorImpl) and torch's stable C shim
 * (``aoti_torch_get_*``, which take an ``at::Tensor*``: one word holding the
 * TensorImpl), after checking it against the Python attributes. Then a cached
 * tensor is validated by one attribute read and five C calls instead of four
 * Python calls that each build ints and tuples (about 0.3 us a tensor on the GPU's
 * host). The values compared are the fingerprint's own (address, shape, strides,
 * dtype), so the twins still agree on every hit and miss. An optional 7th field is
 * the byte offset at which the object holds the handle itself (see native_word), or
 * -1. */
typedef int (*nat_ptr_fn)(void **h, void **out);
typedef int (*nat_i64_fn)(void **h, int64_t *out);
typedef int (*nat_i64p_fn)(void **h, int64_t **out);
typedef int (*nat_i32_fn)(void **h, int32_t *out);

typedef struct Native {
    PyObject *fp;   /* the fingerprint function that declared it */
    PyObject *attr; /* the handle attribute's name */
    Py_ssize_t word_off; /* where the object holds the handle itself, or -1 (see below) */
    Py_ssize_t flag_off; /* where the handle's object keeps bits that must be clear, or -1 */
    uint64_t flag_mask;  /* those bits (torch: the key set's Conjugate and Negative) */
    nat_ptr_fn data_ptr;
    nat_i64_fn dim;
    nat_i64p_fn sizes, strides;
    nat_i32_fn dtype;
} Native;

typedef struct NGeo {
    void *ptr;
    int64_t ndim;
    int32_t dtype;
    int64_t sizes[MAXDIM], strides[MAXDIM];
} NGeo;

#define MAX_NATIVES 8
static Native natives[MAX_NATIVES];
static int nnatives;
static PyObject *s_native;

/* the native getters fp declares (parsed once, kept for the process), or NULL */
static Native *native_for(PyObject *fp) {
    for (int i = 0; i < nnatives; i++)
        if (natives[i].fp == fp) return natives[i].attr ? &natives[i] : NULL;
    if (nnatives == MAX_NATIVES) return NULL;
    Native *n = &natives[nnatives];
    memset(n, 0, sizeof(*n));
    PyObject *t = PyObject_GetAttr(fp, s_native);
    if (!t) {
        if (soft_clear() < 0) return NULL; /* (a BaseException: the caller sees it set) */
    } else if (PyTuple_Check(t) &&
               (PyTuple_GET_SIZE(t) == 6 || PyTuple_GET_SIZE(t) == 7 || PyTuple_GET_SIZE(t) == 9) &&
             PyUnicode_Check(PyTuple_GET_ITEM(t, 0))) {
        void *f[5];
        int ok = 1;
        for (int i = 0; i < 5; i++) {
            f[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(t, i + 1));
            if (!f[i]) { PyErr_Clear(); ok = 0; }
        }
        if (ok) {
            n->attr = Py_NewRef(PyTuple_GET_ITEM(t, 0));
            n->data_ptr = (nat_ptr_fn)f[0];
            n->dim = (nat_i64_fn)f[1];
            n->sizes = (nat_i64p_fn)f[2];
            n->strides = (nat_i64p_fn)f[3];
            n->dtype = (nat_i32_fn)f[4];
            n->word_off = -1;
            n->flag_off = -1;
            if (PyTuple_GET_SIZE(t) >= 7) {
                Py_ssize_t off = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 6));
                if (off == -1 && PyErr_Occurred()) PyErr_Clear();
                else if (off >= 16 && off % 8 == 0) n->word_off = off;
            }
            if (PyTuple_GET_SIZE(t) == 9) { /* (exact ints: no Python code runs) */
                Py_ssize_t off = PyLong_CheckExact(PyTuple_GET_ITEM(t, 7))
                                     ? PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 7)) : -1;
                unsigned long long mask = PyLong_CheckExact(PyTuple_GET_ITEM(t, 8))
                                              ? PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 8))
                                              : 0;
                if (PyErr_Occurred()) PyErr_Clear();
                else if (off >= 0 && off % 8 == 0 && mask) {
                    n->flag_off = off;
                    n->flag_mask = mask;
                }
            }
        }
    }
    Py_XDECREF(t);
    n->fp = Py_NewRef(fp); /* kept: the entry is keyed by its identity */
    nnatives++;
    return n->attr ? n : NULL;
}

/* the handle attribute's data descriptor on tp (new reference), or NULL */
static PyObject *native_descr(Native *n, PyTypeObject *tp) {
    PyObject *d = _PyType_Lookup(tp, n->attr); /* borrowed */
    if (!d || !Py_TYPE(d)->tp_descr_get || !Py_TYPE(d)->tp_descr_set) return NULL;
    return Py_NewRef(d);
}

/* the handle x's attribute gives (NULL: none; an Exception cleared, another
 * BaseException left set) */
static void *native_handle(Native *n, PyObject *descr, PyTypeObject *tp, PyObject *x) {
    PyObject *h = Py_TYPE(descr)->tp_descr_get(descr, x, (PyObject *)tp);
    if (!h) { soft_clear(); return NULL; } /* a BaseException stays set */
    void *impl = PyLong_AsVoidPtr(h);
    Py_DECREF(h);
    if (!impl) soft_clear();
    return impl;
}

/* The handle word a tensor object holds itself (torch: THPVariable's at::Tensor, one
 * word naming the TensorImpl): reading it skips the `_cdata` getter, which builds and
 * frees a Python int (~300 instructions a tensor). The adapter declares the offset
 * only after it read `_cdata` there on tensors of several kinds, and a cache entry
 * uses it only after it read the attribute's value there on that very object
 * (cached_new): an object's handle never changes while it lives (resize_, set_ and
 * `.data =` change the TensorImpl, not which one; a collected tensor's weak
 * reference is cleared before its fields, so cached_valid never gets that far). */
static inline void *native_word(Native *n, PyObject *x) {
    return *(void *const *)((const char *)x + n->word_off);
}

static long long native_word_reads; /* validations through the word (for the tests) */

/* the geometry of the tensor whose handle is impl: 1 read, 0 not */
static int native_geo(Native *n, void *impl, NGeo *g) {
    if (!impl) return 0;
    void *word = impl; /* an at::Tensor is one word: its TensorImpl */
    int64_t *sz, *st;
    if (n->data_ptr(&word, &g->ptr) || n->dim(&word, &g->ndim) || g->ndim < 0 ||
        g->ndim > MAXDIM || n->dtype(&word, &g->dtype) || n->sizes(&word, &sz) ||
        n->strides(&word, &st))
        return 0;
    memcpy(g->sizes, sz, (size_t)g->ndim * sizeof(int64_t));
    memcpy(g->strides, st, (size_t)g->ndim * sizeof(int64_t));
    return 1;
}

/* x's geometry through the native getters: 1 read, 0 not (errors cleared) */
static int native_read(Native *n, PyObject *descr, PyTypeObject *tp, PyObject *x, NGeo *g) {
    return native_geo(n, native_handle(n, descr, tp, x), g);
}

/* native_geo(n, impl) equal to was, compared as read (no copy, no memcmp call), and the
 * handle's flag bits clear (a conjugate or negative view set in place: a miss) */
static int native_same(Native *n, void *impl, const NGeo *was) {
    if (!impl) return 0;
    if (n->flag_off >= 0 &&
        (*(const uint64_t *)((const char *)impl + n->flag_off) & n->flag_mask))
        return 0;
    void *word = impl, *ptr;
    int64_t ndim, *sz, *st;
    int32_t dtype;
    if (n->data_ptr(&word, &ptr) || ptr != was->ptr || n->dim(&word, &ndim) ||
        ndim != was->ndim || n->dtype(&word, &dtype) || dtype != was->dtype ||
        n->sizes(&word, &sz) || n->strides(&word, &st))
        return 0;
    for (int64_t i = 0; i < ndim; i++)
        if (sz[i] != was->sizes[i] || st[i] != was->strides[i]) return 0;
    return 1;
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
            native_word_reads++;
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

static PyObject *s_flags; /* "__cucopy_flags__" */

/* c->flags from fp's ``__cucopy_flags__`` (names of methods of tp that must return
 * False: their bits change what the bytes mean, and the native getters do not read
 * them): 0 resolved (or none declared), 1 not usable (the spec validates instead),
 * -1 with a BaseException set */
static int native_flags(Cached *c, PyObject *fp, PyTypeObject *tp) {
    PyObject *names = PyObject_GetAttr(fp, s_flags);
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
    Native *nat = native_for(fp);
    if (!nat && PyErr_Occurred()) { Py_DECREF(c); return NULL; }
    if (nat) {
        c->ndescr = native_descr(nat, Py_TYPE(x));
        c->nval = c->ndescr ? PyMem_Malloc(sizeof(NGeo)) : NULL;
        void *impl = c->nval ? native_handle(nat, c->ndescr, Py_TYPE(x), x) : NULL;
        if (!impl && PyErr_Occurred()) { Py_DECREF(c); return NULL; }
        if (impl && native_geo(nat, impl, c->nval) &&
            (nat->flag_off >= 0 || native_flags(c, fp, Py_TYPE(x)) == 0)) {
            c->nat = nat; /* else the spec below validates it */
            c->nat_word = nat->word_off >= 0 &&
                          Py_TYPE(x)->tp_basicsize >= nat->word_off + (Py_ssize_t)sizeof(void *) &&
                          native_word(nat, x) == impl;
        }
        if (PyErr_Occurred()) { Py_DECREF(c); return NULL; }
    }
    PyObject *spec = PyObject_GetAttr(fp, s_spec);
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

/* -- Segment ---------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *merge, *barriers, *fills;
    PyObject **ckeys; /* per-site merged counts: an open-addressed table by site identity */
    Py_ssize_t *cvals;
    unsigned char *cflags; /* the site's plan, once asked: SITE_KNOWN | SITE_MERGE | SITE_BARRIER */
    Py_ssize_t ccap, cused;
    PyObject *slot;
    Py_buffer view; /* the slot's pinned bytes, held while bound */
    int bound;
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
    Py_ssize_t n = s->nraw;
    s->nraw = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(s->raw[i].site);
        Py_XDECREF(s->raw[i].on_drop);
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
    return 0; /* the fronts hold Cached entries only: they reference nothing back */
}

static void seg_release(Segment *s) {
    if (s->bound) {
        PyBuffer_Release(&s->view);
        s->bound = 0;
    }
    Py_CLEAR(s->slot);
}

static int seg_clear(Segment *s) {
    seg_release(s);
    Py_CLEAR(s->merge); Py_CLEAR(s->barriers); Py_CLEAR(s->fills);
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
static int site_flags(Segment *s, PyObject *site);

static PyObject *s_array, *s_top, *s_bottom, *s_headroom;

static PyObject *seg_bind(Segment *s, PyObject *slot) {
    PyObject *arr = PyObject_GetAttr(slot, s_array);
    if (!arr) { seg_release(s); return NULL; }
    /* The export (~0.05 us) is kept for the slot bound last: binding that slot
     * again (a ring of one slot, a re-bind) reuses it; the next slot of a rotating
     * ring is exported afresh. A slot the ring replaced is another object, and a
     * closed slot's array is None: both are exported afresh (or fail). */
    if (!s->bound || slot != s->slot || arr != s->view.obj) {
        seg_release(s);
        int r = PyObject_GetBuffer(arr, &s->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
        if (r < 0) { Py_DECREF(arr); return NULL; }
        s->bound = 1;
        s->slot = Py_NewRef(slot);
        s->size = s->view.len;
        /* the bytes a carried launch may write before offset 0 (see launch_carried) */
        PyObject *h = PyObject_GetAttr(slot, s_headroom);
        s->headroom = h && PyLong_CheckExact(h) ? PyLong_AsLongLong(h) : 0;
        Py_XDECREF(h);
        if (s->headroom < 0 || PyErr_Occurred()) {
            if (soft_clear() < 0) { seg_release(s); return NULL; }
            s->headroom = 0;
        }
    }
    Py_DECREF(arr);
    /* read every time: the ring resets them when it hands the slot out again */
    PyObject *top = PyObject_GetAttr(slot, s_top);
    PyObject *bottom = top ? PyObject_GetAttr(slot, s_bottom) : NULL;
    if (!bottom) { Py_XDECREF(top); seg_release(s); return NULL; }
    s->top = PyLong_AsLongLong(top);
    s->bottom = PyLong_AsLongLong(bottom);
    Py_DECREF(top);
    Py_DECREF(bottom);
    if (PyErr_Occurred()) { seg_release(s); return NULL; }
    /* clamped to the exported bytes: a slot whose top claims more is not trusted */
    if (s->top > s->size) s->top = s->size;
    if (s->top < 0) s->top = 0;
    if (s->bottom > s->top) s->bottom = s->top;
    if (s->bottom < 0) s->bottom = 0;
    s->cursor = 0;
    s->seg = -1;
    Py_RETURN_NONE;
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

static PyObject *seg_take_top(Segment *s, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (!s->bound || !s->slot || n < 0) return PyLong_FromLong(-1); /* nothing to take */
    int64_t top = (s->top - n) & -(int64_t)ALIGN;
    int64_t tail = nstaged(s) ? reserve_tail(s) : 0;
    if (top >= max64(s->cursor, s->bottom) + tail) {
        PyObject *v = PyLong_FromLongLong(top);
        if (!v || PyObject_SetAttr(s->slot, s_top, v) < 0) { Py_XDECREF(v); return NULL; }
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
    PyObject *vspec = PyObject_GetAttr(fp, s_view);
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

/* A destination's geometry for one call: from its cache entry, or computed from
 * a view's own attributes when its base is cached. */
typedef struct {
    addr_t ptr, lo, hi;
    int64_t rows, width, pitch, nbytes, itemsize;
    int kind;
    int ndim; /* the destination's shape (-1: unknown) */
    const int64_t *shape; /* the cache entry's, or buf's (a view's, computed) */
    int64_t buf[MAXDIM];
    PyObject *dtype; /* the cache entry's (hold keeps it) */
    PyObject *hold;  /* a strong reference to the cache entry the fields above come from:
                      * Python code the fast path calls (a fingerprint, a view's
                      * attributes) may empty the caches (close() in a shutdown hook) */
} Geo;

/* The copier's shape rule, as far as the fast path follows it: a flat source (one
 * dimension once leading 1s are dropped) fills any destination, otherwise the shapes
 * must be equal; anything else (leading 1s on one side only) is the general path's. */
static int shape_fits(int sn, const Py_ssize_t *ss, int dn, const int64_t *ds) {
    int i = 0;
    while (i < sn - 1 && ss[i] == 1) i++;
    if (sn - i <= 1) return 1;
    if (sn != dn) return 0;
    for (int k = 0; k < sn; k++)
        if ((int64_t)ss[k] != ds[k]) return 0;
    return 1;
}

/* _layout.form: a view as rows of width bytes, pitch apart; 0 when it is not one */
static int form(const int64_t *shape, const int64_t *strides, int ndim, int64_t itemsize,
                int64_t *rows_out, int64_t *width_out, int64_t *pitch_out) {
    int64_t n_[MAXDIM + 1], s_[MAXDIM + 1]; /* ndim <= MAXDIM, plus one appended below */
    int k = 0;
    if (ndim < 0 || ndim > MAXDIM) return 0;
    for (int i = 0; i < ndim; i++)
        if (shape[i] != 1) { n_[k] = shape[i]; s_[k] = strides[i]; k++; }
    if (!k) { *rows_out = 1; *width_out = *pitch_out = itemsize; return 1; }
    if (s_[k - 1] != itemsize) { n_[k] = 1; s_[k] = itemsize; k++; }
    int64_t width = itemsize;
    while (k && s_[k - 1] == width) { width *= n_[k - 1]; k--; }
    if (!k) { *rows_out = 1; *width_out = *pitch_out = width; return 1; }
    int64_t rows = n_[k - 1], pitch = s_[k - 1];
    for (int i = k - 2; i >= 0; i--) {
        if (s_[i] != pitch * rows) return 0;
        rows *= n_[i];
    }
    if (pitch < width) return 0;
    *rows_out = rows; *width_out = width; *pitch_out = pitch;
    return 1;
}

static PyObject *get(PyObject *x, PyObject *name, int call) {
    return call ? PyObject_CallMethodNoArgs(x, name) : PyObject_GetAttr(x, name);
}

static int ints(PyObject *seq, int64_t *out, int max) {
    PyObject *f = PySequence_Fast(seq, "");
    if (!f) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    if (n > max) { Py_DECREF(f); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(f, i));
        if (out[i] == -1 && PyErr_Occurred()) { Py_DECREF(f); return -1; }
    }
    Py_DECREF(f);
    return (int)n;
}

/* The view protocol a fingerprint function may declare (``__cucopy_view__``):
 * (base, ptr, ptr_call, shape, strides, strides_call, strides_in_elements, dtype, flags)
 * where flags name methods that must return False. 1 found, 0 not, -1 error. */
static int view_geo(Segment *s, PyObject *dst, PyObject *vspec, Geo *g) {
    if (!PyTuple_Check(vspec) || PyTuple_GET_SIZE(vspec) != 9) return 0;
    PyObject *base = PyObject_GetAttr(dst, PyTuple_GET_ITEM(vspec, 0));
    if (!base) return soft_clear();
    if (base == Py_None) { Py_DECREF(base); return 0; }
    Cached *b = (Cached *)front_get(&s->dfront, s->dcache, base);
    if (!b && PyErr_Occurred()) { Py_DECREF(base); return -1; }
    Py_XINCREF(b); /* held: the reads below run Python code */
    int ok = 0;
    PyObject *dt = NULL, *p = NULL, *shape = NULL, *strides = NULL;
    int64_t sh[MAXDIM], st[MAXDIM];
    int nd;
    addr_t ptr;
    int in_elements = PyTuple_GET_ITEM(vspec, 6) == Py_True;
    if (!b || !weak_is(b->ref, base) || !b->vdtype) goto out;
    NGeo ng;
    int native = b->nat && Py_TYPE(dst) == b->tp;
    if (native) { /* address, shape, strides and dtype from C (see native_read) */
        if (!native_read(b->nat, b->ndescr, b->tp, dst, &ng) || ng.dtype != b->nval->dtype)
            goto out;
    } else {
        dt = PyObject_GetAttr(dst, PyTuple_GET_ITEM(vspec, 7));
        if (!dt) goto out;
        int eq = dt == b->vdtype ? 1 : PyObject_RichCompareBool(dt, b->vdtype, Py_EQ);
        if (eq != 1) goto out;
    }
    PyObject *flags = PyTuple_GET_ITEM(vspec, 8);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(flags); i++) {
        PyObject *v = PyObject_CallMethodNoArgs(dst, PyTuple_GET_ITEM(flags, i));
        if (!v) goto out;
        Py_DECREF(v);
        if (v != Py_False) goto out;
    }
    if (native) {
        nd = (int)ng.ndim;
        memcpy(sh, ng.sizes, (size_t)nd * sizeof(int64_t));
        memcpy(st, ng.strides, (size_t)nd * sizeof(int64_t));
        ptr = (addr_t)(uintptr_t)ng.ptr;
    } else {
        p = get(dst, PyTuple_GET_ITEM(vspec, 1), PyTuple_GET_ITEM(vspec, 2) == Py_True);
        shape = p ? PyObject_GetAttr(dst, PyTuple_GET_ITEM(vspec, 3)) : NULL;
        strides = shape ? get(dst, PyTuple_GET_ITEM(vspec, 4),
                              PyTuple_GET_ITEM(vspec, 5) == Py_True)
                        : NULL;
        if (!strides) goto out;
        ptr = PyLong_AsUnsignedLongLong(p);
        if (PyErr_Occurred()) goto out;
        nd = ints(shape, sh, MAXDIM);
        int ns = ints(strides, st, MAXDIM);
        if (nd < 0 || ns != nd) goto out;
    }
    g->ndim = nd;
    memcpy(g->buf, sh, (size_t)nd * sizeof(int64_t));
    g->shape = g->buf;
    int64_t numel = 1;
    for (int i = 0; i < nd; i++) {
        numel *= sh[i];
        if (in_elements) st[i] *= b->itemsize;
    }
    if (numel <= 0) goto out;
    if (!form(sh, st, nd, b->itemsize, &g->rows, &g->width, &g->pitch)) goto out;
    if (g->rows > MAX_FIELD || g->width > MAX_FIELD || g->pitch > MAX_FIELD)
        goto out; /* too wide for a descriptor's 32-bit fields: the general path's */
    g->ptr = g->lo = ptr;
    g->hi = ptr + (addr_t)((g->rows - 1) * g->pitch + g->width);
    g->nbytes = g->rows * g->width;
    g->kind = g->rows == 1 ? KIND_H2D : KIND_H2D_2D;
    g->dtype = b->dtype;
    g->itemsize = b->itemsize;
    g->hold = Py_NewRef((PyObject *)b);
    ok = 1;
out:
    if (ok == 0 && soft_clear() < 0) ok = -1;
    Py_XDECREF(dt); Py_XDECREF(p); Py_XDECREF(shape); Py_XDECREF(strides);
    Py_XDECREF(b);
    Py_DECREF(base);
    return ok;
}

/* A cached destination's geometry (or a fresh view's, from its cached base):
 * 1 found, 0 not, -1 error. */
HOT_INLINE int dst_geo(Segment *s, PyObject *dst, Geo *gp) {
    Cached *c = (Cached *)front_get(&s->dfront, s->dcache, dst);
    int r;
    if (c) {
        if (!c->kind) return 0;
        Py_INCREF(c); /* held: cached_valid may run Python code */
        r = cached_valid(c, dst);
        if (r <= 0) {
            Py_DECREF(c);
            return r;
        }
        gp->hold = (PyObject *)c;
        gp->ptr = c->ptr; gp->lo = c->lo; gp->hi = c->hi; gp->rows = c->rows; gp->width = c->width;
        gp->pitch = c->pitch; gp->nbytes = c->nbytes; gp->kind = c->kind; gp->dtype = c->dtype;
        gp->itemsize = c->itemsize;
        gp->ndim = c->ndim;
        gp->shape = c->shape;
    } else {
        if (PyErr_Occurred()) return -1;
        /* a view made afresh (buf[:n]) of a cached buffer */
        PyObject *vspec = PyDict_GetItemWithError(s->vtypes, (PyObject *)Py_TYPE(dst));
        if (!vspec) {
            if (PyErr_Occurred()) return -1;
            return 0;
        }
        Py_INCREF(vspec);
        r = view_geo(s, dst, vspec, gp);
        Py_DECREF(vspec);
        return r;
    }
    return 1;
}

static void seg_open(Segment *s);

static PyObject *seg_set_capture_query(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_capture_query(fn, arg)");
        return NULL;
    }
    Py_XSETREF(s->capq, args[0] == Py_None ? NULL : Py_NewRef(args[0]));
    Py_XSETREF(s->caparg, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

/* Before a fast copy opens a segment: whether the copier's stream is (still) not
 * capturing. A capture that began after begin() would leave the copies staged now out
 * of the graph (they would land once, outside it, at the flush): the general path
 * then refuses the copy. Asked once a segment (~0.1 us on the GPU's host), not once a
 * copy. 1 idle, 0 capturing or cannot tell, -1 a BaseException set. */
static int seg_capture_idle(Segment *s) {
    if (!s->capq) return 1;
    PyObject *st = PyObject_CallOneArg(s->capq, s->caparg);
    if (!st) return soft_clear();
    int idle = st == Py_False;
    if (!idle && PyLong_CheckExact(st)) {
        int overflow;
        idle = PyLong_AsLongLongAndOverflow(st, &overflow) == 0 && !overflow;
        PyErr_Clear(); /* (an int's overflow, not Python code) */
    }
    Py_DECREF(st);
    return idle;
}

/* the segment still takes fast copies: the step open, its slot bound, the caller
 * the thread whose step it is */
HOT_INLINE int seg_usable(Segment *s) {
    return s->fast && s->bound && s->owner == thread_id();
}

/* try_h2d (skip = 0) and try_skip (skip = 1): the same checks; only try_h2d stages.
 * MISS, STAGED or BARRIER, or -1 with an error set. */
static int h2d_fast(Segment *s, PyObject *site, PyObject *dst, PyObject *src,
                    PyObject *on_drop, int skip) {
    if (!seg_usable(s) || (on_drop != Py_None && !PyCallable_Check(on_drop))) return MISS;
    int fl = site_flags(s, site);
    if (fl < 0 || !(fl & SITE_MERGE)) return fl < 0 && soft_clear() < 0 ? -1 : MISS;
    Geo g;
    int r = dst_geo(s, dst, &g);
    if (r <= 0) return r < 0 ? -1 : MISS;
    r = 0;
    /* dst_geo may have run Python code (a fingerprint, a view's attributes) that
     * closed the copier or ended the step: asked again before anything is staged */
    if (!seg_usable(s)) goto miss;
    if (s->seg < 0) {
        int idle = seg_capture_idle(s);
        if (idle <= 0) { if (idle < 0) goto fail; goto miss; }
        if (!seg_usable(s)) goto miss; /* the query is Python code on some backends */
        seg_open(s);
    }
    if ((PyObject *)Py_TYPE(src) == ndarray_type &&
        ((NpArray *)src)->descr == g.dtype) { /* the usual case: read the array's fields */
        NpArray *a = (NpArray *)src;
        int64_t n = 1;
        for (int i = 0; i < a->nd; i++) n *= a->dimensions[i];
        if ((a->flags & NPY_C_CONTIGUOUS_FLAG) && a->nd <= MAXDIM &&
            n * g.itemsize == g.nbytes && shape_fits(a->nd, a->dimensions, g.ndim, g.shape))
            r = skip ? 1
                     : append_raw(s, site, on_drop, g.ptr, g.rows, g.width, g.pitch, g.lo, g.hi,
                                  g.nbytes, g.kind, a->data);
        else if (a->nd == 2 && g.kind == KIND_H2D_2D && a->dimensions[0] == g.rows &&
                 a->strides[1] == g.itemsize && a->dimensions[1] * g.itemsize == g.width &&
                 a->strides[0] >= g.width && n * g.itemsize == g.nbytes &&
                 shape_fits(a->nd, a->dimensions, g.ndim, g.shape))
            /* rows of packed elements, not packed together (table[:, :n]): gathered */
            r = skip ? 1
                     : append_raw_rows(s, site, on_drop, g.ptr, g.rows, g.width, g.pitch, g.lo,
                                       g.hi, g.nbytes, g.kind, a->data, a->strides[0]);
    } else if ((PyObject *)Py_TYPE(src) == ndarray_type) {
        PyObject *dt = PyObject_GetAttr(src, s_dtype);
        if (!dt) goto soft;
        int eq = dt == g.dtype ? 1 : PyObject_RichCompareBool(dt, g.dtype, Py_EQ);
        Py_DECREF(dt);
        if (eq != 1) { if (eq < 0) goto soft; goto miss; }
        Py_buffer b;
        if (PyObject_GetBuffer(src, &b, PyBUF_C_CONTIGUOUS) < 0) goto soft;
        if (!seg_usable(s)) { PyBuffer_Release(&b); goto miss; }
        if (b.len == g.nbytes && shape_fits(b.ndim, b.shape, g.ndim, g.shape))
            r = skip ? 1
                     : append_raw(s, site, on_drop, g.ptr, g.rows, g.width, g.pitch, g.lo, g.hi,
                                  g.nbytes, g.kind, b.buf);
        PyBuffer_Release(&b);
    } else {
        Cached *sc = (Cached *)front_get(&s->sfront, s->scache, src);
        if (!sc) { if (PyErr_Occurred()) goto fail; goto miss; }
        Py_INCREF(sc);
        /* (a cached shape is read as Py_ssize_t: as wide, see MAXDIM's assertion) */
        int v = 0;
        if (sc->nbytes == g.nbytes && sc->ndim >= 0 &&
            shape_fits(sc->ndim, (const Py_ssize_t *)sc->shape, g.ndim, g.shape)) {
            /* the dtypes first: the fingerprint is the last Python code run before the
             * source's bytes are read at the address it vouches for */
            int eq = sc->dtype == g.dtype ? 1 : PyObject_RichCompareBool(sc->dtype, g.dtype, Py_EQ);
            if (eq < 0) v = soft_clear() < 0 ? -1 : 0;
            else if (eq == 1) v = cached_valid(sc, src);
        }
        if (v == 1) {
            if (!seg_usable(s)) v = 0; /* closed by the code just run */
            else if (skip) r = 1;
            else
                r = append_raw(s, site, on_drop, g.ptr, g.rows, g.width, g.pitch, g.lo, g.hi,
                               g.nbytes, g.kind, (const void *)(uintptr_t)sc->ptr);
        }
        Py_DECREF(sc);
        if (v < 0) goto fail;
    }
    Py_DECREF(g.hold);
    if (r < 0) return -1;
    if (r == 0) return MISS;
    if (skip) return STAGED;
    return fl & SITE_BARRIER ? BARRIER : STAGED;
soft:
    if (soft_clear() < 0) goto fail;
miss:
    Py_DECREF(g.hold);
    return MISS;
fail:
    Py_DECREF(g.hold);
    return -1;
}

static PyObject *seg_stage(Segment *s, PyObject *args);

static PyObject *seg_try_fill(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    /* try_fill(site, dst, start, value, on_drop) -> MISS / STAGED / BARRIER */
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "try_fill(site, dst, start, value, on_drop)");
        return NULL;
    }
    PyObject *site = args[0], *dst = args[1], *on_drop = args[4];
    if (!s->fast || !s->bound || s->owner != thread_id() ||
        !PyLong_CheckExact(args[2]) || !PyLong_CheckExact(args[3]) ||
        (on_drop != Py_None && !PyCallable_Check(on_drop)))
        return PyLong_FromLong(MISS);
    int in = contains(s->fills, site);
    if (in != 1) {
        if (in < 0 && soft_clear() < 0) return NULL;
        return PyLong_FromLong(MISS);
    }
    int overflow = 0;
    long long start = PyLong_AsLongLongAndOverflow(args[2], &overflow);
    if (overflow || start < 0) return PyLong_FromLong(MISS);
    Geo g;
    int r = dst_geo(s, dst, &g);
    if (r <= 0) return r < 0 ? NULL : PyLong_FromLong(MISS);
    PyObject *out = NULL;
    if (!seg_usable(s)) goto miss; /* closed or ended by the code dst_geo ran */
    int64_t it = g.itemsize, size = g.nbytes / (it ? it : 1);
    PyObject *kind = PyObject_GetAttrString(g.dtype, "kind");
    if (!kind) goto soft;
    if (!PyUnicode_Check(kind)) { Py_DECREF(kind); goto miss; }
    int signed_ = PyUnicode_CompareWithASCIIString(kind, "i") == 0;
    int unsigned_ = PyUnicode_CompareWithASCIIString(kind, "u") == 0;
    Py_DECREF(kind);
    if ((!signed_ && !unsigned_) || (it != 1 && it != 2 && it != 4 && it != 8) || start >= size)
        goto miss;
    if (it > 1) { /* the pattern below is in the host's order: a swapped dtype is the
                   * general path's (its pattern comes from NumPy, in the dtype's order) */
        PyObject *native = PyObject_GetAttrString(g.dtype, "isnative");
        if (!native) goto soft;
        Py_DECREF(native);
        if (native != Py_True) goto miss;
    }
    if (!seg_usable(s)) goto miss; /* (the dtype's attributes: Python for a hostile dtype) */
    uint64_t pattern;
    int bits = (int)(8 * it);
    if (signed_) {
        long long v = PyLong_AsLongLongAndOverflow(args[3], &overflow);
        if (overflow) goto miss;
        if (bits < 64 && (v < -(1LL << (bits - 1)) || v >= (1LL << (bits - 1)))) goto miss;
        pattern = (uint64_t)v;
    } else {
        if (_PyLong_Sign(args[3]) < 0) goto miss;
        unsigned long long v = PyLong_AsUnsignedLongLong(args[3]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) goto soft;
        if (bits < 64 && v >= (1ULL << bits)) goto miss;
        pattern = v;
    }
    if (bits < 64) pattern &= (1ULL << bits) - 1;
    /* _layout.tail_blocks */
    int64_t per_row = g.width / it, r0 = start / per_row, c0 = start % per_row;
    PyObject *descs = PyList_New(0), *first = NULL;
    if (!descs) goto fail;
    addr_t lo = 0, hi = 0;
    int nparts = 0;
    if (c0) {
        int64_t w = g.width - c0 * it;
        addr_t p = g.ptr + (addr_t)(r0 * g.pitch + c0 * it);
        PyObject *d = Py_BuildValue("(KiKLiLLiLi)", (unsigned long long)p, 0,
                                    (unsigned long long)pattern, (long long)w, 0, (long long)w,
                                    1LL, KIND_FILL, (long long)it, 0);
        if (!d || PyList_Append(descs, d) < 0) { Py_XDECREF(d); Py_DECREF(descs); goto fail; }
        Py_DECREF(d);
        first = Py_BuildValue("(KLLL)", (unsigned long long)p, 1LL, (long long)w, (long long)w);
        lo = p;
        hi = p + (addr_t)w;
        nparts++;
        r0++;
    }
    if (r0 < g.rows) {
        int64_t nr = g.rows - r0, pitch = nr > 1 ? g.pitch : g.width;
        addr_t p = g.ptr + (addr_t)(r0 * g.pitch);
        PyObject *d = Py_BuildValue("(KiKLiLLiLi)", (unsigned long long)p, 0,
                                    (unsigned long long)pattern, (long long)pitch, 0,
                                    (long long)g.width, (long long)nr, KIND_FILL, (long long)it, 0);
        if (!d || PyList_Append(descs, d) < 0) { Py_XDECREF(d); Py_DECREF(descs); Py_XDECREF(first);
            goto fail; }
        Py_DECREF(d);
        if (!nparts) {
            first = Py_BuildValue("(KLLL)", (unsigned long long)p, (long long)nr,
                                  (long long)g.width, (long long)pitch);
            lo = p;
        }
        hi = p + (addr_t)((nr - 1) * pitch + g.width);
        nparts++;
    }
    if (!first) { Py_DECREF(descs); goto fail; }
    if (s->seg < 0) {
        int idle = seg_capture_idle(s);
        if (idle <= 0 || !seg_usable(s)) {
            Py_DECREF(descs);
            Py_DECREF(first);
            if (idle < 0) goto fail;
            goto miss;
        }
        seg_open(s);
    }
    PyObject *st = Py_BuildValue("(OOKKOiOi)", site, on_drop, (unsigned long long)lo,
                                 (unsigned long long)hi, nparts == 1 ? first : Py_None, 0, descs,
                                 0);
    Py_DECREF(descs);
    Py_DECREF(first);
    if (!st) goto fail;
    PyObject *res = seg_stage(s, st);
    Py_DECREF(st);
    if (!res) goto fail;
    if (!PyTuple_Check(res)) { Py_DECREF(res); goto miss; } /* FULL or ORDER */
    Entry *e = (Entry *)PyTuple_GET_ITEM(res, 0);
    PyObject *pb = PyBytes_FromStringAndSize((const char *)&pattern, (Py_ssize_t)it);
    PyObject *val = pb ? Py_BuildValue("(LN)", start, pb) : NULL;
    Py_DECREF(res);
    if (!val) goto fail;
    Py_SETREF(e->value, val);
    in = contains(s->barriers, site);
    if (in < 0) goto fail;
    out = PyLong_FromLong(in ? BARRIER : STAGED);
    Py_DECREF(g.hold);
    return out;
soft:
    if (soft_clear() < 0) goto fail;
miss:
    Py_DECREF(g.hold);
    return PyLong_FromLong(MISS);
fail:
    Py_DECREF(g.hold);
    return NULL;
}

static PyObject *seg_try_h2d(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    /* try_h2d(site, dst, src, on_drop) -> MISS / STAGED / BARRIER */
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "try_h2d(site, dst, src, on_drop)");
        return NULL;
    }
    int code = h2d_fast(s, args[0], args[1], args[2], args[3], 0);
    return code < 0 ? NULL : PyLong_FromLong(code);
}

static PyObject *seg_try_skip(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    /* try_skip(site, dst, src) -> STAGED (a valid unchanged copy: skip it) or MISS */
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "try_skip(site, dst, src)");
        return NULL;
    }
    int code = h2d_fast(s, args[0], args[1], args[2], Py_None, 1);
    return code < 0 ? NULL : PyLong_FromLong(code);
}

static void seg_open(Segment *s) {
    s->open_lo = max64(s->bottom, s->cursor);
    s->seg = align_up(s->open_lo, 256);
    s->data0 = align_up(s->seg + HEADER_BYTES + s->reserve * DESC_BYTES, ALIGN);
    s->cursor = s->data0;
}

/* the index of the last entry staged over exactly [lo, hi), or -1 */
static Py_ssize_t find_exact(Segment *s, addr_t lo, addr_t hi) {
    for (Py_ssize_t i = PyList_GET_SIZE(s->entries) - 1; i >= 0; i--) {
        Entry *e = (Entry *)PyList_GET_ITEM(s->entries, i);
        if (e->lo == lo && e->hi == hi) return i;
    }
    return -1;
}

static int count_merged(Segment *s, PyObject *site, Py_ssize_t n);

static PyObject *seg_stage(Segment *s, PyObject *args) {
    /* stage(site, on_drop, lo, hi, geom, nbytes, descs, h2d=False) */
    PyObject *site, *on_drop, *geom, *descs;
    unsigned long long lo, hi;
    long long nbytes;
    int h2d = 0;
    if (!PyArg_ParseTuple(args, "OOKKOLO|p", &site, &on_drop, &lo, &hi, &geom, &nbytes, &descs,
                          &h2d))
        return NULL;
    if (s->seg < 0) seg_open(s);
    int is_list = PyList_Check(descs);
    Py_ssize_t n = is_list ? PyList_GET_SIZE(descs) : 1;
    int64_t off = align_up(s->cursor, ALIGN);
    int64_t grow = (int64_t)s->descs.n + n + 1 - s->reserve;
    if (off + nbytes + (grow > 0 ? grow * DESC_BYTES + ALIGN : 0) > s->top)
        return PyLong_FromLong(FULL);
    Desc one;
    if (!is_list) {
        if (parse_desc(descs, &one) < 0) return NULL;
        if (h2d) one.src = (uint64_t)off;
    }
    /* entries are read (an overlap) or one is appended after the raw ones: all objects */
    if (s->nraw && materialize(s) < 0) return NULL;
    Py_ssize_t nentries = PyList_GET_SIZE(s->entries);
    if (nentries &&
        (ranges_overlaps(&s->writes, lo, hi) || ranges_overlaps(&s->reads, lo, hi))) {
        Py_ssize_t i = find_exact(s, lo, hi);
        if (i >= 0 && geom != Py_None && !is_list && !ranges_overlaps(&s->reads, lo, hi)) {
            Entry *e = (Entry *)PyList_GET_ITEM(s->entries, i);
            Py_INCREF(e); /* held: the compare may run Python code */
            int same = PyObject_RichCompareBool(e->geom, geom, Py_EQ);
            Py_ssize_t old = same > 0 && PyLong_CheckExact(e->index) ? PyLong_AsSsize_t(e->index) : -1;
            /* still the entry staged there (the compare changed nothing), its index a
             * descriptor of this segment (an Entry's fields are writable from Python) */
            int ok = same > 0 && old >= 0 && old < s->descs.n && i < PyList_GET_SIZE(s->entries) &&
                     PyList_GET_ITEM(s->entries, i) == (PyObject *)e;
            Py_DECREF(e); /* the list holds it when ok */
            if (same < 0 || (old == -1 && PyErr_Occurred())) return NULL;
            if (ok) {
                if (s->descs.v[old].kind != KIND_D2D) {
                    /* the same destination again: the later copy replaces the staged one */
                    s->descs.v[old] = one;
                    if (on_drop != Py_None) {
                        if (e->on_drop == Py_None) {
                            PyObject *l = PyList_New(0);
                            if (!l) return NULL;
                            Py_SETREF(e->on_drop, l);
                        } else {
                            PyObject *l = PySequence_List(e->on_drop);
                            if (!l) return NULL;
                            Py_SETREF(e->on_drop, l);
                        }
                        if (PyList_Append(e->on_drop, on_drop) < 0) return NULL;
                    }
                    if (count_merged(s, e->site, 1) < 0) return NULL; /* the superseded copy */
                    Py_SETREF(e->site, Py_NewRef(site));
                    if (nbytes) s->cursor = off + nbytes;
                    return Py_BuildValue("(OL)", (PyObject *)e, (long long)off);
                }
            }
        }
        return PyLong_FromLong(ORDER);
    }
    Py_ssize_t first = s->descs.n;
    PyObject *index;
    if (is_list) {
        if (descs_reserve(&s->descs, first + n) < 0) return NULL;
        for (Py_ssize_t k = 0; k < n; k++) {
            Desc d;
            if (parse_desc(PyList_GET_ITEM(descs, k), &d) < 0) return NULL;
            s->descs.v[first + k] = d;
        }
        index = PyList_New(n);
        if (!index) return NULL;
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *v = PyLong_FromSsize_t(first + k);
            if (!v) { Py_DECREF(index); return NULL; }
            PyList_SET_ITEM(index, k, v);
        }
    } else {
        if (descs_reserve(&s->descs, first + 1) < 0) return NULL;
        s->descs.v[first] = one;
        index = PyLong_FromSsize_t(first);
        if (!index) return NULL;
    }
    if (ranges_add(&s->writes, lo, hi) < 0) { Py_DECREF(index); return NULL; }
    Entry *e = entry_new(site, on_drop, lo, hi, index);
    if (!e) return NULL;
    Py_SETREF(e->geom, Py_NewRef(geom));
    if (PyList_Append(s->entries, (PyObject *)e) < 0) { Py_DECREF(e); return NULL; }
    s->descs.n = first + n;
    if (hi - lo > BLOCK_BYTES) s->wide = 1;
    if (nbytes) s->cursor = off + nbytes;
    PyObject *out = Py_BuildValue("(OL)", (PyObject *)e, (long long)off);
    Py_DECREF(e);
    return out;
}

static PyObject *seg_add_read(Segment *s, PyObject *args) {
    unsigned long long lo, hi;
    if (!PyArg_ParseTuple(args, "KK", &lo, &hi)) return NULL;
    if (ranges_add(&s->reads, lo, hi) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *seg_overlaps(Segment *s, PyObject *args) {
    unsigned long long lo, hi;
    int reads = 1;
    if (!PyArg_ParseTuple(args, "KK|p", &lo, &hi, &reads)) return NULL;
    if (!nstaged(s)) Py_RETURN_FALSE;
    return PyBool_FromLong(ranges_overlaps(&s->writes, lo, hi) ||
                           (reads && ranges_overlaps(&s->reads, lo, hi)));
}

static PyObject *seg_desc(Segment *s, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= s->descs.n) {
        PyErr_SetString(PyExc_IndexError, "descriptor index out of range");
        return NULL;
    }
    return desc_tuple(&s->descs.v[i]);
}

/* -- split and encode (pack.split, pack.encode) -------------------------------- */

static int64_t desc_blocks(const Desc *d) {
    int64_t per_row = (d->width + 15) >> 4;
    int64_t windows = d->rows == 1 ? per_row : d->rows * (per_row + 1);
    int64_t b = (windows + WINDOWS_PER_BLOCK - 1) / WINDOWS_PER_BLOCK;
    return b ? b : 1;
}

/* append in[from, to) to out whole (descriptors split leaves as they are) */
static int descs_extend(DescVec *out, const Desc *in, Py_ssize_t from, Py_ssize_t to) {
    if (to <= from) return 0;
    if (descs_reserve(out, out->n + (to - from)) < 0) return -1;
    memcpy(out->v + out->n, in + from, (size_t)(to - from) * sizeof(Desc));
    out->n += to - from;
    return 0;
}

/* pack.split: out receives the cut descriptors; returns 1 when anything was cut */
static int split(const Desc *in, Py_ssize_t n, DescVec *out) {
    int cut = 0;
    out->n = 0;
    Py_ssize_t run = 0; /* in[run, i): whole, not yet appended */
    for (Py_ssize_t i = 0; i < n; i++) {
        Desc d = in[i];
        int64_t per_row = (d.width + 15) >> 4;
        int64_t windows = d.rows == 1 ? per_row : d.rows * (per_row + 1);
        if (windows <= WINDOWS_PER_BLOCK || d.width == 0 || d.rows == 0) continue;
        cut = 1;
        int fill = d.kind == KIND_FILL;
        if (fill && d.elem != 1 && d.elem != 2 && d.elem != 4 && d.elem != 8) continue;
        if (descs_extend(out, in, run, i) < 0) return -1;
        run = i + 1;
        int64_t width = d.width, rows = d.rows;
        if (rows > 1 && d.dpitch == width && (fill || d.spitch == width) &&
            !(fill && width % d.elem)) {
            width = width * rows;
            rows = 1;
        }
        int64_t per = 1, run_rows = rows;
        int by_rows = 0;
        if (rows > 1) {
            per = WINDOWS_PER_BLOCK / (per_row + 1);
            if (per < 1) per = 1;
            by_rows = 1;
        }
        int whole_cols = rows > 1 && per_row + 1 <= WINDOWS_PER_BLOCK;
        if (!whole_cols && rows > 1) { per = 1; }
        int64_t sk = fill ? 0 : 1;
        (void)run_rows;
        for (int64_t r = 0; r < rows; r += (by_rows ? per : rows)) {
            int64_t nr = by_rows ? (per < rows - r ? per : rows - r) : 1;
            int64_t c = 0;
            do {
                int64_t w = whole_cols ? width : (BLOCK_BYTES < width - c ? BLOCK_BYTES : width - c);
                Desc p;
                p.dst = d.dst + r * d.dpitch + c;
                p.src = d.src + (r * d.spitch + c) * sk;
                p.value = d.value;
                if (nr == 1) { p.dpitch = w; p.spitch = w * sk; }
                else { p.dpitch = d.dpitch; p.spitch = d.spitch; }
                p.width = w;
                p.rows = nr;
                p.kind = (nr > 1 || d.kind != KIND_H2D_2D) ? d.kind : KIND_H2D;
                p.elem = d.elem;
                if (descs_push(out, &p) < 0) return -1;
                c += w;
            } while (!whole_cols && c < width);
        }
    }
    if (descs_extend(out, in, run, n) < 0) return -1;
    return cut;
}

static void put32(char *p, int64_t v) { uint32_t x = (uint32_t)v; memcpy(p, &x, 4); }
static void put16(char *p, int64_t v) { uint16_t x = (uint16_t)v; memcpy(p, &x, 2); }
static void put64(char *p, uint64_t v) { memcpy(p, &v, 8); }

static int check_u32(int64_t v, const char *what) {
    if (v < 0 || v > 0xFFFFFFFFLL) {
        PyErr_Format(PyExc_OverflowError,
                     "descriptor field %s=%lld does not fit the wire format's 32 bits", what,
                     (long long)v);
        return -1;
    }
    return 0;
}

/* pack.encode into out; returns the block count, or -1 with an error set */
static int64_t encode(char *out, const Desc *descs, Py_ssize_t n, int64_t data_offset,
                      int64_t total, int64_t src_shift) {
    int64_t block = 0;
    char *p = out + HEADER_BYTES;
    for (Py_ssize_t i = 0; i < n; i++, p += DESC_BYTES) {
        const Desc *d = &descs[i];
        uint64_t src = d->src;
        if (d->kind <= KIND_H2D_2D) src += (uint64_t)src_shift;
        if (check_u32(d->dpitch, "dst_pitch") || check_u32(d->spitch, "src_pitch") ||
            check_u32(d->width, "width") || check_u32(d->rows, "rows") ||
            check_u32(block, "block_start"))
            return -1;
        if (d->kind < 0 || d->kind > 0xFFFF || d->elem < 0 || d->elem > 0xFFFF) {
            PyErr_SetString(PyExc_OverflowError, "descriptor kind/elem out of range");
            return -1;
        }
        put64(p, d->dst);
        put64(p + 8, src);
        put64(p + 16, d->value);
        put32(p + 24, d->dpitch);
        put32(p + 28, d->spitch);
        put32(p + 32, d->width);
        put32(p + 36, d->rows);
        put16(p + 40, d->kind);
        put16(p + 42, d->elem);
        put32(p + 44, block);
        block += desc_blocks(d);
    }
    if (check_u32(n, "ndesc") || check_u32(block, "nblocks") ||
        check_u32(data_offset, "data_offset"))
        return -1;
    put32(out, MAGIC);
    put16(out + 4, VERSION);
    put16(out + 6, HEADER_BYTES);
    put32(out + 8, n);
    put32(out + 12, block);
    put32(out + 16, HEADER_BYTES);
    put32(out + 20, data_offset);
    put64(out + 24, (uint64_t)total);
    return block;
}

/* cut the open segment for launch: split descriptors that span blocks, close the gap
 * between the table and the data when the segment may be carried (its size at most
 * inline_max), encode header and table. Out: the segment's offset and end in the
 * slot, its blocks and descriptors. */
static int cut_impl(Segment *s, long long inline_max, int64_t *seg_out, int64_t *end_out,
                    int64_t *nblocks_out, Py_ssize_t *n_out) {
    if (!s->bound) {
        PyErr_SetString(PyExc_AssertionError, "internal: cut() with no slot");
        return -1;
    }
    stage_fence(s);
    char *base = s->view.buf;
    int64_t seg = s->seg, data0 = s->data0, end = align_up(s->cursor, ALIGN), shift = 0;
    int64_t top = s->top;
    DescVec pieces = s->scratch, *cur = &s->descs; /* (its buffer reused, no malloc) */
    pieces.n = 0;
    const Desc *descs = s->descs.v;
    Py_ssize_t n = s->descs.n;
    int64_t nblocks;
    if (s->wide) {
        int r = split(descs, n, &pieces);
        if (r < 0) goto fail;
        int64_t grow = align_up(seg + HEADER_BYTES + pieces.n * DESC_BYTES, ALIGN);
        if (end + max64(0, grow - data0) <= top) { descs = pieces.v; n = pieces.n; cur = &pieces; }
    }
    for (;;) {
        int64_t need0 = align_up(seg + HEADER_BYTES + (int64_t)n * DESC_BYTES, ALIGN);
        int64_t move = need0 - data0;
        if (move < 0 && !(end - seg + move <= inline_max)) move = 0;
        if (move) {
            memmove(base + need0, base + data0, (size_t)(end - data0));
            end += move;
            shift += move;
            data0 = need0;
        }
        nblocks = encode(base + seg, descs, n, data0 - seg, end - seg, shift - seg);
        if (nblocks < 0) goto fail;
        if (nblocks == n) break;
        DescVec more = {0};
        int r = split(descs, n, &more);
        if (r < 0) { PyMem_Free(more.v); goto fail; }
        int64_t grow = align_up(seg + HEADER_BYTES + more.n * DESC_BYTES, ALIGN);
        if (more.n == n || end + max64(0, grow - data0) > top) { PyMem_Free(more.v); break; }
        PyMem_Free(pieces.v);
        pieces = more;
        descs = pieces.v;
        n = pieces.n;
        cur = &pieces;
    }
    (void)cur;
    s->scratch = pieces;
    if (n > s->reserve) s->reserve = n;
    if (n > s->peak) s->peak = n;
    s->cursor = end;
    *seg_out = seg;
    *end_out = end;
    *nblocks_out = nblocks;
    *n_out = n;
    return 0;
fail:
    s->scratch = pieces;
    s->cursor = end;
    return -1;
}

static PyObject *seg_cut(Segment *s, PyObject *arg) {
    long long inline_max = PyLong_AsLongLong(arg);
    if (inline_max == -1 && PyErr_Occurred()) return NULL;
    int64_t seg, end, nblocks;
    Py_ssize_t n;
    if (cut_impl(s, inline_max, &seg, &end, &nblocks, &n) < 0) return NULL;
    return Py_BuildValue("(LLLn)", (long long)seg, (long long)end, (long long)nblocks, n);
}

/* flush_carried(launcher, stream, inline_max, device_base) -> int or tuple: cut(inline_max),
 * then, when the segment is at most inline_max bytes, launch it carried through the
 * launcher (device_base: the slot's device address). Returns the bytes carried when
 * the launch went through; otherwise (too large, or the launcher launched nothing or
 * failed) cut()'s (seg, end, nblocks, n), for the caller's own path to land. One call
 * at flush instead of cut() and the backend's launch through Python. */
/* the pack.CARRY_PREFIX bytes a carried launch puts before the segment's bytes */
#define CARRY_PREFIX 16

/* Launch the open segment's first nbytes carried (it starts at s->seg, device address
 * dev). When the CARRY_PREFIX bytes before it are free (the slot's headroom before its
 * offset 0, or the gap seg_open left below the segment) and nothing reads them (every
 * segment and snapshot lies elsewhere), the launcher writes the launch's prefix there
 * and hands the driver the slot's own bytes: no copy of the segment first. */
static int launch_carried(Segment *s, CarriedLauncher *L, int64_t nblocks,
                          unsigned long long stream, unsigned long long dev, int64_t nbytes) {
    int64_t off = s->seg;
    char *host = (char *)s->view.buf + off;
    if (L->abi == LAUNCHER_ABI && L->carried_at && s->view.len > off &&
        ((off == 0 && s->headroom >= CARRY_PREFIX) || off - s->open_lo >= CARRY_PREFIX))
        return L->carried_at(L->drv, (unsigned long long)nblocks, stream, dev, host,
                             (size_t)nbytes, (size_t)(s->view.len - off));
    return L->carried(L->drv, (unsigned long long)nblocks, stream, dev, host, (size_t)nbytes);
}

static PyObject *seg_flush_carried(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "flush_carried(launcher, stream, inline_max, device_base)");
        return NULL;
    }
    CarriedLauncher *L = PyCapsule_GetPointer(args[0], LAUNCHER_NAME);
    if (!L) return NULL;
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    long long inline_max = PyLong_AsLongLong(args[2]);
    if (inline_max == -1 && PyErr_Occurred()) return NULL;
    unsigned long long dev = PyLong_AsUnsignedLongLong(args[3]);
    if (dev == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int64_t seg, end, nblocks;
    Py_ssize_t n;
    if (cut_impl(s, inline_max, &seg, &end, &nblocks, &n) < 0) return NULL;
    int64_t total = end - seg;
    if (total <= inline_max &&
        launch_carried(s, L, nblocks, stream, dev + (unsigned long long)seg, total) == 0)
        return PyLong_FromLongLong(total);
    return Py_BuildValue("(LLLn)", (long long)seg, (long long)end, (long long)nblocks, n);
}

/* -- per-site merged counters: folded into sites[site].merged ------------------ */

static Py_ssize_t count_slot(PyObject **keys, Py_ssize_t cap, PyObject *site) {
    size_t h = ((size_t)(uintptr_t)site >> 4) * 0x9E3779B97F4A7C15ull;
    Py_ssize_t i = (Py_ssize_t)(h & (size_t)(cap - 1));
    while (keys[i] && keys[i] != site) i = (i + 1) & (cap - 1);
    return i;
}

/* the count table's slot of site, inserted (with a count of 0) when new; -1 on error */
static Py_ssize_t count_index(Segment *s, PyObject *site) {
    if (2 * (s->cused + 1) > s->ccap) { /* grow: at most half full */
        Py_ssize_t cap = s->ccap ? 2 * s->ccap : 64;
        PyObject **keys = PyMem_Calloc((size_t)cap, sizeof(PyObject *));
        Py_ssize_t *vals = PyMem_Calloc((size_t)cap, sizeof(Py_ssize_t));
        unsigned char *flags = PyMem_Calloc((size_t)cap, 1);
        if (!keys || !vals || !flags) {
            PyMem_Free(keys); PyMem_Free(vals); PyMem_Free(flags);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < s->ccap; i++) {
            if (!s->ckeys[i]) continue;
            Py_ssize_t j = count_slot(keys, cap, s->ckeys[i]);
            keys[j] = s->ckeys[i];
            vals[j] = s->cvals[i];
            flags[j] = s->cflags[i];
        }
        PyMem_Free(s->ckeys);
        PyMem_Free(s->cvals);
        PyMem_Free(s->cflags);
        s->ckeys = keys;
        s->cvals = vals;
        s->cflags = flags;
        s->ccap = cap;
    }
    Py_ssize_t i = count_slot(s->ckeys, s->ccap, site);
    if (!s->ckeys[i]) {
        s->ckeys[i] = Py_NewRef(site);
        s->cflags[i] = 0;
        s->cused++;
    }
    return i;
}

/* count n more copies of site as merged (folded into stats by fold()) */
static int count_merged(Segment *s, PyObject *site, Py_ssize_t n) {
    Py_ssize_t i = count_index(s, site);
    if (i < 0) return -1;
    s->cvals[i] += n;
    return 0;
}

/* whether the plan merges site and makes it a barrier (SITE_MERGE, SITE_BARRIER bits),
 * asked of the plan's frozen sets once per site and kept in the count table (two set
 * lookups a copy otherwise); -1 on error */
static int site_flags(Segment *s, PyObject *site) {
    if (!PyFrozenSet_CheckExact(s->merge) || !PyFrozenSet_CheckExact(s->barriers)) {
        int m = contains(s->merge, site);
        int b = m == 1 ? contains(s->barriers, site) : 0;
        if (m < 0 || b < 0) return -1;
        return (m ? SITE_MERGE : 0) | (b ? SITE_BARRIER : 0);
    }
    if (s->ccap) {
        Py_ssize_t i = count_slot(s->ckeys, s->ccap, site);
        if (s->ckeys[i] == site && (s->cflags[i] & SITE_KNOWN)) return s->cflags[i] & ~SITE_KNOWN;
    }
    int m = contains(s->merge, site);
    int b = m == 1 ? contains(s->barriers, site) : 0;
    if (m < 0 || b < 0) return -1;
    int f = (m ? SITE_MERGE : 0) | (b ? SITE_BARRIER : 0);
    Py_ssize_t i = count_index(s, site);
    if (i < 0) return -1;
    s->cflags[i] = (unsigned char)(f | SITE_KNOWN);
    return f;
}

static PyObject *seg_fold(Segment *s, PyObject *unused) {
    /* {site: merged copies counted since the last fold}; the counts restart at 0 */
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < s->ccap; i++) {
        if (!s->ckeys[i] || !s->cvals[i]) continue;
        PyObject *v = PyLong_FromSsize_t(s->cvals[i]);
        if (!v || PyDict_SetItem(out, s->ckeys[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
        s->cvals[i] = 0;
    }
    return out;
}

static void seg_reset_state(Segment *s) {
    s->listed = 0;
    s->wide = 0;
    s->descs.n = 0;
    s->writes.n = 0;
    s->reads.n = 0;
    s->seg = -1;
}

/* the site of staged entry i: the list's n entries, then the raw ones */
static inline PyObject *staged_site(Segment *s, PyObject *list, Py_ssize_t n, Py_ssize_t i) {
    return i < n ? ((Entry *)PyList_GET_ITEM(list, i))->site : s->raw[i - n].site;
}

static PyObject *seg_finish(Segment *s, PyObject *unused) {
    s->bottom = s->cursor;
    if (s->slot) {
        PyObject *v = PyLong_FromLongLong(s->bottom);
        if (!v || PyObject_SetAttr(s->slot, s_bottom, v) < 0) { Py_XDECREF(v); return NULL; }
        Py_DECREF(v);
    }
    PyObject *entries = s->entries;
    Py_ssize_t n = PyList_GET_SIZE(entries);
    PyObject *fresh = s->spare ? s->spare : PyList_New(0);
    if (!fresh) return NULL;
    s->spare = NULL;
    s->entries = fresh;
    seg_reset_state(s);
    /* count runs of one site at a time (a step's sites repeat in order): the list's
     * entries, then the raw ones */
    int err = 0;
    for (Py_ssize_t i = 0, all = n + s->nraw; i < all && !err;) {
        PyObject *site = staged_site(s, entries, n, i);
        Py_ssize_t j = i + 1;
        while (j < all && staged_site(s, entries, n, j) == site) j++;
        err = count_merged(s, site, j - i) < 0;
        i = j;
    }
    raw_drop(s);
    if (Py_REFCNT(entries) == 1 && PyList_CheckExact(entries)) {
        /* the list is ours alone: recycle what only it holds, and keep the list, emptied
         * with its capacity, for the next segment (no regrowing it copy by copy) */
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *x = PyList_GET_ITEM(entries, i);
            PyList_SET_ITEM(entries, i, NULL);
            if (Py_REFCNT(x) == 1 && Py_IS_TYPE(x, &EntryType)) entry_recycle((Entry *)x);
            else Py_DECREF(x);
        }
        Py_SET_SIZE(entries, 0);
        s->spare = entries;
    } else {
        Py_DECREF(entries);
    }
    if (err) return NULL;
    Py_RETURN_NONE;
}

static PyObject *seg_reset(Segment *s, PyObject *unused) {
    if (s->nraw && materialize(s) < 0) return NULL;
    PyObject *entries = s->entries;
    PyObject *fresh = PyList_New(0);
    if (!fresh) return NULL;
    s->entries = fresh;
    seg_reset_state(s);
    return entries;
}

static PyObject *seg_get_staged(Segment *s, void *c) {
    return PyLong_FromSsize_t(nstaged(s));
}

static PyObject *seg_get_entries(Segment *s, void *c) {
    /* the caller may keep the list while the segment stays open: from here on until the
     * segment lands, fast copies append to it too (as the Python twin's list) */
    if (s->nraw && materialize(s) < 0) return NULL;
    s->listed = 1;
    return Py_NewRef(s->entries);
}
static PyObject *seg_get_slot(Segment *s, void *c) { return Py_NewRef(s->slot ? s->slot : Py_None); }
static PyObject *seg_get_seg(Segment *s, void *c) { return PyLong_FromLongLong(s->seg); }
static PyObject *seg_get_cursor(Segment *s, void *c) { return PyLong_FromLongLong(s->cursor); }
static PyObject *seg_get_reserve(Segment *s, void *c) { return PyLong_FromLongLong(s->reserve); }
static int seg_set_reserve(Segment *s, PyObject *v, void *c) {
    long long n = v ? PyLong_AsLongLong(v) : -1;
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n < 1 || s->seg >= 0) {
        PyErr_SetString(PyExc_ValueError, "reserve: an int >= 1, set while no segment is open");
        return -1;
    }
    s->reserve = n;
    return 0;
}
static PyObject *seg_get_peak(Segment *s, void *c) { return PyLong_FromLongLong(s->peak); }
static int seg_set_peak(Segment *s, PyObject *v, void *c) {
    long long n = v ? PyLong_AsLongLong(v) : -1;
    if (n == -1 && PyErr_Occurred()) return -1;
    s->peak = n;
    return 0;
}

static PyObject *seg_get_nt_from(Segment *s, void *c) { return PyLong_FromLongLong(s->nt_from); }
static int seg_set_nt_from(Segment *s, PyObject *v, void *c) {
    long long n = v ? PyLong_AsLongLong(v) : -1;
    if (n == -1 && PyErr_Occurred()) return -1;
    s->nt_from = n < 0 ? -1 : n;
    return 0;
}

static PyObject *seg_get_fast(Segment *s, void *c) { return PyBool_FromLong(s->fast); }
static PyObject *seg_get_front_misses(Segment *s, void *c) {
    return PyLong_FromLongLong(s->dfront.misses + s->sfront.misses);
}
static int seg_set_fast(Segment *s, PyObject *v, void *c) {
    int b = PyObject_IsTrue(v);
    if (b < 0) return -1;
    s->fast = b;
    s->owner = thread_id(); /* set by the thread that opens the step */
    return 0;
}

static PyGetSetDef seg_getset[] = {
    {"staged", (getter)seg_get_staged, NULL, "Copies staged in the open segment.", NULL},
    {"entries", (getter)seg_get_entries, NULL, "The open segment's entries.", NULL},
    {"slot", (getter)seg_get_slot, NULL, "The slot staged into (None: unbound).", NULL},
    {"seg", (getter)seg_get_seg, NULL, "The open segment's slot offset (-1: none).", NULL},
    {"cursor", (getter)seg_get_cursor, NULL, "Next free data byte of the slot.", NULL},
    {"reserve", (getter)seg_get_reserve, (setter)seg_set_reserve,
     "Descriptors reserved per segment (set while no segment is open).", NULL},
    {"peak", (getter)seg_get_peak, (setter)seg_set_peak,
     "The largest descriptor table cut since it was last set.", NULL},
    {"nt_from", (getter)seg_get_nt_from, (setter)seg_set_nt_from,
     "Data staged this many bytes or more into a segment bypasses the host's caches "
     "(streaming stores, for bytes the GPU reads); -1: never.", NULL},
    {"fast", (getter)seg_get_fast, (setter)seg_set_fast,
     "The fast path may be taken (by the thread that set it).", NULL},
    {"front_misses", (getter)seg_get_front_misses, NULL,
     "Cache lookups the front tables missed (went on to the dicts), all time.", NULL},
    {NULL},
};

static PyMethodDef seg_methods[] = {
    {"bind", (PyCFunction)seg_bind, METH_O, "Start staging into a slot."},
    {"set_capture_query", (PyCFunction)(void (*)(void))seg_set_capture_query, METH_FASTCALL,
     "set_capture_query(fn, arg): asked as fn(arg) before a fast copy opens a segment."},
    {"flush_carried", (PyCFunction)(void (*)(void))seg_flush_carried, METH_FASTCALL,
     "cut(), then launch the segment carried through a launcher capsule when it fits."},
    {"unbind", (PyCFunction)seg_unbind, METH_NOARGS, "Forget the slot."},
    {"set_cursor", (PyCFunction)seg_set_cursor, METH_O, "Move the segment cursor."},
    {"room", (PyCFunction)seg_room, METH_O, "Whether an eager snapshot fits."},
    {"take_top", (PyCFunction)seg_take_top, METH_O, "Space for an eager snapshot, or -1."},
    {"remember", (PyCFunction)(void (*)(void))seg_remember, METH_FASTCALL,
     "Cache a merged destination's geometry by identity."},
    {"remember_src", (PyCFunction)(void (*)(void))seg_remember_src, METH_FASTCALL,
     "Cache a host source's address by identity."},
    {"forget", (PyCFunction)seg_forget, METH_NOARGS, "Clear the caches."},
    {"try_h2d", (PyCFunction)(void (*)(void))seg_try_h2d, METH_FASTCALL,
     "Stage an H2D copy on the fast path, or say MISS."},
    {"try_fill", (PyCFunction)(void (*)(void))seg_try_fill, METH_FASTCALL,
     "Stage a fill_tail on the fast path, or say MISS."},
    {"try_skip", (PyCFunction)(void (*)(void))seg_try_skip, METH_FASTCALL,
     "Whether an unchanged H2D copy passes the fast path's checks (then it is skipped)."},
    {"append_h2d", (PyCFunction)(void (*)(void))seg_append_h2d, METH_FASTCALL,
     "Stage host bytes into the open segment."},
    {"stage", (PyCFunction)seg_stage, METH_VARARGS, "Reserve data and place descriptors."},
    {"add_read", (PyCFunction)seg_add_read, METH_VARARGS, "Record a D2D source range."},
    {"overlaps", (PyCFunction)seg_overlaps, METH_VARARGS, "Overlap with staged ranges."},
    {"desc", (PyCFunction)seg_desc, METH_O, "Descriptor i as a tuple."},
    {"cut", (PyCFunction)seg_cut, METH_O, "Encode the open segment into the slot."},
    {"finish", (PyCFunction)seg_finish, METH_NOARGS, "Count and close a launched segment."},
    {"fold", (PyCFunction)seg_fold, METH_NOARGS,
     "Merged copies per site since the last fold (the counts restart)."},
    {"reset", (PyCFunction)seg_reset, METH_NOARGS, "Close without landing; returns entries."},
    {NULL},
};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment.Segment",
    .tp_basicsize = sizeof(Segment),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The open segment of one copier (compiled twin of cucopy.segment.PySegment).",
    .tp_traverse = (traverseproc)seg_traverse,
    .tp_clear = (inquiry)seg_clear,
    .tp_dealloc = (destructor)seg_dealloc,
    .tp_methods = seg_methods,
    .tp_getset = seg_getset,
    .tp_init = (initproc)seg_init,
    .tp_new = PyType_GenericNew,
};

/* -- FastCopy: DeviceCopier.copy's fast path, with no Python frame ------------------
 *
 * A method descriptor (Py_TPFLAGS_METHOD_DESCRIPTOR: `copier.copy(...)` calls it
 * with the copier first, no bound method made). It stages an H2D copy through the
 * copier's compiled segment (the same h2d_fast as try_h2d) and otherwise calls the
 * copier's own Python functions, given at construction: `full` (the whole copy(),
 * for anything but the plain case) and `rest` (the general path after a miss).
 * A barrier site's copy calls the copier's `_after_barrier(site)`. */

typedef struct {
    PyObject_HEAD
    PyObject *full, *rest;
    vectorcallfunc vectorcall;
} FastCopy;

static PyObject *s_seg, *s_after_barrier, *s_unchanged, *s_on_drop;
static PyObject *core_seg(PyObject *self); /* a CopierCore's segment (borrowed), or NULL */

static PyObject *fastcopy_call(FastCopy *f, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *on_drop = Py_None;
    if (nargs != 4) goto full;
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i), *v = args[nargs + i];
            if (k == s_on_drop) on_drop = v;
            else if (k == s_unchanged && v == Py_False) continue;
            else goto full; /* unchanged=True, or anything unusual */
        }
    }
    PyObject *self = args[0];
    PyObject *seg = core_seg(self); /* the member itself, no attribute lookup */
    if (seg) Py_INCREF(seg);
    else seg = PyObject_GetAttr(self, s_seg);
    if (!seg) return NULL;
    if (Py_TYPE(seg) != &SegmentType) { Py_DECREF(seg); goto full; }
    int code = h2d_fast((Segment *)seg, args[1], args[2], args[3], on_drop, 0);
    Py_DECREF(seg);
    if (code < 0) return NULL;
    if (code == STAGED) Py_RETURN_TRUE;
    if (code == BARRIER) {
        PyObject *x = PyObject_CallMethodOneArg(self, s_after_barrier, args[1]);
        if (!x) return NULL;
        Py_DECREF(x);
        Py_RETURN_TRUE;
    }
    {
        PyObject *v[6] = {self, args[1], args[2], args[3], Py_False, on_drop};
        return PyObject_Vectorcall(f->rest, v, 6, NULL);
    }
full:
    return PyObject_Vectorcall(f->full, args, nargsf, kwnames);
}

static PyObject *fastcopy_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    PyObject *full, *rest;
    if (!PyArg_ParseTuple(args, "OO:FastCopy", &full, &rest)) return NULL;
    FastCopy *f = (FastCopy *)tp->tp_alloc(tp, 0);
    if (!f) return NULL;
    f->full = Py_NewRef(full);
    f->rest = Py_NewRef(rest);
    f->vectorcall = (vectorcallfunc)fastcopy_call;
    return (PyObject *)f;
}

static int fastcopy_traverse(FastCopy *f, visitproc visit, void *arg) {
    Py_VISIT(f->full); Py_VISIT(f->rest);
    return 0;
}

static int fastcopy_clear(FastCopy *f) {
    Py_CLEAR(f->full); Py_CLEAR(f->rest);
    return 0;
}

static PyObject *fastcopy_get(PyObject *f, PyObject *obj, PyObject *type) {
    if (!obj || obj == Py_None) return Py_NewRef(f);
    return PyMethod_New(f, obj);
}

/* A compiled wrapper's attributes: __doc__, __name__, __wrapped__ (for
 * inspect.signature) ... from the Python function it wraps (full) */
static PyObject *wrapper_getattro(PyObject *self, PyObject *full, PyObject *name) {
    if (PyUnicode_CompareWithASCIIString(name, "__doc__") == 0) return PyObject_GetAttr(full, name);
    PyObject *r = PyObject_GenericGetAttr(self, name);
    if (r || !PyErr_ExceptionMatches(PyExc_AttributeError)) return r;
    PyErr_Clear();
    if (PyUnicode_CompareWithASCIIString(name, "__wrapped__") == 0) return Py_NewRef(full);
    return PyObject_GetAttr(full, name);
}

static PyObject *fastcopy_getattro(FastCopy *f, PyObject *name) {
    return wrapper_getattro((PyObject *)f, f->full, name);
}

static PyTypeObject FastCopyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment.FastCopy",
    .tp_basicsize = sizeof(FastCopy),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "DeviceCopier.copy with its fast path compiled (see the Python copy()).",
    .tp_vectorcall_offset = offsetof(FastCopy, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = fastcopy_get,
    .tp_getattro = (getattrofunc)fastcopy_getattro,
    .tp_traverse = (traverseproc)fastcopy_traverse,
    .tp_clear = (inquiry)fastcopy_clear,
    .tp_dealloc = cleared_dealloc,
    .tp_new = fastcopy_new,
};

/* -- FastRoute: cucopy.copy with no Python frame when a copier is active ------------
 * Reads the active-copier context variable; when the copier's copy is a FastCopy,
 * calls it with the copier first; otherwise (no active copier: a plain copy) the
 * Python function given at construction. */

typedef struct {
    PyObject_HEAD
    PyObject *var, *fallback;
    vectorcallfunc vectorcall;
} FastRoute;

static PyObject *s_copy;

static PyObject *fastroute_call(FastRoute *f, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *c = NULL;
    if (total < 8 && PyContextVar_Get(f->var, NULL, &c) == 0 && c && c != Py_None) {
        PyObject *m = _PyType_Lookup(Py_TYPE(c), s_copy); /* borrowed */
        if (m && Py_TYPE(m) == &FastCopyType) {
            PyObject *v[8];
            v[0] = c;
            memcpy(v + 1, args, (size_t)total * sizeof(PyObject *));
            Py_INCREF(m); /* held: the copy runs Python code that may rebind copy */
            PyObject *r = fastcopy_call((FastCopy *)m, v, (size_t)(nargs + 1), kwnames);
            Py_DECREF(m);
            Py_DECREF(c);
            return r;
        }
    }
    if (PyErr_Occurred()) { Py_XDECREF(c); return NULL; }
    Py_XDECREF(c);
    return PyObject_Vectorcall(f->fallback, args, nargsf, kwnames);
}

static PyObject *fastroute_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    PyObject *var, *fallback;
    if (!PyArg_ParseTuple(args, "OO:FastRoute", &var, &fallback)) return NULL;
    if (!PyContextVar_CheckExact(var)) {
        PyErr_SetString(PyExc_TypeError, "FastRoute: expected a ContextVar");
        return NULL;
    }
    FastRoute *f = (FastRoute *)tp->tp_alloc(tp, 0);
    if (!f) return NULL;
    f->var = Py_NewRef(var);
    f->fallback = Py_NewRef(fallback);
    f->vectorcall = (vectorcallfunc)fastroute_call;
    return (PyObject *)f;
}

static int fastroute_traverse(FastRoute *f, visitproc visit, void *arg) {
    Py_VISIT(f->var); Py_VISIT(f->fallback);
    return 0;
}

static int fastroute_clear(FastRoute *f) {
    Py_CLEAR(f->var); Py_CLEAR(f->fallback);
    return 0;
}

static PyObject *fastroute_getattro(FastRoute *f, PyObject *name) {
    if (PyUnicode_CompareWithASCIIString(name, "__doc__") == 0)
        return PyObject_GetAttr(f->fallback, name);
    PyObject *r = PyObject_GenericGetAttr((PyObject *)f, name);
    if (r || !PyErr_ExceptionMatches(PyExc_AttributeError)) return r;
    PyErr_Clear();
    if (PyUnicode_CompareWithASCIIString(name, "__wrapped__") == 0)
        return Py_NewRef(f->fallback);
    return PyObject_GetAttr(f->fallback, name);
}

static PyTypeObject FastRouteType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment.FastRoute",
    .tp_basicsize = sizeof(FastRoute),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "cucopy.copy with its fast path compiled (see the Python copy()).",
    .tp_vectorcall_offset = offsetof(FastRoute, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = (getattrofunc)fastroute_getattro,
    .tp_traverse = (traverseproc)fastroute_traverse,
    .tp_clear = (inquiry)fastroute_clear,
    .tp_dealloc = cleared_dealloc,
    .tp_new = fastroute_new,
};

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

typedef struct {
    PyObject_HEAD
    PyObject *full, *rest, *var; /* the Python update, _update, the active-copier variable */
    PyObject *prefix;            /* the record key of prefix updates, (None, None) */
    Py_hash_t prefix_hash;
    PyTypeObject *rectype;       /* buffer._Update: its slots read at their offsets */
    Py_ssize_t off_data, off_owned;
    vectorcallfunc vectorcall;
} FastUpdate;

/* a record's slot: at its offset for an exact _Update, else by name (new reference) */
static inline PyObject *rec_slot(FastUpdate *f, PyObject *rec, Py_ssize_t off, PyObject *name) {
    if (Py_TYPE(rec) == f->rectype && off > 0) {
        PyObject *v = *(PyObject **)((char *)rec + off);
        if (v) return Py_NewRef(v);
    }
    return PyObject_GetAttr(rec, name);
}

/* the offset of a T_OBJECT_EX slot of tp (0 when it is not one) */
static Py_ssize_t slot_offset(PyTypeObject *tp, const char *name) {
    PyObject *n = PyUnicode_FromString(name);
    if (!n) return -1;
    PyObject *d = _PyType_Lookup(tp, n); /* borrowed */
    Py_DECREF(n);
    if (!d || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return 0;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    return m->type == T_OBJECT_EX && !(m->flags & READONLY) ? m->offset : 0;
}

static PyObject *s_force, *s_viewkw, *s_key, *s_exact, *s_data, *s_owned, *s_invalidate;
static PyObject *uint8_descr; /* numpy.dtype("uint8") */

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
    if ((PyObject *)Py_TYPE(data) != ndarray_type || d->nd != 1 || d->descr != uint8_descr ||
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
            int at = kw == s_force ? 0 : kw == s_viewkw ? 1 : kw == s_key ? 2 : kw == s_exact ? 3 : -1;
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
    if ((PyObject *)Py_TYPE(host) == ndarray_type) {
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
    PyObject *rec = _PyDict_GetItem_KnownHash(k->updates, f->prefix, f->prefix_hash);
    if (!rec) { if (PyErr_Occurred()) goto fail_sc; goto rest_sc; }
    Py_INCREF(rec);
    if (Py_TYPE(rec) != f->rectype) snap_hold(k); /* its slots read by name: Python */
    PyObject *data = rec_slot(f, rec, f->off_data, s_data);
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
    PyObject *owned = rec_slot(f, rec, f->off_owned, s_owned);
    if (!owned) goto fail_rec;
    Py_DECREF(owned);
    if (owned != Py_True) goto rest_rec;
    snap_hold(k); /* from here on Python code runs */
    PyObject *drop = PyObject_GetAttr(self, s_invalidate);
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
        PyObject *x = PyObject_CallMethodOneArg(k->copier, s_after_barrier, k->fsite);
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
    Py_hash_t h = PyObject_Hash(prefix);
    if (h == -1) return NULL;
    Py_ssize_t off_data = slot_offset(rectype, "data"), off_owned = slot_offset(rectype, "owned");
    if (off_data < 0 || off_owned < 0) return NULL;
    FastUpdate *f = (FastUpdate *)tp->tp_alloc(tp, 0);
    if (!f) return NULL;
    f->full = Py_NewRef(full);
    f->rest = Py_NewRef(rest);
    f->var = Py_NewRef(var);
    f->prefix = Py_NewRef(prefix);
    f->prefix_hash = h;
    f->rectype = (PyTypeObject *)Py_NewRef(rectype);
    f->off_data = off_data;
    f->off_owned = off_owned;
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

/* -- WindowMax: the largest of the last `window` values (twin of ring.PyWindowMax) --
 *
 * The ring sizes its slots, and the copier its table reservation, by the largest
 * value of the last DEMAND_WINDOW steps; each appends one value a step and reads
 * the maximum at once. The Python twin's deque of tuples cost ~0.1 us an append;
 * here the candidates (decreasing values, each with the step it came from) sit in
 * a circular buffer of `window` entries (never more: at most one leaves the window
 * per append, before the new one comes in). Values are 64-bit integers (byte and
 * descriptor counts). */

typedef struct {
    PyObject_HEAD
    Py_ssize_t window;
    Py_ssize_t cap;     /* entries the buffer holds: max(window, 1) */
    Py_ssize_t head, len;
    int64_t n;          /* values appended so far */
    int64_t *idx, *val; /* the candidates, oldest (largest) at head */
} WindowMax;

static PyObject *wm_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    Py_ssize_t window;
    static char *kwlist[] = {"window", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n:WindowMax", kwlist, &window)) return NULL;
    WindowMax *w = (WindowMax *)tp->tp_alloc(tp, 0);
    if (!w) return NULL;
    w->window = window;
    w->cap = window > 1 ? window : 1; /* a window of 1 or less keeps only the newest */
    w->idx = PyMem_Calloc((size_t)w->cap, sizeof(int64_t));
    w->val = PyMem_Calloc((size_t)w->cap, sizeof(int64_t));
    if (!w->idx || !w->val) {
        Py_DECREF(w);
        return PyErr_NoMemory();
    }
    return (PyObject *)w;
}

static void wm_dealloc(WindowMax *w) {
    PyMem_Free(w->idx);
    PyMem_Free(w->val);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

/* the Python twin's append, step for step */
static int wm_push(WindowMax *w, int64_t v) {
    int64_t n = w->n++;
    Py_ssize_t cap = w->cap;
    if (w->len) {
        Py_ssize_t last = (w->head + w->len - 1) % cap;
        while (w->len && w->val[last] <= v) { /* the usual step: the same value again */
            w->len--;
            last = last ? last - 1 : cap - 1;
        }
        if (w->len && w->idx[w->head] <= n - w->window) {
            w->head = (w->head + 1) % cap;
            w->len--;
        }
    }
    Py_ssize_t at = (w->head + w->len) % cap;
    w->idx[at] = n;
    w->val[at] = v;
    w->len++;
    return 0;
}

static int wm_value(PyObject *arg, int64_t *v) {
    long long x = PyLong_AsLongLong(arg);
    if (x == -1 && PyErr_Occurred()) return -1;
    *v = x;
    return 0;
}

static PyObject *wm_append(WindowMax *w, PyObject *arg) {
    int64_t v;
    if (wm_value(arg, &v) < 0) return NULL;
    wm_push(w, v);
    Py_RETURN_NONE;
}

static PyObject *wm_append_max(WindowMax *w, PyObject *arg) {
    int64_t v;
    if (wm_value(arg, &v) < 0) return NULL;
    wm_push(w, v);
    return PyLong_FromLongLong(w->val[w->head]);
}

static PyObject *wm_max(WindowMax *w, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames) {
    PyObject *dflt = NULL;
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nk > 1 || (nk && !PyUnicode_Check(PyTuple_GET_ITEM(kwnames, 0))) ||
        (nk && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "default"))) {
        PyErr_SetString(PyExc_TypeError, "max(default=0)");
        return NULL;
    }
    if (nargs + nk) dflt = args[0];
    if (w->len) return PyLong_FromLongLong(w->val[w->head]);
    return dflt ? Py_NewRef(dflt) : PyLong_FromLong(0);
}

static PyMemberDef wm_members[] = {
    {"window", T_PYSSIZET, offsetof(WindowMax, window), READONLY, "Values the maximum is over."},
    {NULL},
};

static PyMethodDef wm_methods[] = {
    {"append", (PyCFunction)wm_append, METH_O,
     "Add the newest value (the oldest leaves the window)."},
    {"append_max", (PyCFunction)wm_append_max, METH_O,
     "Add the newest value; return the largest in the window (one call a step)."},
    {"max", (PyCFunction)(void (*)(void))wm_max, METH_FASTCALL | METH_KEYWORDS,
     "The largest value in the window, or default before the first."},
    {NULL},
};

static PyTypeObject WindowMaxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cucopy._segment.WindowMax",
    .tp_basicsize = sizeof(WindowMax),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The largest of the last `window` values appended, in O(1) a step "
              "(compiled twin of cucopy.ring.PyWindowMax).",
    .tp_dealloc = (destructor)wm_dealloc,
    .tp_members = wm_members,
    .tp_methods = wm_methods,
    .tp_new = wm_new,
};

/* the section's types and names, added to the module by PyInit__segment */
static int buffer_section_init(PyObject *m) {
    if (PyType_Ready(&BufferCoreType) < 0 || PyType_Ready(&SkipCountsType) < 0 ||
        PyType_Ready(&FastUpdateType) < 0)
        return -1;
    s_force = PyUnicode_InternFromString("force");
    s_viewkw = PyUnicode_InternFromString("view");
    s_key = PyUnicode_InternFromString("key");
    s_exact = PyUnicode_InternFromString("exact");
    s_data = PyUnicode_InternFromString("data");
    s_owned = PyUnicode_InternFromString("owned");
    s_invalidate = PyUnicode_InternFromString("invalidate");
    if (!s_force || !s_viewkw || !s_key || !s_exact || !s_data || !s_owned || !s_invalidate)
        return -1;
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return -1;
    uint8_descr = PyObject_CallMethod(np, "dtype", "s", "uint8");
    Py_DECREF(np);
    if (!uint8_descr) return -1;
    if (PyModule_AddObjectRef(m, "BufferCore", (PyObject *)&BufferCoreType) < 0 ||
        PyModule_AddObjectRef(m, "SkipCounts", (PyObject *)&SkipCountsType) < 0 ||
        PyModule_AddObjectRef(m, "FastUpdate", (PyObject *)&FastUpdateType) < 0)
        return -1;
    return 0;
}

/* -- SlotCore and RingCore: the ring's per-step state, and its common step -------
 *
 * ``cucopy.ring.Slot`` and ``cucopy.ring.StagingRing`` subclass these (their Python
 * twins, ``ring.PySlotCore`` and ``ring.PyRingCore``, hold the same fields as plain
 * attributes). The fields are the ones a step reads and writes; everything else
 * stays in the Python classes. ``RingCore.advance_fast`` is the common step of
 * ``DeviceCopier._advance`` with ``StagingRing.acquire`` in one call: the previous
 * slot left clean (its event recorded at the flush, or none needed), the next one
 * idle (not recorded, or its event complete; no temporaries), sized for the demand
 * the ring last sized for. It checks all of that
 * before changing anything, and returns None when any of it fails: the Python path
 * then runs, whole. On the GPU's host the two Python frames cost ~1.5 us a step,
 * several times that when an engine's own work has left the caches cold. */

typedef struct {
    PyObject_HEAD
    /* Python objects, as a ``__slots__`` class holds them: the Python code that reads
     * and writes these fields on every other path keeps its specialized attribute
     * access (a C integer member would build an int at every read) */
    PyObject *size, *bottom, *top, *recorded, *dirty, *temps, *frees;
    PyObject *base; /* the pinned buffer's device address (what a launch reads it at) */
    long long stamp; /* the ring's acquires when its event was last recorded (-1: never) */
} SlotCore;

/* traverse and clear of a type whose fields an X-macro lists */
#define VISIT_FIELD(f) Py_VISIT(o->f);
#define CLEAR_FIELD(f) Py_CLEAR(o->f);
#define GC_FIELDS(prefix, T, FIELDS)                                      \
    static int prefix##_traverse(T *o, visitproc visit, void *arg) {     \
        FIELDS(VISIT_FIELD)                                               \
        return 0;                                                         \
    }                                                                     \
    static int prefix##_clear(T *o) {                                     \
        FIELDS(CLEAR_FIELD)                                               \
        return 0;                                                         \
    }

#define SLOT_FIELDS(X) X(size) X(bottom) X(top) X(recorded) X(dirty) X(temps) X(frees) X(base)
GC_FIELDS(slotcore, SlotCore, SLOT_FIELDS)

/* the type of a base class whose fields GC_FIELDS lists (Python subclasses it) */
#define CORE_TYPE(prefix, T, methods, doc)                                   \
    {                                                                        \
        PyVarObject_HEAD_INIT(NULL, 0)                                       \
        .tp_name = "cucopy._segment." #T, .tp_basicsize = sizeof(T),         \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, \
        .tp_doc = doc, .tp_traverse = (traverseproc)prefix##_traverse,       \
        .tp_clear = (inquiry)prefix##_clear, .tp_dealloc = cleared_dealloc,  \
        .tp_members = prefix##_members, .tp_methods = methods,               \
        .tp_new = PyType_GenericNew,                                         \
    }


static PyMemberDef slotcore_members[] = {
    {"size", T_OBJECT_EX, offsetof(SlotCore, size), 0, "Bytes of each buffer."},
    {"bottom", T_OBJECT_EX, offsetof(SlotCore, bottom), 0, "Next free byte for segments."},
    {"top", T_OBJECT_EX, offsetof(SlotCore, top), 0, "Lowest byte used by eager snapshots."},
    {"recorded", T_OBJECT_EX, offsetof(SlotCore, recorded), 0, "Its event is recorded."},
    {"dirty", T_OBJECT_EX, offsetof(SlotCore, dirty), 0, "Work reading it was enqueued since."},
    {"temps", T_OBJECT_EX, offsetof(SlotCore, temps), 0, "Temporaries the slot's step used."},
    {"frees", T_OBJECT_EX, offsetof(SlotCore, frees), 0, "Buffers freed when it is reused."},
    {"base", T_OBJECT_EX, offsetof(SlotCore, base), 0, "The pinned buffer's device address."},
    {"stamp", T_LONGLONG, offsetof(SlotCore, stamp), 0,
     "The ring's acquires when its event was last recorded (-1: never)."},
    {NULL},
};

static PyTypeObject SlotCoreType = CORE_TYPE(slotcore, SlotCore, NULL,
    "A ring slot's per-step fields (compiled twin of cucopy.ring.PySlotCore).");

static PyObject *s_backend, *s_event_query;

typedef struct {
    PyObject_HEAD
    PyObject *current, *slots, *events, *demand;
    PyObject *index, *want, *acquires, *target_size, *peak; /* ints, as Python holds them */
    PyObject *launcher; /* a launcher capsule whose query() asks an event, or NULL/None */
    long long fast_advances;
    /* every event recorded at or before acquire `certified` is known complete (one of
     * them was seen complete, and the ring records on one stream, in order); `newest`
     * is the index of the slot recorded last, at acquire `newest_stamp`; `probe` > 0:
     * steps left asking a slot's own event before the newest one (see
     * StagingRing._idle) */
    long long certified, newest, newest_stamp, probe;
} RingCore;

#define RING_FIELDS(X) X(current) X(slots) X(events) X(demand) X(index) X(want) X(acquires) \
    X(target_size) X(peak) X(launcher)
GC_FIELDS(ringcore, RingCore, RING_FIELDS)


/* what wm_push(w, v) would leave as the window's largest value, w unchanged */
static int64_t wm_peek(const WindowMax *w, int64_t v) {
    Py_ssize_t cap = w->cap, len = w->len;
    if (!len) return v;
    Py_ssize_t last = (w->head + len - 1) % cap;
    while (len && w->val[last] <= v) {
        len--;
        last = last ? last - 1 : cap - 1;
    }
    if (!len) return v;
    if (w->idx[w->head] <= w->n - w->window) /* the oldest leaves the window */
        return len > 1 ? w->val[(w->head + 1) % cap] : v;
    return w->val[w->head];
}

static inline int empty_list(PyObject *x) {
    return x != NULL && PyList_CheckExact(x) && PyList_GET_SIZE(x) == 0;
}

/* an exact non-negative int's value below 2**64 (a device address, a stream handle):
 * 1 read, 0 not (no exception left set). Below 2**63 (every CUDA address) digit by
 * digit, where PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray for any int
 * past one digit; above it (the simulated device's addresses may be) that way. */
static inline int u64_field(PyObject *x, unsigned long long *out) {
    if (x == NULL || !PyLong_CheckExact(x)) return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(x);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        *out = u;
        return 1;
    }
    if (overflow || v < 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = (unsigned long long)v;
    return 1;
}

/* an exact int field's value: 1 read, 0 not one (then the Python path runs) */
static inline int int_field(PyObject *x, long long *out) {
    if (x == NULL || !PyLong_CheckExact(x)) return 0;
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(x, &overflow);
    return !overflow && !(*out == -1 && PyErr_Occurred());
}

/* the launcher in capsule cap when it offers the event calls (this header's layout),
 * else NULL; no exception is left set */
static CarriedLauncher *event_launcher(PyObject *cap) {
    if (!cap || !PyCapsule_CheckExact(cap)) return NULL;
    CarriedLauncher *L = PyCapsule_GetPointer(cap, LAUNCHER_NAME);
    if (!L) {
        PyErr_Clear();
        return NULL;
    }
    return L->abi == LAUNCHER_ABI && L->record && L->query ? L : NULL;
}

static inline long long floordiv(long long a, long long b) {
    long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* whether event ev completed: 1 yes, 0 not yet, -1 no answer (another context, a
 * failure: no exception left set). From C through the launcher when it offers the
 * query and ev is a raw handle, else the backend's event_query(). */
static int ring_ask(RingCore *r, CarriedLauncher *L, PyObject *ev) {
    unsigned long long h;
    if (L && u64_field(ev, &h)) {
        int rc = L->query(L->drv, h);
        return rc == 0 ? 1 : rc == 600 ? 0 : -1; /* 600: CUDA_ERROR_NOT_READY */
    }
    PyObject *backend = PyObject_GetAttr((PyObject *)r, s_backend);
    PyObject *done = backend ? PyObject_CallMethodOneArg(backend, s_event_query, ev) : NULL;
    Py_XDECREF(backend);
    int a = done == Py_True ? 1 : done == Py_False ? 0 : -1;
    Py_XDECREF(done);
    if (a < 0 && soft_clear() < 0) return -2; /* a BaseException: propagated */
    return a;
}

/* advance_fast's work: 1 advanced (*slot_out borrowed, *cap_for and *cap updated),
 * 0 the Python path's (nothing changed, no exception set), -1 an error. The event
 * query may run Python code (another thread's close() may empty the ring meanwhile):
 * the slot is held across it and the ring's state read again after it. */
static int ring_advance(RingCore *r, PyObject *segobj, PyObject *tablesobj, long long *cap_for_p,
                        long long *cap_p, PyObject **slot_out) {
    long long cap_for = *cap_for_p, cap = *cap_p;
    if (Py_TYPE(segobj) != &SegmentType || Py_TYPE(tablesobj) != &WindowMaxType ||
        !r->demand || Py_TYPE(r->demand) != &WindowMaxType || !r->slots ||
        !PyList_CheckExact(r->slots))
        return 0;
    Segment *seg = (Segment *)segobj;
    WindowMax *tables = (WindowMax *)tablesobj, *demand = (WindowMax *)r->demand;
    /* the previous slot: left clean (nothing to record) */
    if (!r->current || !PyObject_TypeCheck(r->current, &SlotCoreType)) return 0;
    SlotCore *prev = (SlotCore *)r->current;
    long long pbottom, psize, ptop, want, index, peak, target, size, acquires;
    if (prev->dirty != Py_False || !int_field(prev->bottom, &pbottom) ||
        !int_field(prev->size, &psize) || !int_field(prev->top, &ptop) ||
        !int_field(r->want, &want) || !int_field(r->index, &index) ||
        !int_field(r->peak, &peak) || !int_field(r->target_size, &target) ||
        !int_field(r->acquires, &acquires)) {
        PyErr_Clear();
        return 0;
    }
    /* the next slot: idle, no temporaries, sized for the demand the ring sized for */
    Py_ssize_t n = PyList_GET_SIZE(r->slots);
    if (n == 0) return 0;
    index = index + 1 >= n ? 0 : index + 1;
    PyObject *slotobj = PyList_GET_ITEM(r->slots, index);
    if (!PyObject_TypeCheck(slotobj, &SlotCoreType)) return 0;
    SlotCore *slot = (SlotCore *)slotobj;
    if ((slot->recorded != Py_False && slot->recorded != Py_True) || slot->dirty == NULL ||
        !empty_list(slot->temps) || !empty_list(slot->frees) || !int_field(slot->size, &size)) {
        PyErr_Clear();
        return 0;
    }
    int64_t used = want + pbottom + psize - ptop;
    if (wm_peek(demand, used) != peak || size < target || size > 2 * target) return 0;
    long long certified = r->certified, probe = r->probe;
    if (slot->recorded == Py_True && !(slot->stamp >= 0 && slot->stamp <= certified)) {
        /* its step's work recorded an event: idle once that completed (StagingRing._idle:
         * the newest event first, when that is the habit; nothing is changed unless the
         * slot turns out idle, and the Python path asks again otherwise) */
        if (!r->events || !PyList_CheckExact(r->events) || PyList_GET_SIZE(r->events) != n)
            return 0;
        CarriedLauncher *L = event_launcher(r->launcher);
        int idle = 0;
        long long newest_stamp = r->newest_stamp, stamp = slot->stamp;
        Py_INCREF(slotobj);
        if (probe <= 0 && r->newest >= 0 && r->newest < n && r->newest != index &&
            newest_stamp > stamp) {
            PyObject *ev = Py_NewRef(PyList_GET_ITEM(r->events, r->newest));
            int a = ring_ask(r, L, ev);
            Py_DECREF(ev);
            if (a < 0) { Py_DECREF(slotobj); return a == -2 ? -1 : 0; }
            if (a) {
                idle = 1;
                certified = newest_stamp;
            } else { /* not ready: ask each slot's own first for a ring's turn */
                probe = n;
            }
        } else if (probe > 0) {
            probe--;
        }
        if (!idle) {
            /* not complete, or no answer: the Python path asks again (and waits) */
            int a = -1;
            if (r->events && PyList_CheckExact(r->events) && PyList_GET_SIZE(r->events) == n) {
                PyObject *ev = Py_NewRef(PyList_GET_ITEM(r->events, index));
                a = ring_ask(r, L, ev);
                Py_DECREF(ev);
            }
            if (a != 1) { Py_DECREF(slotobj); return a == -2 ? -1 : 0; }
            if (stamp > certified) certified = stamp;
        }
        /* still the ring that was read: the same slot in place, the same previous one */
        int same = r->slots && PyList_CheckExact(r->slots) && PyList_GET_SIZE(r->slots) == n &&
                   PyList_GET_ITEM(r->slots, index) == slotobj && r->current == (PyObject *)prev &&
                   r->demand == (PyObject *)demand && slot->recorded == Py_True &&
                   slot->dirty != NULL && empty_list(slot->temps) && empty_list(slot->frees);
        Py_DECREF(slotobj); /* the ring's list holds it */
        if (!same) {
            PyErr_Clear();
            return 0;
        }
    }
    PyObject *acq = PyLong_FromLongLong(acquires + 1);
    PyObject *idx = acq ? PyLong_FromLongLong(index) : NULL;
    PyObject *zero = idx ? PyLong_FromLong(0) : NULL;
    if (!zero) {
        Py_XDECREF(acq);
        Py_XDECREF(idx);
        return -1;
    }
    /* StagingRing.acquire, its common case */
    r->certified = certified;
    r->probe = probe;
    wm_push(demand, used);
    Py_SETREF(r->want, Py_NewRef(zero));
    Py_SETREF(r->acquires, acq);
    Py_SETREF(r->index, idx);
    Py_SETREF(slot->bottom, zero);
    Py_SETREF(slot->top, Py_NewRef(slot->size));
    Py_SETREF(slot->recorded, Py_NewRef(Py_False));
    Py_SETREF(slot->dirty, Py_NewRef(Py_False));
    Py_SETREF(r->current, Py_NewRef(slotobj));
    /* DeviceCopier._advance: bind, then the table reservation */
    PyObject *b = seg_bind(seg, slotobj);
    if (!b) return -1;
    Py_DECREF(b);
    wm_push(tables, seg->peak);
    int64_t wanted = tables->val[tables->head];
    seg->peak = 0;
    if (size != cap_for) {
        cap_for = size;
        cap = floordiv(floordiv(size * 3, 4) - HEADER_BYTES, DESC_BYTES);
    }
    if (wanted > cap) wanted = cap;
    seg->reserve = wanted > 16 ? wanted : 16;
    r->fast_advances++;
    *cap_for_p = cap_for;
    *cap_p = cap;
    *slot_out = slotobj;
    return 1;
}

static PyObject *ringcore_advance_fast(RingCore *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "advance_fast(seg, tables, cap_for, cap)");
        return NULL;
    }
    long long cap_for, cap;
    if (!int_field(args[2], &cap_for) || !int_field(args[3], &cap)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *slot;
    int r2 = ring_advance(r, args[0], args[1], &cap_for, &cap, &slot);
    if (r2 < 0) return NULL;
    if (r2 == 0) Py_RETURN_NONE;
    return Py_BuildValue("(OLL)", slot, cap_for, cap);
}

static PyMethodDef ringcore_methods[] = {
    {"advance_fast", (PyCFunction)(void (*)(void))ringcore_advance_fast, METH_FASTCALL,
     "advance_fast(seg, tables, cap_for, cap) -> (slot, cap_for, cap), or None for the "
     "Python path (nothing changed)."},
    {NULL},
};

static PyMemberDef ringcore_members[] = {
    {"current", T_OBJECT, offsetof(RingCore, current), 0, "The slot of the open step."},
    {"_slots", T_OBJECT_EX, offsetof(RingCore, slots), 0, NULL},
    {"_events", T_OBJECT_EX, offsetof(RingCore, events), 0, NULL},
    {"_demand", T_OBJECT_EX, offsetof(RingCore, demand), 0, NULL},
    {"_index", T_OBJECT_EX, offsetof(RingCore, index), 0, NULL},
    {"_want", T_OBJECT_EX, offsetof(RingCore, want), 0, NULL},
    {"acquires", T_OBJECT_EX, offsetof(RingCore, acquires), 0, "Slots acquired so far."},
    {"_target_size", T_OBJECT_EX, offsetof(RingCore, target_size), 0, NULL},
    {"_peak", T_OBJECT_EX, offsetof(RingCore, peak), 0, NULL},
    {"_launcher", T_OBJECT, offsetof(RingCore, launcher), 0,
     "A launcher capsule whose event query advance_fast uses (None: the backend's)."},
    {"fast_advances", T_LONGLONG, offsetof(RingCore, fast_advances), READONLY,
     "Steps advanced by advance_fast."},
    {"_certified", T_LONGLONG, offsetof(RingCore, certified), 0, NULL},
    {"_newest", T_LONGLONG, offsetof(RingCore, newest), 0, NULL},
    {"_newest_stamp", T_LONGLONG, offsetof(RingCore, newest_stamp), 0, NULL},
    {"_probe", T_LONGLONG, offsetof(RingCore, probe), 0, NULL},
    {NULL},
};

static PyTypeObject RingCoreType = CORE_TYPE(ringcore, RingCore, ringcore_methods,
    "The staging ring's per-step state and its common step (compiled twin of "
              "cucopy.ring.PyRingCore).");

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
 * (the check module, the capture query, the launcher). */

typedef struct {
    PyObject_HEAD
    PyObject *closed, *in_step, *owner, *seg, *checker, *feed, *feed_pending, *capturing;
    PyObject *ring, *slot, *tables, *cap_for, *cap, *stepping, *stats, *cap_query, *cap_arg;
    PyObject *launcher, *handle, *carry_max, *flush_mode; /* what a carried flush needs */
    PyObject *mapped_max; /* the largest segment a mapped launch reads (auto's choice) */
    PyObject *graph_cap;  /* mapped segments up to this many bytes launch graphed (0: none) */
    PyObject *check_mod; /* cucopy.check, handed in by the copier (CHECK_MODE is read) */
    long long fast_begins, fast_flushes;
    /* counts of stats' totals the fast paths took, not yet folded into stats (a
     * Python attribute += costs ~0.1 us a time): _take_counts() hands them over */
    long long n_steps, n_segments, n_bytes, n_inline, n_mapped;
    /* the Context its open step() block was entered in (0: none), and that step's
     * sequence number (see current_context) */
    long long step_ctx, step_seq;
} CopierCore;

#define COPIER_FIELDS(X) X(closed) X(in_step) X(owner) X(seg) X(checker) X(feed) \
    X(feed_pending) X(capturing) X(ring) X(slot) X(tables) X(cap_for) X(cap) X(stepping) \
    X(stats) X(cap_query) X(cap_arg) X(launcher) X(handle) X(carry_max) X(flush_mode) \
    X(mapped_max) X(check_mod) X(graph_cap)

GC_FIELDS(copiercore, CopierCore, COPIER_FIELDS)


static PyObject *s_check_mode;
static PyTypeObject CopierCoreType;

/* 1: not capturing; 0: capturing, or cannot tell (the Python path asks again); -1: a
 * BaseException raised by the query (propagated). With
 * the launcher's own capture query and a raw stream handle, straight from C (the same
 * query as cap_query, the Driver's is_capturing, without a Python call). L: the
 * copier's launcher when the caller has it already, else NULL (looked up here). */
static int not_capturing(CopierCore *c, CarriedLauncher *L) {
    if (!c->cap_query || c->cap_query == Py_None || !c->cap_arg) return 0;
    if (c->handle == c->cap_arg && !L && c->launcher && PyCapsule_CheckExact(c->launcher)) {
        L = PyCapsule_GetPointer(c->launcher, LAUNCHER_NAME);
        if (!L) PyErr_Clear();
    }
    unsigned long long stream;
    if (L && c->handle == c->cap_arg && L->abi == LAUNCHER_ABI && L->capturing &&
        u64_field(c->handle, &stream)) {
        int status = -1;
        return L->capturing(L->drv, stream, &status) == 0 && status == 0;
    }
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
    if (c->in_step == Py_False) return 1;
    if (c->in_step != Py_True || !c->owner || !PyLong_CheckExact(c->owner)) return 0;
    unsigned long long owner = PyLong_AsUnsignedLongLong(c->owner);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return owner == me;
}

static int64_t nt_from_for(CopierCore *c);

static PyObject *copiercore_begin_fast(CopierCore *c, PyObject *unused) {
    if (c->closed != Py_False || !c->seg || Py_TYPE(c->seg) != &SegmentType ||
        c->checker != Py_None || !c->ring || !PyObject_TypeCheck(c->ring, &RingCoreType) ||
        !c->stats)
        Py_RETURN_FALSE;
    uint64_t me = thread_id();
    if (!step_is_callers(c, me)) Py_RETURN_FALSE;
    Segment *seg = (Segment *)c->seg;
    if (nstaged(seg)) Py_RETURN_FALSE; /* staged: flushed first */
    if (!c->check_mod) Py_RETURN_FALSE;
    PyObject *mode = PyObject_GetAttr(c->check_mod, s_check_mode);
    if (!mode) {
        if (soft_clear() < 0) return NULL;
        Py_RETURN_FALSE;
    }
    Py_DECREF(mode);
    if (mode != Py_False) Py_RETURN_FALSE;
    int idle = not_capturing(c, NULL);
    if (idle < 0) return NULL;
    if (!idle) Py_RETURN_FALSE;
    long long cap_for, cap;
    if (!c->tables || !c->cap_for || !c->cap || !int_field(c->cap_for, &cap_for) ||
        !int_field(c->cap, &cap)) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    long long cap_for0 = cap_for, cap0 = cap;
    PyObject *slot;
    int adv = ring_advance((RingCore *)c->ring, c->seg, c->tables, &cap_for, &cap, &slot);
    if (adv < 0) {
        /* the ring took its step but binding failed: as begin() leaves it */
        Py_SETREF(c->in_step, Py_NewRef(Py_False));
        seg->fast = 0;
        Py_SETREF(c->feed, Py_NewRef(Py_None));
        Py_SETREF(c->feed_pending, Py_NewRef(Py_None));
        Py_SETREF(c->capturing, Py_NewRef(Py_False));
        Py_SETREF(c->slot, Py_NewRef(Py_None));
        seg_release(seg);
        seg->seg = -1;
        seg->cursor = 0;
        return NULL;
    }
    if (adv == 0) Py_RETURN_FALSE;
    /* the step is open from here: the fields as DeviceCopier._advance sets them */
    PyObject *owner = PyLong_FromUnsignedLongLong(me);
    if (!owner) return NULL;
    if (cap_for != cap_for0 || cap != cap0) { /* a slot of another size (rare) */
        PyObject *f = PyLong_FromLongLong(cap_for), *k = f ? PyLong_FromLongLong(cap) : NULL;
        if (!k) {
            Py_XDECREF(f);
            Py_DECREF(owner);
            return NULL;
        }
        Py_SETREF(c->cap_for, f);
        Py_SETREF(c->cap, k);
    }
    seg->nt_from = nt_from_for(c);
    c->n_steps++; /* stats.steps += 1, folded when stats is read */
    Py_SETREF(c->slot, Py_NewRef(slot));
    Py_SETREF(c->feed, Py_NewRef(Py_None));
    Py_SETREF(c->feed_pending, Py_NewRef(Py_None));
    Py_SETREF(c->capturing, Py_NewRef(Py_False));
    Py_SETREF(c->owner, owner);
    Py_SETREF(c->in_step, Py_NewRef(Py_True));
    seg->fast = 1;
    seg->owner = me;
    c->fast_begins++;
    Py_RETURN_TRUE;
}

/* stats.modes[how] += 1, stats.segments += 1, stats.bytes_staged += total: counted
 * here, folded into stats when it is read (CopyStats.pending_totals) */
static PyObject *s_inline, *s_mapped, *s_auto, *s_dma;
static int nt_off; /* CUCOPY_NO_NT set at import: no streaming stores */

/* The copier's flush mode: one of the interned literals unless set from another
 * string (then compared character by character). */
enum { MODE_OTHER, MODE_AUTO, MODE_INLINE, MODE_MAPPED, MODE_DMA };
static int flush_mode_kind(PyObject *fm) {
    if (fm == s_auto) return MODE_AUTO;
    if (fm == s_inline) return MODE_INLINE;
    if (fm == s_mapped) return MODE_MAPPED;
    if (fm == s_dma) return MODE_DMA;
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
    if (nt_off) return -1;
    int kind = flush_mode_kind(c->flush_mode);
    if (kind == MODE_MAPPED || kind == MODE_DMA) return 0;
    long long cm;
    if (kind == MODE_OTHER || !c->carry_max || !int_field(c->carry_max, &cm)) {
        PyErr_Clear();
        return -1;
    }
    return cm;
}

static void count_segment(CopierCore *c, PyObject *how, int64_t total) {
    c->n_segments++;
    c->n_bytes += total;
    if (how == s_inline) c->n_inline++;
    else c->n_mapped++;
}

static PyObject *copiercore_take_counts(CopierCore *c, PyObject *unused) {
    PyObject *r = Py_BuildValue("(LLLLL)", c->n_steps, c->n_segments, c->n_bytes, c->n_inline,
                                c->n_mapped);
    if (r) c->n_steps = c->n_segments = c->n_bytes = c->n_inline = c->n_mapped = 0;
    return r;
}

static PyObject *copiercore_flush_fast(CopierCore *c, PyObject *unused) {
    if (c->closed != Py_False || !c->seg || Py_TYPE(c->seg) != &SegmentType ||
        c->checker != Py_None || !c->ring || !PyObject_TypeCheck(c->ring, &RingCoreType) ||
        !step_is_callers(c, thread_id()))
        Py_RETURN_FALSE;
    Segment *seg = (Segment *)c->seg;
    RingCore *ring = (RingCore *)c->ring;
    if (!nstaged(seg)) {
        /* nothing staged and no event owed (a step whose every copy was skipped as
         * unchanged): flush()'s body would return at once, so return here */
        PyObject *cur = ring->current;
        if (!cur || cur == Py_None ||
            (PyObject_TypeCheck(cur, &SlotCoreType) && ((SlotCore *)cur)->dirty == Py_False))
            Py_RETURN_TRUE;
        Py_RETURN_FALSE;
    }
    if (!c->launcher || !PyCapsule_CheckExact(c->launcher) || !c->handle || !c->carry_max ||
        !c->slot || !PyObject_TypeCheck(c->slot, &SlotCoreType) || !c->stats)
        Py_RETURN_FALSE;
    /* carried whole when it fits (inline, auto); else read mapped (mapped, auto) */
    int kind = flush_mode_kind(c->flush_mode);
    int carries = kind == MODE_AUTO || kind == MODE_INLINE;
    int mapped_only = kind == MODE_MAPPED;
    int is_auto = kind == MODE_AUTO;
    if (!carries && !mapped_only) Py_RETURN_FALSE;
    SlotCore *slot = (SlotCore *)c->slot;
    if (!seg->bound || seg->slot != c->slot || !slot->base) Py_RETURN_FALSE;
    CarriedLauncher *L = PyCapsule_GetPointer(c->launcher, LAUNCHER_NAME);
    unsigned long long stream, dev;
    long long inline_max;
    if (!L || !u64_field(c->handle, &stream) || !int_field(c->carry_max, &inline_max) ||
        !u64_field(slot->base, &dev)) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    /* a mapped launch needs the slot's event recorded after it, from C */
    long long mapped_max = -1;
    unsigned long long event = 0;
    CarriedLauncher *E = L->abi == LAUNCHER_ABI && L->record && L->query ? L : NULL;
    if (E && c->mapped_max && int_field(c->mapped_max, &mapped_max) &&
        ring->current == c->slot && ring->events && PyList_CheckExact(ring->events)) {
        long long index;
        if (!int_field(ring->index, &index) || index < 0 ||
            index >= PyList_GET_SIZE(ring->events) ||
            !u64_field(PyList_GET_ITEM(ring->events, index), &event))
            mapped_max = -1;
    } else {
        mapped_max = -1;
    }
    PyErr_Clear();
    if (mapped_only && mapped_max < 0) Py_RETURN_FALSE;
    int idle = not_capturing(c, L);
    if (idle < 0) return NULL;
    if (!idle) Py_RETURN_FALSE;
    /* from here on as _flush_segment: an error is flush()'s to report (the segment cut) */
    int64_t off, end, nblocks;
    Py_ssize_t n;
    if (cut_impl(seg, carries ? inline_max : -1, &off, &end, &nblocks, &n) < 0) return NULL;
    int64_t total = end - off, head = HEADER_BYTES + (int64_t)n * DESC_BYTES;
    PyObject *how;
    long long gcap = 0;
    if (mapped_max >= 0 && (mapped_only || (is_auto && total <= mapped_max)) && E->graphed &&
        c->graph_cap &&
        int_field(c->graph_cap, &gcap) && gcap > 0 && (size_t)gcap <= E->graph_cap &&
        total <= gcap && off + gcap <= (int64_t)seg->view.len && off + gcap <= seg->top) {
        /* _land's graphed launch (mapped, and auto: half a carried launch's host
         * time): its kernel reads gcap bytes at the segment when it runs, so the
         * slot's next segment starts past them */
        if (E->graphed(E->drv, stream, dev + (unsigned long long)off) != 0) goto cut;
        if (seg->cursor < off + gcap) seg->cursor = off + gcap;
        how = s_mapped;
        Py_SETREF(slot->dirty, Py_NewRef(Py_True));
    } else if (carries && total <= inline_max) {
        if (launch_carried(seg, L, nblocks, stream, dev + (unsigned long long)off, total) != 0)
            goto cut;
        how = s_inline; /* carried whole: no event needed for it */
    } else if (mapped_max >= 0 && head <= inline_max &&
               (mapped_only || total <= mapped_max)) {
        /* _land's mapped launch carrying the header and the table (head <= the largest
         * carry); the uncarried kernel's case stays _land's */
        if (launch_carried(seg, L, nblocks, stream, dev + (unsigned long long)off,
                           align_up(head, ALIGN)) != 0)
            goto cut;
        how = s_mapped;
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
    if (how == s_mapped && slot->dirty == Py_True &&
        E->record(E->drv, event, stream) == 0) { /* StagingRing.record */
        Py_SETREF(slot->recorded, Py_NewRef(Py_True));
        Py_SETREF(slot->dirty, Py_NewRef(Py_False));
        long long acquires, index;
        if (int_field(ring->acquires, &acquires) && int_field(ring->index, &index)) {
            slot->stamp = acquires;
            ring->newest = index;
            ring->newest_stamp = acquires;
        } else { /* cannot happen (checked above); forget what is known, to be safe */
            PyErr_Clear();
            slot->stamp = -1;
            ring->newest = -1;
            ring->certified = -1;
        }
    }
    /* the slot dirtied in the step (an eager copy, or a record that failed):
     * flush()'s body records it */
    if (ring->current && PyObject_TypeCheck(ring->current, &SlotCoreType) &&
        ((SlotCore *)ring->current)->dirty != Py_False)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
cut:
    return Py_BuildValue("(LLLn)", (long long)off, (long long)end, (long long)nblocks, n);
}

static PyObject *core_seg(PyObject *self) {
    /* the copier's class (a subclass: an MRO walk each time) remembered once seen; the
     * reference keeps it alive, so no other type takes its address */
    static PyTypeObject *known;
    PyTypeObject *tp = Py_TYPE(self);
    if (tp == known || tp == &CopierCoreType) return ((CopierCore *)self)->seg;
    if (!PyType_IsSubtype(tp, &CopierCoreType)) return NULL;
    Py_INCREF(tp);
    Py_XSETREF(known, tp);
    return ((CopierCore *)self)->seg;
}

static PyMethodDef copiercore_methods[] = {
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
static PyMemberDef copiercore_members[] = {
    MEMBER("_closed", closed) MEMBER("_in_step", in_step) MEMBER("_owner", owner)
    MEMBER("_seg", seg) MEMBER("_checker", checker) MEMBER("_feed", feed)
    MEMBER("_feed_pending", feed_pending) MEMBER("_capturing", capturing)
    MEMBER("_ring", ring) MEMBER("_slot", slot) MEMBER("_tables", tables)
    MEMBER("_cap_for", cap_for) MEMBER("_cap", cap) MEMBER("_stepping", stepping)
    MEMBER("stats", stats) MEMBER("_cap_query", cap_query) MEMBER("_cap_arg", cap_arg)
    MEMBER("_launcher", launcher) MEMBER("_handle", handle) MEMBER("_carry_max", carry_max)
    MEMBER("_mapped_max", mapped_max) MEMBER("_graph_cap", graph_cap)
    MEMBER("flush_mode", flush_mode) MEMBER("_check_mod", check_mod)
    {"_fast_begins", T_LONGLONG, offsetof(CopierCore, fast_begins), READONLY,
     "Steps begun by _begin_fast."},
    {"_fast_flushes", T_LONGLONG, offsetof(CopierCore, fast_flushes), READONLY,
     "Segments landed by _flush_fast."},
    {"_step_ctx", T_LONGLONG, offsetof(CopierCore, step_ctx), READONLY,
     "The Context (its address) the open step() block was entered in; 0: none."},
    {"_step_seq", T_LONGLONG, offsetof(CopierCore, step_seq), READONLY,
     "The open step() block's sequence number (the innermost step has the largest)."},
    {NULL},
};
#undef MEMBER

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

static PyObject *s_enter, *s_exit, *s_flush, *s_begin, *s_flush_failed, *s_flush_rest;
static PyObject *plain_begin; /* DeviceCopier.begin: a subclass that overrides it is called */
static PyObject *plain_flush; /* DeviceCopier.flush: likewise */

static PyObject *stepcore_plain_begin(PyObject *type, PyObject *func) {
    Py_XSETREF(plain_begin, Py_NewRef(func));
    Py_RETURN_NONE;
}

static PyObject *stepcore_plain_flush(PyObject *type, PyObject *func) {
    Py_XSETREF(plain_flush, Py_NewRef(func));
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
static long long step_counter;

#if PY_VERSION_HEX >= 0x030D0000
#define CUCOPY_TSTATE() PyThreadState_GetUnchecked()
#else
#define CUCOPY_TSTATE() _PyThreadState_UncheckedGet()
#endif

/* the calling thread's current Context object (made now if it has none yet), or NULL
 * with an exception set */
static PyObject *current_context(void) {
    PyThreadState *ts = CUCOPY_TSTATE(); /* (never NULL: the caller holds the GIL) */
    if (!ts->context) {
        PyObject *copy = PyContext_CopyCurrent(); /* makes the thread's context */
        if (!copy) return NULL;
        Py_DECREF(copy);
    }
    return ts->context;
}

static PyObject *mod_context_id(PyObject *m, PyObject *unused) {
    PyObject *ctx = current_context();
    return ctx ? PyLong_FromVoidPtr(ctx) : NULL;
}

/* flush() of copier c: DeviceCopier.flush's body with its _flush_fast called from here
 * (one Python frame less a step), or the copier's own flush() when a subclass has one */
static PyObject *step_flush(CopierCore *c) {
    PyObject *o = (PyObject *)c;
    if (!plain_flush || _PyType_Lookup(Py_TYPE(o), s_flush) != plain_flush)
        return PyObject_CallMethodNoArgs(o, s_flush);
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
        PyObject *r = PyObject_CallMethodOneArg(o, s_flush_failed, exc);
        Py_DECREF(exc);
        Py_XDECREF(r);
        if (r) {
            PyErr_SetString(PyExc_SystemError, "_flush_failed() returned");
        }
        return NULL;
    }
    if (done == Py_True) return done;
    PyObject *r = PyObject_CallMethodOneArg(o, s_flush_rest, done);
    Py_DECREF(done);
    return r;
}

static PyObject *stepcore_enter(StepCore *st, PyObject *unused) {
    PyObject *ctx = current_context();
    if (!ctx) return NULL;
    PyObject *o = st->copier;
    if (o && st->graph == Py_None && PyObject_TypeCheck(o, &CopierCoreType) && plain_begin &&
        _PyType_Lookup(Py_TYPE(o), s_begin) == plain_begin) {
        CopierCore *c = (CopierCore *)o;
        if (c->stepping == Py_False && c->closed == Py_False) {
            Py_INCREF(o); /* held: begin runs Python code on some backends */
            PyObject *r = copiercore_begin_fast(c, NULL);
            if (!r) {
                Py_DECREF(o);
                return NULL;
            }
            Py_DECREF(r);
            if (r == Py_True) {
                Py_SETREF(c->stepping, Py_NewRef(Py_True));
                c->step_ctx = (long long)(uintptr_t)ctx; /* the block's context */
                c->step_seq = ++step_counter;
                return o; /* (the reference held above) */
            }
            Py_DECREF(o);
        }
    }
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)st, s_enter);
    if (r && o && PyObject_TypeCheck(o, &CopierCoreType)) {
        ((CopierCore *)o)->step_ctx = (long long)(uintptr_t)ctx;
        ((CopierCore *)o)->step_seq = ++step_counter;
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
            s_exit, (PyObject *[]){(PyObject *)st, args[0], args[1], args[2]}, 4, NULL);
    }
    CopierCore *c = (CopierCore *)Py_NewRef(o); /* held: flush() runs Python code */
    c->step_ctx = 0;
    Py_SETREF(c->stepping, Py_NewRef(Py_False));
    PyObject *r = step_flush(c);
    /* finally: the step is over, whatever flush() did (its segment read again: that
     * code may have replaced it) */
    Py_SETREF(c->in_step, Py_NewRef(Py_False));
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
    return PyLong_FromLongLong(native_word_reads);
}

static PyObject *mod_thread_id(PyObject *m, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(thread_id());
}

static PyMethodDef module_methods[] = {
    {"thread_id", mod_thread_id, METH_NOARGS,
     "The calling thread's id for step ownership: never reused by a later thread "
     "(twin of cucopy.segment.py_thread_id)."},
    {"_context_id", mod_context_id, METH_NOARGS,
     "The calling thread's current Context object's address (steps record theirs)."},
    {"_native_word_reads", mod_native_word_reads, METH_NOARGS,
     "Cached tensors validated through the handle word they hold (native_word), so far."},
    {NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "cucopy._segment",
    "The open segment, compiled (twin of cucopy.segment.PySegment).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__segment(void) {
    if (PyType_Ready(&EntryType) < 0 || PyType_Ready(&CachedType) < 0 ||
        PyType_Ready(&SegmentType) < 0 || PyType_Ready(&FastCopyType) < 0 ||
        PyType_Ready(&FastRouteType) < 0 || PyType_Ready(&WindowMaxType) < 0 ||
        PyType_Ready(&SlotCoreType) < 0 || PyType_Ready(&RingCoreType) < 0 ||
        PyType_Ready(&CopierCoreType) < 0 || (StepCoreType.tp_init = (initproc)stepcore_init,
                                               PyType_Ready(&StepCoreType) < 0) ||
        (ActivationType.tp_init = (initproc)activation_init,
         PyType_Ready(&ActivationType) < 0))
        return NULL;
    s_copy = PyUnicode_InternFromString("copy");
    if (!s_copy) return NULL;
    s_seg = PyUnicode_InternFromString("_seg");
    s_after_barrier = PyUnicode_InternFromString("_after_barrier");
    s_unchanged = PyUnicode_InternFromString("unchanged");
    s_on_drop = PyUnicode_InternFromString("on_drop");
    if (!s_seg || !s_after_barrier || !s_unchanged || !s_on_drop) return NULL;
    s_begin = PyUnicode_InternFromString("begin");
    if (!s_begin) return NULL;
    s_enter = PyUnicode_InternFromString("_enter");
    s_exit = PyUnicode_InternFromString("_exit");
    s_flush = PyUnicode_InternFromString("flush");
    s_flush_failed = PyUnicode_InternFromString("_flush_failed");
    s_flush_rest = PyUnicode_InternFromString("_flush_rest");
    if (!s_enter || !s_exit || !s_flush || !s_flush_failed || !s_flush_rest) return NULL;
    s_inline = PyUnicode_InternFromString("inline");
    s_mapped = PyUnicode_InternFromString("mapped");
    s_auto = PyUnicode_InternFromString("auto");
    s_dma = PyUnicode_InternFromString("dma");
    {
        const char *e = getenv("CUCOPY_NO_NT");
        nt_off = e && *e && strcmp(e, "0") != 0;
    }
    if (!s_inline || !s_mapped || !s_auto || !s_dma) return NULL;
    s_check_mode = PyUnicode_InternFromString("CHECK_MODE");
    if (!s_check_mode) return NULL;
    s_backend = PyUnicode_InternFromString("backend");
    s_event_query = PyUnicode_InternFromString("event_query");
    if (!s_backend || !s_event_query) return NULL;
    s_array = PyUnicode_InternFromString("array");
    s_headroom = PyUnicode_InternFromString("headroom");
    s_top = PyUnicode_InternFromString("top");
    s_bottom = PyUnicode_InternFromString("bottom");
    if (!s_array || !s_top || !s_bottom) return NULL;
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return NULL;
    ndarray_type = PyObject_GetAttrString(np, "ndarray");
    Py_DECREF(np);
    if (!ndarray_type) return NULL;
    s_dtype = PyUnicode_InternFromString("dtype");
    s_spec = PyUnicode_InternFromString("__cucopy_spec__");
    s_view = PyUnicode_InternFromString("__cucopy_view__");
    s_native = PyUnicode_InternFromString("__cucopy_native__");
    s_flags = PyUnicode_InternFromString("__cucopy_flags__");
    if (!s_native || !s_flags) return NULL;
    if (!s_dtype || !s_spec || !s_view) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Segment", (PyObject *)&SegmentType) < 0 ||
        PyModule_AddObjectRef(m, "Entry", (PyObject *)&EntryType) < 0 ||
        PyModule_AddObjectRef(m, "FastCopy", (PyObject *)&FastCopyType) < 0 ||
        PyModule_AddObjectRef(m, "FastRoute", (PyObject *)&FastRouteType) < 0 ||
        PyModule_AddObjectRef(m, "WindowMax", (PyObject *)&WindowMaxType) < 0 ||
        PyModule_AddObjectRef(m, "SlotCore", (PyObject *)&SlotCoreType) < 0 ||
        PyModule_AddObjectRef(m, "RingCore", (PyObject *)&RingCoreType) < 0 ||
        PyModule_AddObjectRef(m, "CopierCore", (PyObject *)&CopierCoreType) < 0 ||
        PyModule_AddObjectRef(m, "StepCore", (PyObject *)&StepCoreType) < 0 ||
        PyModule_AddObjectRef(m, "Activation", (PyObject *)&ActivationType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (buffer_section_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
