/* copy.c: one copy's fast path (h2d, fill, skip) and the general stage()
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

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
    if ((PyObject *)Py_TYPE(src) == S->ndarray_type && (S->foreign & FOREIGN_NUMPY) &&
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
    } else if ((PyObject *)Py_TYPE(src) == S->ndarray_type) {
        PyObject *dt = PyObject_GetAttr(src, S->s_dtype);
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

/* -- the eager path's common case (copier.c's core_eager issues it) ---------------
 *
 * An H2D copy through a site the plan does not merge, in the open step: the
 * destination's geometry from its cache entry, the source's bytes from a NumPy array's
 * fields or a cached source, and room at the slot's top. The caller snapshots the bytes
 * there at once and issues one driver copy. */
typedef struct {
    Geo g;
    const char *src; /* the source's first byte */
    int64_t spitch;  /* bytes between its rows (0: packed) */
    int64_t top;     /* the snapshot's offset in the slot */
} Eager;

/* whether [lo, hi) overlaps bytes staged copies write (or, with reads, D2D copies read) */
static inline int staged_overlaps(Segment *s, addr_t lo, addr_t hi, int reads) {
    return nstaged(s) && (ranges_overlaps(&s->writes, lo, hi) ||
                          (reads && ranges_overlaps(&s->reads, lo, hi)));
}

/* a source seen before (a torch CPU tensor, by identity) whose cached geometry matches
 * destination g and is still what it was: 1 and *ptr its first byte (a cached source is
 * packed), 0 not, -1 an error (the eager and the guarded copy's common cases) */
static int cached_source(Segment *s, PyObject *src, const Geo *g, addr_t *ptr) {
    Cached *sc = (Cached *)front_get(&s->sfront, s->scache, src);
    if (!sc) return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(sc);
    int v = 0;
    if (sc->nbytes == g->nbytes && sc->ndim >= 0 &&
        shape_fits(sc->ndim, (const Py_ssize_t *)sc->shape, g->ndim, g->shape)) {
        int eq = sc->dtype == g->dtype ? 1 : PyObject_RichCompareBool(sc->dtype, g->dtype, Py_EQ);
        if (eq < 0) v = soft_clear() < 0 ? -1 : 0;
        else if (eq == 1) v = cached_valid(sc, src);
    }
    *ptr = sc->ptr;
    Py_DECREF(sc);
    return v;
}

/* 1: e is filled (e->g.hold held: Py_DECREF it), 0: a miss, -1: an error. Nothing is
 * written until it answers 1; the slot's top is then taken (the last step, with no
 * Python code run after it). */
static int eager_source(Segment *s, PyObject *dst, PyObject *src, Eager *e) {
    Geo *g = &e->g;
    int r = dst_geo(s, dst, g);
    if (r <= 0) return r;
    e->spitch = 0;
    e->src = NULL;
    if ((PyObject *)Py_TYPE(src) == S->ndarray_type && (S->foreign & FOREIGN_NUMPY)) {
        NpArray *a = (NpArray *)src;
        if (a->descr != g->dtype || a->nd > MAXDIM) goto miss;
        int64_t n = 1;
        for (int i = 0; i < a->nd; i++) n *= a->dimensions[i];
        if (n * g->itemsize != g->nbytes || !shape_fits(a->nd, a->dimensions, g->ndim, g->shape))
            goto miss;
        if (a->flags & NPY_C_CONTIGUOUS_FLAG)
            e->src = a->data;
        else if (a->nd == 2 && g->kind == KIND_H2D_2D && a->dimensions[0] == g->rows &&
                 a->strides[1] == g->itemsize && a->dimensions[1] * g->itemsize == g->width &&
                 a->strides[0] >= g->width) {
            e->src = a->data; /* rows of packed elements, not packed together: gathered */
            e->spitch = a->strides[0];
        } else
            goto miss;
    } else if ((PyObject *)Py_TYPE(src) != S->ndarray_type) {
        addr_t p;
        int v = cached_source(s, src, g, &p);
        if (v < 0) goto fail;
        if (v == 0) goto miss;
        e->src = (const char *)(uintptr_t)p;
    } else {
        goto miss; /* a NumPy array read through the public path: the Python path's */
    }
    /* the fingerprint and the view's attributes ran Python code: asked again */
    if (!seg_usable(s)) goto miss;
    /* program order: a copy over (or under) staged bytes lands them first (Python) */
    if (staged_overlaps(s, g->lo, g->hi, 1)) goto miss;
    e->top = top_room(s, g->nbytes); /* the slot's top, as take_top() */
    if (e->top < 0) goto miss;       /* (a temporary: Python's) */
    return 1;
miss:
    Py_DECREF(g->hold);
    return 0;
fail:
    Py_DECREF(g->hold);
    return -1;
}

