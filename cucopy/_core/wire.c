/* wire.c: split, encode and cut: the segment's wire format (pack.py)
 *
 * Part of the compiled core's one translation unit (module.c includes every
 * file of this folder in dependency order; README.md says why). */
#ifndef CUCOPY_UNITY
#error "compiled only through module.c"
#endif

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
