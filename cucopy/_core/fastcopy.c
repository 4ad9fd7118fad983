/* fastcopy.c: DeviceCopier.copy and cucopy.copy with no Python frame
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

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

static PyObject *core_seg(PyObject *self); /* a CopierCore's segment (borrowed), or NULL */
static PyObject *core_fastcopy(PyObject *self); /* its class's FastCopy (borrowed), or NULL */
static int core_eager(PyObject *self, PyObject *site, PyObject *dst, PyObject *src,
                      PyObject *on_drop); /* the eager path's common case (copier.c) */
static int core_guarded(PyObject *self, PyObject *site, PyObject *dst, PyObject *src,
                        PyObject *guard, PyObject *on_drop); /* copy(guard=) (guard.c) */

static PyObject *fastcopy_call(FastCopy *f, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *on_drop = Py_None, *guard = Py_None;
    if (nargs != 4) goto full;
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i), *v = args[nargs + i];
            if (k == S->s_on_drop) on_drop = v;
            else if (k == S->s_unchanged && v == Py_False) continue;
            else if (k == S->s_guard) guard = v;
            else goto full; /* unchanged=True, or anything unusual */
        }
    }
    PyObject *self = args[0];
    if (guard != Py_None) { /* read in place: its common case in C, else the Python copy */
        int code = core_guarded(self, args[1], args[2], args[3], guard, on_drop);
        if (code < 0) return NULL;
        if (code == STAGED) Py_RETURN_TRUE;
        goto full;
    }
    PyObject *seg = core_seg(self); /* the member itself, no attribute lookup */
    if (seg) Py_INCREF(seg);
    else seg = PyObject_GetAttr(self, S->s_seg);
    if (!seg) return NULL;
    if (Py_TYPE(seg) != &SegmentType) { Py_DECREF(seg); goto full; }
    int code = h2d_fast((Segment *)seg, args[1], args[2], args[3], on_drop, 0);
    Py_DECREF(seg);
    if (code == MISS) /* a site the plan does not merge: copied eagerly, from C */
        code = core_eager(self, args[1], args[2], args[3], on_drop);
    if (code < 0) return NULL;
    if (code == STAGED) Py_RETURN_TRUE;
    if (code == BARRIER) {
        PyObject *x = PyObject_CallMethodOneArg(self, S->s_after_barrier, args[1]);
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


static PyObject *fastroute_call(FastRoute *f, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *c = NULL;
    if (total < 8 && PyContextVar_Get(f->var, NULL, &c) == 0 && c && c != Py_None) {
        PyObject *m = core_fastcopy(c); /* the copier's class's FastCopy (borrowed), or NULL */
        if (m) {
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
