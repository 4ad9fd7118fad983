/* The compiled core (cucopy._segment): one translation unit of the concept files
 * beside it, in dependency order (README.md). */
#define CUCOPY_UNITY 1
#include "core.h"
#include "foreign.c"
#include "ranges.c"
#include "cache.c"
#include "segment.c"
#include "copy.c"
#include "wire.c"
#include "segment_type.c"
#include "fastcopy.c"
#include "buffer.c"
#include "ring.c"
#include "copier.c"
#include "guard.c"

/* each interned name of the state, and its text */
#define NAME(f, text) {offsetof(CoreState, f), text},
static const struct {
    size_t off;
    const char *text;
} names[] = {
    NAME(s_dtype, "dtype") NAME(s_spec, "__cucopy_spec__") NAME(s_view, "__cucopy_view__")
    NAME(s_native, "__cucopy_native__") NAME(s_flags, "__cucopy_flags__")
    NAME(s_array, "array") NAME(s_top, "top") NAME(s_bottom, "bottom")
    NAME(s_headroom, "headroom") NAME(s_seg, "_seg") NAME(s_after_barrier, "_after_barrier")
    NAME(s_unchanged, "unchanged") NAME(s_on_drop, "on_drop") NAME(s_copy, "copy")
    NAME(s_force, "force") NAME(s_viewkw, "view") NAME(s_key, "key") NAME(s_exact, "exact")
    NAME(s_data, "data") NAME(s_owned, "owned") NAME(s_invalidate, "invalidate")
    NAME(s_backend, "backend") NAME(s_event_query, "event_query")
    NAME(s_inline, "inline") NAME(s_mapped, "mapped")
    NAME(s_auto, "auto") NAME(s_dma, "dma") NAME(s_enter, "_enter") NAME(s_exit, "_exit")
    NAME(s_flush, "flush") NAME(s_begin, "begin") NAME(s_flush_failed, "_flush_failed")
    NAME(s_flush_rest, "_flush_rest") NAME(s_backend_attr, "_backend")
    NAME(s_copy2d, "copy2d") NAME(s_stream_attr, "_stream") NAME(s_begin_body, "_begin_body") NAME(s_guard, "guard")
};
#undef NAME
#define NAMED(st, i) ((PyObject **)((char *)(st) + names[i].off))

/* the state's references: the names, the objects, the native getters' and the entry
 * pool's (visit is NULL: clear them) */
static int state_refs(CoreState *st, visitproc visit, void *arg) {
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (visit) Py_VISIT(*NAMED(st, i));
        else Py_CLEAR(*NAMED(st, i));
    }
    PyObject **objs[] = {&st->ndarray_type, &st->uint8_descr, &st->plain_begin, &st->plain_flush,
                        &st->known_core, &st->known_slot, &st->dtype_type, &st->fill_dtype};
    for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++) {
        if (visit) Py_VISIT(*objs[i]);
        else Py_CLEAR(*objs[i]);
    }
    for (int i = 0; st->natives && i < st->nnatives; i++) {
        if (visit) {
            Py_VISIT(st->natives[i].fp);
            Py_VISIT(st->natives[i].attr);
        } else {
            Py_CLEAR(st->natives[i].fp);
            Py_CLEAR(st->natives[i].attr);
        }
    }
    if (!visit) {
        st->nnatives = 0;
        while (st->entry_pool && st->entry_npool > 0) Py_DECREF(st->entry_pool[--st->entry_npool]);
    }
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    CoreState *st = PyModule_GetState(m);
    return st ? state_refs(st, visit, arg) : 0;
}

static int module_clear(PyObject *m) {
    CoreState *st = PyModule_GetState(m);
    if (st) state_refs(st, NULL, NULL);
    return 0;
}

static void module_free(void *m) {
    CoreState *st = PyModule_GetState((PyObject *)m);
    if (!st) return;
    state_refs(st, NULL, NULL);
    PyMem_Free(st->natives);
    PyMem_Free(st->entry_pool);
    st->natives = NULL;
    st->entry_pool = NULL;
    if (S == st) S = NULL;
}

static PyTypeObject *const types[] = {
    &EntryType, &CachedType, &SegmentType, &FastCopyType, &FastRouteType, &WindowMaxType,
    &SlotCoreType, &RingCoreType, &CopierCoreType, &StepCoreType, &ActivationType,
    &UseCoreType, &GuardCoreType,
};

static int module_exec(PyObject *m) {
    if (S) {
        /* the types are static: a second instance would share them with the first */
        PyErr_SetString(PyExc_ImportError,
                        "cucopy._segment is loaded once a process (one interpreter, one "
                        "module instance)");
        return -1;
    }
    CoreState *st = PyModule_GetState(m);
    st->natives = PyMem_Calloc(MAX_NATIVES, sizeof(Native));
    st->entry_pool = PyMem_Calloc(ENTRY_POOL_MAX, sizeof(PyObject *));
    if (!st->natives || !st->entry_pool) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*NAMED(st, i) = PyUnicode_InternFromString(names[i].text))) return -1;
    const char *e = getenv("CUCOPY_NO_NT");
    st->nt_off = e && *e && strcmp(e, "0") != 0;
    st->foreign = FOREIGN_ALL;
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return -1;
    st->ndarray_type = PyObject_GetAttrString(np, "ndarray");
    st->uint8_descr = st->ndarray_type ? PyObject_CallMethod(np, "dtype", "s", "uint8") : NULL;
    st->dtype_type = st->uint8_descr ? PyObject_GetAttrString(np, "dtype") : NULL;
    Py_DECREF(np);
    if (!st->dtype_type) return -1;
    if (!PyType_Check(st->dtype_type)) {
        PyErr_SetString(PyExc_ImportError, "numpy.dtype is not a type");
        return -1;
    }
    StepCoreType.tp_init = (initproc)stepcore_init;
    SlotCoreType.tp_new = slotcore_new;
    SlotCoreType.tp_getset = slotcore_getset;
    CopierCoreType.tp_new = copiercore_new;
    CopierCoreType.tp_getset = copiercore_getset;
    ActivationType.tp_init = (initproc)activation_init;
    UseCoreType.tp_new = usecore_new;
    UseCoreType.tp_getset = usecore_getset;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyType_Ready(types[i]) < 0) return -1;
    static const char *const exported[] = {
        "Segment", "Entry", "FastCopy", "FastRoute", "WindowMax", "SlotCore",
        "RingCore", "CopierCore", "StepCore", "Activation", "UseCore", "GuardCore",
    };
    PyTypeObject *const etypes[] = {
        &SegmentType, &EntryType, &FastCopyType, &FastRouteType, &WindowMaxType,
        &SlotCoreType, &RingCoreType, &CopierCoreType, &StepCoreType, &ActivationType,
        &UseCoreType, &GuardCoreType,
    };
    for (size_t i = 0; i < sizeof exported / sizeof exported[0]; i++)
        if (PyModule_AddObjectRef(m, exported[i], (PyObject *)etypes[i]) < 0) return -1;
    S = st; /* (buffer_section_init reads it) */
    if (buffer_section_init(m) < 0) {
        S = NULL;
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* static types and one state: not for subinterpreters */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    /* the core relies on the GIL (it holds borrowed pointers between calls that
     * another thread could otherwise free): not declared free-threading safe */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cucopy._segment",
    .m_doc = "cucopy's compiled core (twin of cucopy.segment, ring, copier and buffer's "
             "per-step code; cucopy/_core/README.md).",
    .m_size = sizeof(CoreState),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__segment(void) { return PyModuleDef_Init(&moduledef); }
