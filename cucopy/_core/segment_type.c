/* segment_type.c: per-site counts, finish/reset and the Segment type
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

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
        Py_ssize_t *evals = PyMem_Calloc((size_t)cap, sizeof(Py_ssize_t));
        unsigned char *flags = PyMem_Calloc((size_t)cap, 1);
        if (!keys || !vals || !evals || !flags) {
            PyMem_Free(keys); PyMem_Free(vals); PyMem_Free(evals); PyMem_Free(flags);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < s->ccap; i++) {
            if (!s->ckeys[i]) continue;
            Py_ssize_t j = count_slot(keys, cap, s->ckeys[i]);
            keys[j] = s->ckeys[i];
            vals[j] = s->cvals[i];
            evals[j] = s->evals[i];
            flags[j] = s->cflags[i];
        }
        PyMem_Free(s->ckeys);
        PyMem_Free(s->cvals);
        PyMem_Free(s->evals);
        PyMem_Free(s->cflags);
        s->ckeys = keys;
        s->cvals = vals;
        s->evals = evals;
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

/* SITE_EAGER when site is an H2D CopySite (set_eager's type and direction), else 0;
 * -1 on error. Asked only of sites the plan does not merge. */
static int eager_site(Segment *s, PyObject *site) {
    if (!s->site_type || !s->h2d || !PyType_Check(s->site_type)) return 0;
    int is = PyObject_IsInstance(site, s->site_type);
    if (is <= 0) return is;
    PyObject *d = PyObject_GetAttrString(site, "direction");
    if (!d) return soft_clear();
    int e = d == s->h2d;
    Py_DECREF(d);
    return e ? SITE_EAGER : 0;
}

/* whether the plan merges site and makes it a barrier (SITE_MERGE, SITE_BARRIER bits),
 * or, not merged, whether it is an H2D site (SITE_EAGER), asked of the plan's frozen
 * sets once per site and kept in the count table (two set lookups a copy otherwise);
 * -1 on error */
static int site_flags(Segment *s, PyObject *site) {
    if (!PyFrozenSet_CheckExact(s->merge) || !PyFrozenSet_CheckExact(s->barriers)) {
        int m = contains(s->merge, site);
        int b = m == 1 ? contains(s->barriers, site) : 0;
        int e = m == 0 ? eager_site(s, site) : 0;
        if (m < 0 || b < 0 || e < 0) return -1;
        return (m ? SITE_MERGE : 0) | (b ? SITE_BARRIER : 0) | e;
    }
    if (s->ccap) {
        Py_ssize_t i = count_slot(s->ckeys, s->ccap, site);
        if (s->ckeys[i] == site && (s->cflags[i] & SITE_KNOWN))
            return s->cflags[i] & ~(SITE_KNOWN | SITE_IN_PLACE);
    }
    int m = contains(s->merge, site);
    int b = m == 1 ? contains(s->barriers, site) : 0;
    int e = m == 0 ? eager_site(s, site) : 0;
    if (m < 0 || b < 0 || e < 0) return -1;
    int f = (m ? SITE_MERGE : 0) | (b ? SITE_BARRIER : 0) | e;
    Py_ssize_t i = count_index(s, site);
    if (i < 0) return -1;
    s->cflags[i] = (unsigned char)(f | SITE_KNOWN | (s->cflags[i] & SITE_IN_PLACE));
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

static PyObject *seg_fold_eager(Segment *s, PyObject *unused) {
    /* {site: eager copies the compiled eager path issued since the last fold}; a merged
     * site's (read in place through a guard) as (n, "in_place"), its fallback reason */
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < s->ccap; i++) {
        if (!s->ckeys[i] || !s->evals[i]) continue;
        PyObject *v = s->cflags[i] & SITE_IN_PLACE
                          ? Py_BuildValue("(ns)", s->evals[i], "in_place")
                          : PyLong_FromSsize_t(s->evals[i]);
        if (!v || PyDict_SetItem(out, s->ckeys[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
        s->evals[i] = 0;
    }
    return out;
}

static PyObject *seg_set_eager(Segment *s, PyObject *const *args, Py_ssize_t nargs) {
    /* set_eager(site_type, h2d): H2D sites outside the plan copy eagerly in C */
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_eager(site_type, h2d)");
        return NULL;
    }
    Py_XSETREF(s->site_type, Py_NewRef(args[0]));
    Py_XSETREF(s->h2d, Py_NewRef(args[1]));
    if (s->cflags) memset(s->cflags, 0, (size_t)s->ccap); /* asked again */
    Py_RETURN_NONE;
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
        if (!v || slot_set(s->slot, S->s_bottom, v) < 0) { Py_XDECREF(v); return NULL; }
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
    {"fold_eager", (PyCFunction)seg_fold_eager, METH_NOARGS,
     "Eager copies the compiled eager path issued per site since the last fold."},
    {"set_eager", (PyCFunction)(void (*)(void))seg_set_eager, METH_FASTCALL,
     "set_eager(site_type, h2d): sites of this type and direction, not merged, may be "
     "copied eagerly by the compiled copy."},
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
