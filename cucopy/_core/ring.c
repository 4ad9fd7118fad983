/* ring.c: the staging ring's per-step state: WindowMax, SlotCore, RingCore
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

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

/* -- SlotCore and RingCore: the ring's per-step state, and its common step -------
 *
 * ``cucopy.ring.Slot`` and ``cucopy.ring.StagingRing`` subclass these (their Python
 * twins, ``ring.PySlotCore`` and ``ring.PyRingCore``, hold the same fields as plain
 * attributes). The fields are the ones a step reads and writes; everything else
 * stays in the Python classes. ``RingCore.advance_fast`` is the common step of
 * ``DeviceCopier._advance`` with ``StagingRing.acquire`` in one call: the previous
 * slot left clean (its event recorded at the flush, or none needed), the next one
 * idle (its tag, if armed, arrived; not recorded, or its event complete; no
 * temporaries), sized for the demand the ring last sized for. It checks all of that
 * before changing anything, and returns None when any of it fails: the Python path
 * then runs, whole. On the GPU's host the two Python frames cost ~1.5 us a step,
 * several times that when an engine's own work has left the caches cold. */

static PyObject *slotcore_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    SlotCore *s = (SlotCore *)PyType_GenericNew(tp, args, kw);
    if (s) s->tag = -1;
    return (PyObject *)s;
}


#define SLOT_FIELDS(X) X(size) X(bottom) X(top) X(recorded) X(dirty) X(temps) X(frees) X(base) \
    X(array)
static int slotcore_traverse(SlotCore *o, visitproc visit, void *arg) {
    SLOT_FIELDS(VISIT_FIELD)
    return 0;
}
static int slotcore_clear(SlotCore *o) {
    slot_unexport(o);
    SLOT_FIELDS(CLEAR_FIELD)
    return 0;
}

static PyObject *slotcore_get_array(SlotCore *s, void *unused) {
    return Py_NewRef(s->array ? s->array : Py_None);
}

/* a new array (None when the slot closes) ends the export of the old one */
static int slotcore_set_array(SlotCore *s, PyObject *v, void *unused) {
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "array cannot be deleted");
        return -1;
    }
    if (v != s->array) slot_unexport(s);
    Py_XSETREF(s->array, Py_NewRef(v));
    return 0;
}

static PyGetSetDef slotcore_getset[] = {
    {"array", (getter)slotcore_get_array, (setter)slotcore_set_array,
     "The pinned buffer's bytes (a uint8 array; None once closed).", NULL},
    {NULL},
};


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
    {"tag", T_LONGLONG, offsetof(SlotCore, tag), 0,
     "The step its completion tag was armed with for a launch still owed (-1: none)."},
    {"tag_host", T_ULONGLONG, offsetof(SlotCore, tag_host), 0,
     "Its completion tag's host address (0: none)."},
    {"headroom", T_PYSSIZET, offsetof(SlotCore, headroom), 0,
     "Bytes allocated before the slot's first byte that no segment uses."},
    {NULL},
};

static PyTypeObject SlotCoreType = CORE_TYPE(slotcore, SlotCore, NULL,
    "A ring slot's per-step fields (compiled twin of cucopy.ring.PySlotCore).");


typedef struct {
    PyObject_HEAD
    PyObject *current, *slots, *events, *demand;
    PyObject *index, *want, *acquires, *target_size, *peak; /* ints, as Python holds them */
    PyObject *launcher; /* a launcher capsule whose query() asks an event, or NULL/None */
    long long fast_advances;
    long long capacity; /* StagingRing.capacity: the smallest slot size */
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


/* StagingRing._target's size for a demand peak: max(capacity, _pow2(align(peak, 4096))),
 * or -1 where the Python path should compute it (a negative or huge peak) */
static long long ring_target(long long capacity, int64_t peak) {
    if (peak < 0 || peak > ((int64_t)1 << 60)) return -1;
    uint64_t a = ((uint64_t)peak + 4095) & ~(uint64_t)4095;
    /* _pow2(n) = 1 << max(0, (n - 1).bit_length()): the least power of two >= n, and 2
     * for 0 ((-1).bit_length() is 1); n is a multiple of 4096 here */
    uint64_t p = a == 0 ? 2 : 1;
    while (p < a) p <<= 1;
    return (long long)p > capacity ? (long long)p : capacity;
}

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
    PyObject *backend = PyObject_GetAttr((PyObject *)r, S->s_backend);
    PyObject *done = backend ? PyObject_CallMethodOneArg(backend, S->s_event_query, ev) : NULL;
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
    if (!r->current || !is_slot(r->current)) return 0;
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
    if (!is_slot(slotobj)) return 0;
    SlotCore *slot = (SlotCore *)slotobj;
    if ((slot->recorded != Py_False && slot->recorded != Py_True) || slot->dirty == NULL ||
        !empty_list(slot->temps) || !empty_list(slot->frees) || !int_field(slot->size, &size)) {
        PyErr_Clear();
        return 0;
    }
    int64_t used = want + pbottom + psize - ptop;
    /* the demand's new peak and the size it asks for (StagingRing._target, when the
     * peak moved: a decode loop whose reads grow a little each step moves it often) */
    int64_t newpeak = wm_peek(demand, used);
    if (newpeak != peak) {
        target = ring_target(r->capacity, newpeak);
        if (target < 0) return 0;
    }
    if (size < target || size > 2 * target) return 0;
    /* its tagged launch's tag first (a load of host memory, StagingRing._idle): not yet
     * arrived, and the Python path waits for it; nothing is changed */
    if (slot_tag_done(slot) != 1) return 0;
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
                   slot->dirty != NULL && empty_list(slot->temps) && empty_list(slot->frees) &&
                   slot_tag_done(slot) == 1;
        Py_DECREF(slotobj); /* the ring's list holds it */
        if (!same) {
            PyErr_Clear();
            return 0;
        }
    }
    PyObject *acq = PyLong_FromLongLong(acquires + 1);
    PyObject *idx = acq ? PyLong_FromLongLong(index) : NULL;
    PyObject *zero = idx ? PyLong_FromLong(0) : NULL;
    PyObject *npeak = NULL, *ntarget = NULL;
    if (zero && newpeak != peak) {
        npeak = PyLong_FromLongLong(newpeak);
        ntarget = npeak ? PyLong_FromLongLong(target) : NULL;
    }
    if (!zero || (newpeak != peak && !ntarget)) {
        Py_XDECREF(acq);
        Py_XDECREF(idx);
        Py_XDECREF(zero);
        Py_XDECREF(npeak);
        return -1;
    }
    if (ntarget) {
        Py_SETREF(r->peak, npeak);
        Py_SETREF(r->target_size, ntarget);
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
    slot->tag = -1;
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
    {"capacity", T_LONGLONG, offsetof(RingCore, capacity), 0,
     "Bytes of a slot at least (StagingRing's capacity)."},
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
