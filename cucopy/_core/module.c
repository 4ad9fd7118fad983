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
