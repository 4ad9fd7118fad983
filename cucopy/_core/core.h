/* The compiled core's common ground: includes, the wire format's constants, the
 * outcomes a copy call reports, and the few helpers every concept uses.
 */
#ifndef CUCOPY_CORE_H
#define CUCOPY_CORE_H
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
#include "../_carried_launcher.h"

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
/* pack.TAG_AT: a slot's completion tag, from its first byte (tests/test_cudacall.py
 * checks the compiled flush's tagged launches against pack.TAG_AT) */
#define TAG_AT (-64)

/* pack.graph_reach: the bytes a graphed kernel of capacity cap reads at a segment of
 * total bytes (cap; a segment of up to graph_max bytes read to its end rounded up to
 * 16; 0: one longer still, not launched graphed, or with is_auto one of more than
 * AUTO_GRAPH_ROUNDS * cap, which flush_mode="auto" carries instead) */
#define GRAPH_ROUNDS 4
#define AUTO_GRAPH_ROUNDS 2
static inline int64_t graph_max(int64_t cap) {
    return cap <= 8192 ? GRAPH_ROUNDS * cap : cap <= 16384 ? 2 * cap : cap;
}
static inline int64_t graph_reach(int64_t cap, int64_t total, int is_auto) {
    if (total <= cap) return cap;
    if (total > graph_max(cap) || (is_auto && total > AUTO_GRAPH_ROUNDS * cap)) return 0;
    return (total + 15) & ~(int64_t)15;
}

enum { MISS = 0, STAGED = 1, BARRIER = 2, SKIPPED = 3, FULL = -1, ORDER = -2 };


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


/* The module's state: everything the core keeps between calls. One module instance a
 * process (its types are static: module.c refuses a second), so the state is reached
 * through S, set once by the module's exec slot, instead of a module lookup a call. */
typedef struct CoreState {
    /* interned names the core reads or calls */
    PyObject *s_dtype, *s_spec, *s_view, *s_native, *s_flags, *s_array, *s_top, *s_bottom,
        *s_headroom, *s_seg, *s_after_barrier, *s_unchanged, *s_on_drop, *s_copy, *s_force,
        *s_viewkw, *s_key, *s_exact, *s_data, *s_owned, *s_invalidate, *s_backend,
        *s_event_query, *s_inline, *s_mapped, *s_auto, *s_dma, *s_enter,
        *s_exit, *s_flush, *s_begin, *s_flush_failed, *s_flush_rest, *s_backend_attr,
        *s_copy2d, *s_stream_attr, *s_begin_body, *s_guard;
    PyObject *ndarray_type; /* numpy.ndarray */
    PyObject *uint8_descr;  /* numpy.dtype("uint8") */
    PyObject *dtype_type;   /* numpy.dtype: its instances' kind and byte order never change */
    PyObject *fill_dtype;   /* the NumPy dtype try_fill last read (copy.c), and what it read: */
    int fill_kind;          /* FILL_* bits (kind "i" or "u", native byte order) */
    PyObject *plain_begin;  /* DeviceCopier.begin (StepCore._plain_begin) */
    PyObject *plain_flush;  /* DeviceCopier.flush (StepCore._plain_flush) */
    PyObject *known_core;   /* the copier class core_seg last saw (copier.c) */
    PyObject *known_slot;   /* the slot class is_slot last saw (segment.c) */
    struct Native *natives; /* the native getters fingerprints declared (foreign.c) */
    int nnatives;
    PyObject **entry_pool; /* cleared Entry objects kept for the next steps (segment.c) */
    int entry_npool;
    long long native_word_reads; /* validations through a tensor's handle word (tests) */
    long long step_counter;      /* step() blocks entered (the innermost has the largest) */
    int nt_off;                  /* CUCOPY_NO_NT at import: no streaming stores */
    int check_mode;              /* cucopy.check.CHECK_MODE, pushed (_set_check_mode) */
    unsigned foreign;            /* the foreign reads in use (FOREIGN_* bits, foreign.c) */
} CoreState;

static CoreState *S;

static inline int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) & -a; }

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

#endif
