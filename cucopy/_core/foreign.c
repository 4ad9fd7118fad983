/* foreign.c: the one place that reads other libraries' internals
 *
 * NumPy's array fields (exact ndarrays only) and the native getters a fingerprint
 * declares (torch: the AOTI C shim and the tensor's own handle word).
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

/* The reads below, each behind a bit of S->foreign (all set at import): clearing one
 * makes the core take the public path instead (module function _set_foreign; the
 * bench's foreign-reads probe measures what each saves, tests force each fallback).
 * A cleared bit applies to cache entries made after it. */
#define FOREIGN_NUMPY 1u    /* an exact ndarray's fields (else: dtype, buffer protocol) */
#define FOREIGN_NATIVE 2u   /* a fingerprint's native getters (else: its spec's calls) */
#define FOREIGN_WORD 4u     /* the handle word a tensor holds (else: its attribute) */
#define FOREIGN_FLAGWORD 8u /* the handle's key-set bits (else: is_conj(), is_neg()) */
#define FOREIGN_ALL 15u

/* A type's attribute as the type's MRO gives it (borrowed, or NULL; no error set):
 * the public twin of CPython's private _PyType_Lookup, for look-ups made once (when a
 * cache entry or a type's descriptors are resolved), never per copy. */
static PyObject *type_lookup(PyTypeObject *tp, PyObject *name) {
    PyObject *mro = tp->tp_mro;
    if (!mro || !PyTuple_Check(mro)) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *b = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *dict = PyType_GetDict(b); /* (static builtin types keep theirs apart) */
#else
        PyObject *dict = Py_XNewRef(b->tp_dict);
#endif
        if (!dict) continue;
        PyObject *v = PyDict_GetItemWithError(dict, name); /* borrowed: the type holds it */
        Py_DECREF(dict);
        if (v) return v;
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return NULL;
        }
    }
    return NULL;
}

/* The calling thread's current Context object (made now if it has none yet), or NULL
 * with an exception set. A step records its block's context by identity (copier.c):
 * setting a context variable instead costs ~1.4k instructions a step (a HAMT node and
 * a token). CPython has no public call that answers it without a copy, so this reads
 * the thread state's ``context`` field (cpython/pystate.h, 3.7 and later). */
static PyObject *current_context(void) {
    PyThreadState *ts = PyThreadState_Get(); /* (the caller holds the GIL) */
    if (!ts->context) {
        PyObject *copy = PyContext_CopyCurrent(); /* makes the thread's context */
        if (!copy) return NULL;
        Py_DECREF(copy);
    }
    return ts->context;
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

/* the native getters fp declares (parsed once, kept for the process), or NULL */
static Native *native_for(PyObject *fp) {
    for (int i = 0; i < S->nnatives; i++)
        if (S->natives[i].fp == fp) return S->natives[i].attr ? &S->natives[i] : NULL;
    if (S->nnatives == MAX_NATIVES) return NULL;
    Native *n = &S->natives[S->nnatives];
    memset(n, 0, sizeof(*n));
    PyObject *t = PyObject_GetAttr(fp, S->s_native);
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
    S->nnatives++;
    return n->attr ? n : NULL;
}

/* the handle attribute's data descriptor on tp (new reference), or NULL */
static PyObject *native_descr(Native *n, PyTypeObject *tp) {
    PyObject *d = type_lookup(tp, n->attr); /* borrowed */
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
    if (n->flag_off >= 0 && (S->foreign & FOREIGN_FLAGWORD) &&
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