static PyObject *seg_stage(Segment *s, PyObject *args);

/* What try_fill needs of a destination's dtype: FILL_SIGNED (kind "i") or FILL_UNSIGNED
 * (kind "u"), and FILL_NATIVE (its byte order the host's; an itemsize of 1 is always);
 * -1 with an error set. A NumPy dtype's answer is kept for the next call with the same
 * dtype (its kind and byte order never change), so a fill reads no attribute by name
 * while its destinations' dtype stays the same; any other dtype object is asked each
 * time (its attributes may be Python code). */
enum { FILL_SIGNED = 1, FILL_UNSIGNED = 2, FILL_NATIVE = 4 };
static int fill_kind(PyObject *dtype, int64_t itemsize) {
    if (dtype && dtype == S->fill_dtype) return S->fill_kind;
    int numpy = PyObject_TypeCheck(dtype, (PyTypeObject *)S->dtype_type);
    PyObject *kind = PyObject_GetAttrString(dtype, "kind");
    if (!kind) return -1;
    int fk = 0;
    if (PyUnicode_Check(kind)) {
        if (PyUnicode_CompareWithASCIIString(kind, "i") == 0) fk = FILL_SIGNED;
        else if (PyUnicode_CompareWithASCIIString(kind, "u") == 0) fk = FILL_UNSIGNED;
    }
    Py_DECREF(kind);
    if (fk && (numpy || itemsize > 1)) {
        PyObject *native = PyObject_GetAttrString(dtype, "isnative");
        if (!native) return -1;
        if (native == Py_True) fk |= FILL_NATIVE;
        Py_DECREF(native);
    } else if (fk) {
        fk |= FILL_NATIVE; /* one byte: no byte order to swap */
    }
    if (numpy && fk) {
        Py_XSETREF(S->fill_dtype, Py_NewRef(dtype));
        S->fill_kind = fk;
    }
    return fk;
}

static PyObject *seg_try_fill(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    /* try_fill(site, dst, start, value, on_drop) -> MISS / STAGED / BARRIER / SKIPPED
     * (an empty tail: start at or past the end, the value checked all the same) */
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
    int fk = fill_kind(g.dtype, it);
    if (fk < 0) goto soft;
    int signed_ = fk & FILL_SIGNED, unsigned_ = fk & FILL_UNSIGNED;
    if ((!signed_ && !unsigned_) || (it != 1 && it != 2 && it != 4 && it != 8)) goto miss;
    /* the pattern below is in the host's order: a swapped dtype is the general path's
     * (its pattern comes from NumPy, in the dtype's order) */
    if (it > 1 && !(fk & FILL_NATIVE)) goto miss;
    if (!seg_usable(s)) goto miss; /* (the dtype's attributes: Python for a hostile dtype) */
    uint64_t pattern;
    int bits = (int)(8 * it);
    if (signed_) {
        long long v = PyLong_AsLongLongAndOverflow(args[3], &overflow);
        if (overflow) goto miss;
        if (bits < 64 && (v < -(1LL << (bits - 1)) || v >= (1LL << (bits - 1)))) goto miss;
        pattern = (uint64_t)v;
    } else {
        long long sv = PyLong_AsLongLongAndOverflow(args[3], &overflow); /* (its sign) */
        if (sv == -1 && PyErr_Occurred()) goto soft;
        if (overflow < 0 || (!overflow && sv < 0)) goto miss;
        unsigned long long v = PyLong_AsUnsignedLongLong(args[3]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) goto soft;
        if (bits < 64 && v >= (1ULL << bits)) goto miss;
        pattern = v;
    }
    if (bits < 64) pattern &= (1ULL << bits) - 1;
    if (start >= size) { /* an empty tail: nothing staged (the general path's skip) */
        Py_DECREF(g.hold);
        return PyLong_FromLong(SKIPPED);
    }
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
    return PyBool_FromLong(staged_overlaps(s, lo, hi, reads));
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
