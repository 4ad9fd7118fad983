/* ranges.c: descriptors and range sets
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

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
