/* cucopy.backends._cudacall: the CUDA backend's per-step driver calls, made from C.
 *
 * The compiled twin of paths in cuda.py (which stay the reference and the
 * fallback): the capture query every begin() and flush() makes
 * (cuStreamIsCapturing), the scatter launch that carries a segment in its
 * parameters (cuLaunchKernel with a CU_LAUNCH_PARAM_BUFFER), and the staging
 * slot's event calls (cuEventRecord and cuEventQuery, set by events(); the
 * backend's event_record() and event_query() stay the reference). Through CuPy's
 * wrappers and ctypes each costs a few Python-to-C hops (the carried launch: the
 * argument struct's fields, a ctypes.memmove of the segment, CuPy's launchKernel);
 * here each is one call. The driver's entry points are passed in as addresses
 * (taken by the backend from the driver library CuPy loaded), so this module links
 * against nothing and builds without the CUDA toolkit.
 *
 * The launches and the event calls keep the GIL. A launch returns in a few
 * microseconds (it only blocks when the device's launch queue is full; an event is
 * recorded or queried in less and neither waits for the device), and releasing the
 * GIL around it hands the interpreter to any other Python thread, which the caller
 * then waits for at the GIL (up to the switch interval) before its step can go on:
 * in an engine with a second Python thread a launch measured about 28 us that way
 * (bench/results/2026-12-01-h200-run30, hf_upload_profile) against 5-7 alone.
 *
 * Once bind() names the device's context, every call first checks that it is the
 * calling thread's current one and does nothing otherwise (OTHER_CONTEXT), so the
 * backend makes these calls before asking CuPy which device is current. The carried
 * launch and the event calls are also offered as C functions (launcher(), a
 * CarriedLauncher: see ../_carried_launcher.h) that the staging core calls at flush,
 * straight after cutting the segment.
 *
 * Nothing here maps errors: each call returns the driver's CUresult (or, for the
 * capture query, the capture status), and the backend turns a failure into its
 * usual CopyError (or retries through CuPy, whose error it then reports).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "../_carried_launcher.h"

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned shmem, void *stream,
                         void **params, void **extra);
typedef int (*capturing_fn)(void *stream, int *status);
typedef int (*ctx_current_fn)(void **ctx);
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*event_query_fn)(void *event);
typedef int (*htod_fn)(unsigned long long dst, const void *src, size_t bytes, void *stream);

/* cuda.h's CUDA_MEMCPY2D (cuMemcpy2DAsync_v2's argument) */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType; /* CUmemorytype: 1 host, 2 device */
    const void *srcHost;
    unsigned long long srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    unsigned long long dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} Memcpy2D;
typedef int (*copy2d_fn)(const Memcpy2D *p, void *stream);
#define MEMORYTYPE_HOST 1
#define MEMORYTYPE_DEVICE 2
#define MAX_2D_PITCH 0x7fffffffULL /* cudaDevAttrMaxPitch (the backend's _MAX_2D_PITCH) */

/* cuda.h's CUDA_KERNEL_NODE_PARAMS_v2 (the v1 struct, which cuGraphAddKernelNode
 * takes, is its prefix up to extra) */
typedef struct {
    void *func;
    unsigned gridDimX, gridDimY, gridDimZ;
    unsigned blockDimX, blockDimY, blockDimZ;
    unsigned sharedMemBytes;
    void **kernelParams;
    void **extra;
    void *kern;
    void *ctx;
} KernelNodeParams;
typedef int (*graph_create_fn)(void **graph, unsigned flags);
typedef int (*graph_add_kernel_fn)(void **node, void *graph, void *const *deps, size_t ndeps,
                                   const KernelNodeParams *params);
typedef int (*graph_instantiate_fn)(void **exec, void *graph, unsigned long long flags);
typedef int (*graph_launch_fn)(void *exec, void *stream);
typedef int (*graph_destroy_fn)(void *graph);
typedef int (*graph_exec_destroy_fn)(void *exec);

typedef int (*graph_exec_set_params_fn)(void *exec, void *node, const KernelNodeParams *params);

/* The one-node graphs of the whole-segment kernel: a pool of GRAPH_POOL made by graphs()
 * (set-up), none ever made after it. Making a graph mid-run may block the host until
 * the device drains, a hang behind a kernel that spins until the host acts
 * (bench/probes/graph_hold.py); re-pointing one (cuGraphExecKernelNodeSetParams) only
 * changes its executable's future launches (the driver API's reference: those already
 * enqueued or running are unaffected). The calls hold the GIL, which serializes them
 * (graph objects are not thread-safe).
 * An entry last launched on one stream is never launched on another: launches of one
 * executable are ordered behind its previous launch on any stream, a cross-stream
 * dependency no copier asked for. A ring's slots come round in turn, each a segment
 * address or two (tagged or not), so a copier's stream keeps a few entries pointed at
 * its own and re-points none once they are; with every entry another stream's,
 * graphed() launches nothing (-1) and the caller launches the segment another way. */
#define GRAPH_POOL 16
/* an entry's stream before its first launch (0 is a stream: the legacy default one) */
#define NEVER_LAUNCHED (~0ULL)
/* what a lookup compares (kept apart from the handles: a scan of the pool reads these
 * 16 x 24 bytes, six or seven cache lines, and on a hit nothing else but its handles
 * and last-use word) */
typedef struct {
    unsigned long long seg, cell; /* the kernel's two arguments (cell 0: no tag) */
    unsigned long long stream;    /* of its last launch (NEVER_LAUNCHED: none yet) */
} GraphKey;
typedef struct {
    void *exec;
    void *graph; /* kept: re-pointing names the node of the graph the exec came from */
    void *node;
} GraphHandles;

/* what the calls answer, without calling the driver, when the thread's current
 * context is not the one bind() named: the backend's checked path then runs */
#define OTHER_CONTEXT (-2)
#define OTHER_CONTEXT_STATUS (-1000000)

/* cuda.h: CU_LAUNCH_PARAM_END, CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE */
#define PARAM_END ((void *)0x00)
#define PARAM_BUFFER_POINTER ((void *)0x01)
#define PARAM_BUFFER_SIZE ((void *)0x02)

#define MAX_CAPS 32
#define PREFIX 16 /* pack.CARRY_PREFIX: segment address (8), bytes carried (4), reserved (4) */

typedef struct {
    PyObject_HEAD
    launch_fn launch;
    capturing_fn capturing;
    int ncaps;
    size_t caps[MAX_CAPS]; /* ascending */
    void *carried[MAX_CAPS];
    void *scatter; /* NULL until kernels() */
    unsigned threads;
    ctx_current_fn ctx_current; /* with ctx: set by bind() */
    void *ctx;                  /* the device's context; NULL: not checked */
    /* cuEventRecord and cuEventQuery: set by events(); NULL until then */
    event_record_fn event_record;
    event_query_fn event_query;
    /* cuMemcpyHtoDAsync_v2 and cuMemcpy2DAsync_v2: set by copies(); NULL until then */
    htod_fn htod;
    copy2d_fn copy2d;
    CarriedLauncher launcher;
    /* one-node graphs of the whole-segment kernel: set by graphs(); NULL until then */
    graph_create_fn graph_create;
    graph_add_kernel_fn graph_add_kernel;
    graph_instantiate_fn graph_instantiate;
    graph_launch_fn graph_launch;
    graph_destroy_fn graph_destroy;
    graph_exec_destroy_fn graph_exec_destroy;
    graph_exec_set_params_fn graph_set_params;
    void *whole;      /* cucopy_scatter_w8k */
    size_t graph_cap; /* the bytes it reads at its segment (0: no graphs) */
    int ngraphs;      /* the pool's entries made (graphs()) */
    unsigned long long graph_updates; /* cuGraphExecKernelNodeSetParams calls */
    unsigned long long graph_clock;   /* launches of the pool's entries so far */
    GraphKey gkey[GRAPH_POOL];
    unsigned long long gused[GRAPH_POOL]; /* graph_clock at its last launch (0: never) */
    GraphHandles ghandle[GRAPH_POOL];
} Driver;

/* 1 when the calling thread's current context is the bound one (or none is bound) */
static int same_context(Driver *self) {
    if (!self->ctx) return 1;
    void *c = NULL;
    return self->ctx_current(&c) == 0 && c == self->ctx;
}

static int Driver_init(Driver *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"launch", "is_capturing", NULL};
    unsigned long long launch = 0, capturing = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK", names, &launch, &capturing)) return -1;
    if (!launch || !capturing) {
        PyErr_SetString(PyExc_ValueError, "Driver: a null entry point");
        return -1;
    }
    self->launch = (launch_fn)(uintptr_t)launch;
    self->capturing = (capturing_fn)(uintptr_t)capturing;
    self->ncaps = 0;
    self->scatter = NULL;
    self->threads = 0;
    self->ctx_current = NULL;
    self->ctx = NULL;
    self->event_record = NULL;
    self->event_query = NULL;
    self->htod = NULL;
    self->copy2d = NULL;
    if (!self->ngraphs) { /* (a pool made stays: dealloc frees it) */
        self->graph_launch = NULL;
        self->whole = NULL;
        self->graph_cap = 0;
        self->graph_updates = 0;
        self->graph_clock = 0;
    }
    return 0;
}

/* the pool's executables and graphs are freed (an executable in flight when its
 * launches complete) */
static void Driver_dealloc(Driver *self) {
    for (int i = 0; i < self->ngraphs; i++) {
        self->graph_exec_destroy(self->ghandle[i].exec);
        self->graph_destroy(self->ghandle[i].graph);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* bind(ctx_get_current, ctx): from now on every call first checks that the calling
 * thread's current context is ctx (cuCtxGetCurrent, ~20 ns), and launches or queries
 * nothing otherwise, so the backend need not ask which device is current first. */
static PyObject *Driver_bind(Driver *self, PyObject *args) {
    unsigned long long get = 0, ctx = 0;
    if (!PyArg_ParseTuple(args, "KK", &get, &ctx)) return NULL;
    if (!get || !ctx) {
        PyErr_SetString(PyExc_ValueError, "bind: a null entry point or context");
        return NULL;
    }
    self->ctx_current = (ctx_current_fn)(uintptr_t)get;
    self->ctx = (void *)(uintptr_t)ctx;
    Py_RETURN_NONE;
}

/* events(record, query): cuEventRecord's and cuEventQuery's addresses; until then
 * the event calls call nothing and answer -1 (the staging core then records and
 * queries through the backend) */
static PyObject *Driver_events(Driver *self, PyObject *args) {
    unsigned long long record = 0, query = 0;
    if (!PyArg_ParseTuple(args, "KK", &record, &query)) return NULL;
    if (!record || !query) {
        PyErr_SetString(PyExc_ValueError, "events: a null entry point");
        return NULL;
    }
    self->event_record = (event_record_fn)(uintptr_t)record;
    self->event_query = (event_query_fn)(uintptr_t)query;
    Py_RETURN_NONE;
}

/* copies(htod, copy2d): cuMemcpyHtoDAsync_v2's and cuMemcpy2DAsync_v2's addresses;
 * until then the launcher's copy() copies nothing and answers -1 */
static PyObject *Driver_copies(Driver *self, PyObject *args) {
    unsigned long long htod = 0, copy2d = 0;
    if (!PyArg_ParseTuple(args, "KK", &htod, &copy2d)) return NULL;
    if (!htod || !copy2d) {
        PyErr_SetString(PyExc_ValueError, "copies: a null entry point");
        return NULL;
    }
    self->htod = (htod_fn)(uintptr_t)htod;
    self->copy2d = (copy2d_fn)(uintptr_t)copy2d;
    Py_RETURN_NONE;
}

/* kernels(scatter, carried, threads): the kernels to launch, once they are loaded;
 * carried is a sequence of (capacity, CUfunction), capacities ascending */
static PyObject *Driver_kernels(Driver *self, PyObject *args) {
    unsigned long long scatter = 0;
    PyObject *carried = NULL;
    unsigned threads = 0;
    if (!PyArg_ParseTuple(args, "KOI", &scatter, &carried, &threads)) return NULL;
    if (!scatter || !threads) {
        PyErr_SetString(PyExc_ValueError, "kernels: a null kernel or block size");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(carried, "kernels: carried must be a sequence of (cap, fn)");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_CAPS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "kernels: too many carried kernels");
        return NULL;
    }
    size_t caps[MAX_CAPS], last = 0;
    void *fns[MAX_CAPS];
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long cap, fn;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KK", &cap, &fn)) {
            Py_DECREF(seq);
            return NULL;
        }
        if (cap <= last || !fn || cap > 32768) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError,
                            "kernels: capacities must ascend up to 32 KiB, kernels be non-null");
            return NULL;
        }
        last = caps[i] = (size_t)cap;
        fns[i] = (void *)(uintptr_t)fn;
    }
    Py_DECREF(seq);
    memcpy(self->caps, caps, sizeof(caps));
    memcpy(self->carried, fns, sizeof(fns));
    self->ncaps = (int)n;
    self->scatter = (void *)(uintptr_t)scatter;
    self->threads = threads;
    Py_RETURN_NONE;
}

/* the kernel node of a pool entry: the whole-segment kernel, one block, its arguments
 * seg and cell (the driver copies them from args during the call) */
static KernelNodeParams node_params(Driver *self, unsigned long long args[2], void *params[2]) {
    params[0] = &args[0];
    params[1] = &args[1];
    KernelNodeParams np = {self->whole, 1, 1, 1, self->threads, 1, 1, 0, params, NULL, NULL,
                           NULL};
    return np;
}

/* make pool entry i (seg 0, cell 0, never launched): 0, or the failing call's CUresult
 * with nothing of it left */
static int make_entry(Driver *self, int i) {
    void *graph = NULL, *node = NULL, *exec = NULL;
    int rc = self->graph_create(&graph, 0);
    if (rc) return rc;
    unsigned long long args[2] = {0, 0};
    void *params[2];
    KernelNodeParams np = node_params(self, args, params);
    rc = self->graph_add_kernel(&node, graph, NULL, 0, &np);
    if (!rc) rc = self->graph_instantiate(&exec, graph, 0);
    if (rc) {
        self->graph_destroy(graph);
        return rc;
    }
    self->gkey[i] = (GraphKey){0, 0, NEVER_LAUNCHED};
    self->gused[i] = 0;
    self->ghandle[i] = (GraphHandles){exec, graph, node};
    return 0;
}

/* graphs(create, add_kernel_node, instantiate, launch, destroy, exec_destroy,
 * exec_set_params, kernel, cap): cuGraphCreate's, cuGraphAddKernelNode_v2's,
 * cuGraphInstantiateWithFlags', cuGraphLaunch's, cuGraphDestroy's, cuGraphExecDestroy's
 * and cuGraphExecKernelNodeSetParams_v2's addresses, the whole-segment kernel
 * (cucopy_scatter_w8k) and the bytes it reads. Makes the pool of GRAPH_POOL one-node
 * graphs now (the device's context must be current), the only graphs this Driver ever
 * makes. When making one fails, the pool is those made before it; when the first
 * fails, RuntimeError (its status attribute the CUresult) and nothing set: graphed()
 * launches nothing, as before graphs(). Needs kernels() first (the block size). */
static PyObject *Driver_graphs(Driver *self, PyObject *args) {
    unsigned long long f[8], cap = 0;
    if (!PyArg_ParseTuple(args, "KKKKKKKKK", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6],
                          &f[7], &cap))
        return NULL;
    for (int i = 0; i < 8; i++)
        if (!f[i]) {
            PyErr_SetString(PyExc_ValueError, "graphs: a null entry point or kernel");
            return NULL;
        }
    if (cap < 16 || cap % 16) {
        PyErr_SetString(PyExc_ValueError, "graphs: the capacity must be a multiple of 16");
        return NULL;
    }
    if (!self->threads) {
        PyErr_SetString(PyExc_RuntimeError, "graphs: kernels() first (the block size)");
        return NULL;
    }
    if (self->ngraphs) {
        PyErr_SetString(PyExc_RuntimeError, "graphs: already set, its graphs made");
        return NULL;
    }
    self->graph_create = (graph_create_fn)(uintptr_t)f[0];
    self->graph_add_kernel = (graph_add_kernel_fn)(uintptr_t)f[1];
    self->graph_instantiate = (graph_instantiate_fn)(uintptr_t)f[2];
    self->graph_destroy = (graph_destroy_fn)(uintptr_t)f[4];
    self->graph_exec_destroy = (graph_exec_destroy_fn)(uintptr_t)f[5];
    self->graph_set_params = (graph_exec_set_params_fn)(uintptr_t)f[6];
    self->whole = (void *)(uintptr_t)f[7];
    int rc = 0, n = 0;
    while (n < GRAPH_POOL && !(rc = make_entry(self, n))) n++;
    if (!n) {
        self->whole = NULL;
        PyObject *msg = PyUnicode_FromFormat(
            "graphs: making the pool's first graph failed: CUresult %d", rc);
        PyObject *e = msg ? PyObject_CallOneArg(PyExc_RuntimeError, msg) : NULL;
        Py_XDECREF(msg);
        PyObject *status = e ? PyLong_FromLong(rc) : NULL;
        if (status && PyObject_SetAttrString(e, "status", status) == 0)
            PyErr_SetObject(PyExc_RuntimeError, e);
        Py_XDECREF(status);
        Py_XDECREF(e);
        return NULL;
    }
    self->ngraphs = n; /* (a pool short of GRAPH_POOL: graph_count says so) */
    self->graph_launch = (graph_launch_fn)(uintptr_t)f[3];
    self->graph_cap = (size_t)cap;
    self->launcher.graph_cap = self->graph_cap;
    Py_RETURN_NONE;
}

/* the pool entry to launch for (stream, seg, cell) into *at: one pointed at (seg, cell)
 * and last launched on stream (or never launched), as it is; else the least recently
 * launched of those last launched on stream (or never), re-pointed at (seg, cell).
 * 0, -1 when no entry may be launched on stream, or the CUresult of re-pointing when
 * it failed (the entry left pointed where it was). */
static int graph_for(Driver *self, unsigned long long stream, unsigned long long seg,
                     unsigned long long cell, int *at) {
    const GraphKey *k = self->gkey;
    int n = self->ngraphs;
    for (int i = 0; i < n; i++)
        if (k[i].seg == seg && k[i].cell == cell &&
            (k[i].stream == stream || k[i].stream == NEVER_LAUNCHED)) {
            *at = i;
            return 0;
        }
    int lru = -1;
    unsigned long long when = ~0ULL;
    for (int i = 0; i < n; i++)
        if ((k[i].stream == stream || k[i].stream == NEVER_LAUNCHED) && self->gused[i] < when) {
            lru = i;
            when = self->gused[i];
        }
    if (lru < 0) return -1;
    unsigned long long args[2] = {seg, cell};
    void *params[2];
    KernelNodeParams np = node_params(self, args, params);
    self->graph_updates++;
    /* (an earlier launch of this executable, still queued or running, is unaffected) */
    int rc = self->graph_set_params(self->ghandle[lru].exec, self->ghandle[lru].node, &np);
    if (rc) return rc;
    self->gkey[lru].seg = seg;
    self->gkey[lru].cell = cell;
    *at = lru;
    return 0;
}

/* graphed_tag(stream, seg, cell) -> CUresult of cuGraphLaunch of a pool entry pointed at
 * seg and cell (or of re-pointing one there: cuGraphExecKernelNodeSetParams), -1 when
 * none launched (before graphs(), or every entry last launched on another stream: the
 * caller launches the segment another way), OTHER_CONTEXT when another context is
 * current. With cell (the device address of a slot's completion tag, pack.TAG_AT) the
 * kernel copies cell[0] to cell[1] once its reads of the segment are done: no event
 * need follow it. Never makes a graph. */
static int graphed_tag_impl(void *drv, unsigned long long stream, unsigned long long seg,
                            unsigned long long cell) {
    Driver *self = (Driver *)drv;
    if (!self->graph_launch) return -1;
    if (!same_context(self)) return OTHER_CONTEXT;
    int i = 0;
    int rc = graph_for(self, stream, seg, cell, &i);
    if (rc) return rc; /* none usable (-1), or SetParams' CUresult */
    /* the entry is this stream's from now on, launched or not (a failed launch may
     * still have reached the stream: it is never handed to another) */
    self->gkey[i].stream = stream;
    self->gused[i] = ++self->graph_clock;
    /* the GIL is held throughout (see the top of this file) */
    return self->graph_launch(self->ghandle[i].exec, (void *)(uintptr_t)stream);
}

/* graphed(stream, seg): graphed_tag with no tag (its slot's event must follow it) */
static int graphed_impl(void *drv, unsigned long long stream, unsigned long long seg) {
    return graphed_tag_impl(drv, stream, seg, 0);
}

/* the n unsigned integer arguments of a call into v; -1 (an exception set) when
 * their count or one of them is wrong */
static int ull_args(PyObject *const *args, Py_ssize_t nargs, int n, unsigned long long *v,
                    const char *usage) {
    if (nargs != n) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        v[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (v[i] == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* the capture query as the launcher's C function: the CUresult, *status set */
static int capturing_impl(void *drv, unsigned long long stream, int *status) {
    Driver *self = (Driver *)drv;
    if (!same_context(self)) return OTHER_CONTEXT;
    return self->capturing((void *)(uintptr_t)stream, status);
}

/* is_capturing(stream) -> int: the capture status (0 none, 1 active, 2 invalidated),
 * or -CUresult when the query failed */
static PyObject *Driver_is_capturing(Driver *self, PyObject *arg) {
    unsigned long long stream = PyLong_AsUnsignedLongLong(arg);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!same_context(self)) return PyLong_FromLong(OTHER_CONTEXT_STATUS);
    int status = 0;
    int rc = self->capturing((void *)(uintptr_t)stream, &status);
    return PyLong_FromLong(rc ? -(long)rc : (long)status);
}

/* the carried kernel (its index in caps) of the smallest capacity holding nbytes, or
 * -1 when none does or the grid is out of range */
static int carry_kernel(Driver *self, unsigned long long nblocks, size_t nbytes) {
    int k = 0;
    while (k < self->ncaps && self->caps[k] < nbytes) k++;
    if (k == self->ncaps || nblocks == 0 || nblocks > 0x7fffffffULL || !self->threads) return -1;
    return k;
}

/* write the prefix {seg, nbytes, 0} at buf (8-byte aligned, as the kernel's parameter
 * struct is; the carried bytes follow it) and launch carried kernel k on it: the
 * driver reads PREFIX + caps[k] bytes from buf during the call. The kernel reads only
 * the bytes carried; the rest of the capacity is left as is. */
static int launch_prefixed(Driver *self, int k, unsigned long long nblocks,
                           unsigned long long stream, char *buf, unsigned long long seg,
                           size_t nbytes) {
    uint32_t counts[2] = {(uint32_t)nbytes, 0};
    memcpy(buf, &seg, 8);
    memcpy(buf + 8, counts, 8);
    size_t size = PREFIX + self->caps[k];
    void *extra[5] = {PARAM_BUFFER_POINTER, buf, PARAM_BUFFER_SIZE, &size, PARAM_END};
    /* the GIL is held throughout (see the top of this file) */
    return self->launch(self->carried[k], (unsigned)nblocks, 1, 1, self->threads, 1, 1, 0,
                        (void *)(uintptr_t)stream, NULL, extra);
}

/* launch_prefixed on a copy of host's nbytes in a parameter buffer of its own */
static int launch_copied(Driver *self, int k, unsigned long long nblocks,
                         unsigned long long stream, unsigned long long seg, const void *host,
                         size_t nbytes) {
    uint64_t buf[(PREFIX + 32768) / 8]; /* capacities are at most 32 KiB (kernels()) */
    memcpy((char *)buf + PREFIX, host, nbytes);
    return launch_prefixed(self, k, nblocks, stream, (char *)buf, seg, nbytes);
}

/* carried(nblocks, stream, seg, host, nbytes) -> CUresult, or -1 when no capacity
 * holds nbytes (or the grid is out of range), OTHER_CONTEXT when another context is
 * current. Copies nbytes from host into a parameter buffer after the prefix
 * {seg, nbytes, 0} and launches the smallest carried kernel that holds them; the
 * driver takes the buffer during the call. */
static int carried_impl(void *drv, unsigned long long nblocks, unsigned long long stream,
                        unsigned long long seg, const void *host, size_t nbytes) {
    Driver *self = (Driver *)drv;
    int k = carry_kernel(self, nblocks, nbytes);
    if (k < 0) return -1;
    if (!same_context(self)) return OTHER_CONTEXT;
    return launch_copied(self, k, nblocks, stream, seg, host, nbytes);
}

/* carried() launching from the caller's bytes: the prefix is written into the PREFIX
 * bytes before host (the caller's, unread by anything else during the call) and the
 * driver reads host - PREFIX on, when readable covers the kernel's whole capacity;
 * otherwise a copy, as carried_impl. */
static int carried_at_impl(void *drv, unsigned long long nblocks, unsigned long long stream,
                           unsigned long long seg, char *host, size_t nbytes, size_t readable) {
    Driver *self = (Driver *)drv;
    int k = carry_kernel(self, nblocks, nbytes);
    if (k < 0) return -1;
    if (!same_context(self)) return OTHER_CONTEXT;
    if (readable < self->caps[k]) return launch_copied(self, k, nblocks, stream, seg, host, nbytes);
    return launch_prefixed(self, k, nblocks, stream, host - PREFIX, seg, nbytes);
}

static PyObject *Driver_carried(Driver *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long v[5];
    if (ull_args(args, nargs, 5, v, "carried(nblocks, stream, seg, host, nbytes)") < 0)
        return NULL;
    return PyLong_FromLong(
        carried_impl(self, v[0], v[1], v[2], (const void *)(uintptr_t)v[3], (size_t)v[4]));
}

/* record(event, stream) -> CUresult of cuEventRecord, or -1 before events(),
 * OTHER_CONTEXT when another context is current */
static int record_impl(void *drv, unsigned long long event, unsigned long long stream) {
    Driver *self = (Driver *)drv;
    if (!self->event_record) return -1;
    if (!same_context(self)) return OTHER_CONTEXT;
    /* the GIL is held throughout (see the top of this file) */
    return self->event_record((void *)(uintptr_t)event, (void *)(uintptr_t)stream);
}

/* query(event) -> CUresult of cuEventQuery (0 complete, 600 not ready), or -1 before
 * events(), OTHER_CONTEXT when another context is current */
static int query_impl(void *drv, unsigned long long event) {
    Driver *self = (Driver *)drv;
    if (!self->event_query) return -1;
    if (!same_context(self)) return OTHER_CONTEXT;
    return self->event_query((void *)(uintptr_t)event);
}

/* copy(dst, dpitch, src, spitch, width, rows, stream) -> CUresult of one H2D copy
 * (cuMemcpyHtoDAsync for one row, cuMemcpy2DAsync for several), or a negative value
 * when it copied nothing: -1 before copies() or for a pitch past the 2-D limit,
 * OTHER_CONTEXT when another context is current */
static int copy_impl(void *drv, unsigned long long dst, unsigned long long dpitch,
                     const void *src, unsigned long long spitch, unsigned long long width,
                     unsigned long long rows, unsigned long long stream) {
    Driver *self = (Driver *)drv;
    if (!self->htod || !self->copy2d || !width || !rows) return -1;
    if (!same_context(self)) return OTHER_CONTEXT;
    void *st = (void *)(uintptr_t)stream;
    if (rows == 1) return self->htod(dst, src, (size_t)width, st);
    if (dpitch > MAX_2D_PITCH || spitch > MAX_2D_PITCH) return -1;
    Memcpy2D p;
    memset(&p, 0, sizeof p);
    p.srcMemoryType = MEMORYTYPE_HOST;
    p.srcHost = src;
    p.srcPitch = (size_t)spitch;
    p.dstMemoryType = MEMORYTYPE_DEVICE;
    p.dstDevice = dst;
    p.dstPitch = (size_t)dpitch;
    p.WidthInBytes = (size_t)width;
    p.Height = (size_t)rows;
    return self->copy2d(&p, st);
}

static PyObject *Driver_copy(Driver *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long v[7];
    if (ull_args(args, nargs, 7, v, "copy(dst, dpitch, src, spitch, width, rows, stream)") < 0)
        return NULL;
    return PyLong_FromLong(
        copy_impl(self, v[0], v[1], (const void *)(uintptr_t)v[2], v[3], v[4], v[5], v[6]));
}

static PyObject *Driver_event_record(Driver *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long v[2];
    if (ull_args(args, nargs, 2, v, "event_record(event, stream)") < 0) return NULL;
    return PyLong_FromLong(record_impl(self, v[0], v[1]));
}

static PyObject *Driver_graphed(Driver *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long v[3] = {0, 0, 0};
    if (ull_args(args, nargs, nargs == 3 ? 3 : 2, v, "graphed(stream, seg[, cell])") < 0)
        return NULL;
    return PyLong_FromLong(graphed_tag_impl(self, v[0], v[1], v[2]));
}

static PyObject *Driver_graph_count(Driver *self, void *unused) {
    return PyLong_FromLong(self->ngraphs);
}

static PyObject *Driver_graph_updates(Driver *self, void *unused) {
    return PyLong_FromUnsignedLongLong(self->graph_updates);
}

static PyObject *Driver_graph_cap(Driver *self, void *unused) {
    return PyLong_FromSize_t(self->graph_cap);
}

static PyGetSetDef Driver_getset[] = {
    {"graph_count", (getter)Driver_graph_count, NULL,
     "Graphs made: the pool graphs() made (GRAPH_POOL, fewer where making one failed; 0 "
     "before graphs()). None is made after it.",
     NULL},
    {"graph_updates", (getter)Driver_graph_updates, NULL,
     "cuGraphExecKernelNodeSetParams calls: pool entries re-pointed at another segment "
     "and tag (a refused call counted too).",
     NULL},
    {"graph_cap", (getter)Driver_graph_cap, NULL,
     "Bytes a graphed launch reads at its segment (0 before graphs()).", NULL},
    {NULL},
};

static PyObject *Driver_event_query(Driver *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long v[1];
    if (ull_args(args, nargs, 1, v, "event_query(event)") < 0) return NULL;
    return PyLong_FromLong(query_impl(self, v[0]));
}

/* event_wait(event, timeout_ns) -> CUresult of the last cuEventQuery: 0 complete, 600
 * (not ready) when timeout_ns passed first, OTHER_CONTEXT / -1 as query(). A bounded
 * host wait (cucopy/deadline.py): cuEventQuery, then a sleep with the GIL released
 * (nanosleep, 20 us doubling to 1 ms: never a spin, and cuEventSynchronize's blocking
 * sync would have no bound), until the event completes or the deadline passes.
 * Signals are checked between sleeps: Ctrl-C ends the wait with KeyboardInterrupt
 * (NULL returned, the exception set). */
static PyObject *Driver_event_wait(Driver *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long v[2];
    if (ull_args(args, nargs, 2, v, "event_wait(event, timeout_ns)") < 0) return NULL;
    int rc = query_impl(self, v[0]);
    if (rc != 600) return PyLong_FromLong(rc);
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long long delay = 20000; /* ns */
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        unsigned long long spent = (unsigned long long)(now.tv_sec - t0.tv_sec) * 1000000000ULL +
                                   (unsigned long long)(now.tv_nsec - t0.tv_nsec);
        if (spent >= v[1]) return PyLong_FromLong(query_impl(self, v[0]));
        unsigned long long left = v[1] - spent;
        struct timespec d = {0, (long)((unsigned long long)delay < left ? delay : (long long)left)};
        Py_BEGIN_ALLOW_THREADS
        nanosleep(&d, NULL);
        Py_END_ALLOW_THREADS
        if (PyErr_CheckSignals() < 0) return NULL;
        rc = query_impl(self, v[0]);
        if (rc != 600) return PyLong_FromLong(rc);
        if (delay < 1000000) delay *= 2;
        if (delay > 1000000) delay = 1000000;
    }
}

/* launcher() -> a capsule of the carried launch and the event calls as C functions
 * (CarriedLauncher), holding this Driver alive; the event calls answer -1 until
 * events() */
static void launcher_free(PyObject *cap) { Py_XDECREF((PyObject *)PyCapsule_GetContext(cap)); }

static PyObject *Driver_launcher(Driver *self, PyObject *Py_UNUSED(unused)) {
    self->launcher.carried = carried_impl;
    self->launcher.drv = self;
    self->launcher.abi = LAUNCHER_ABI;
    self->launcher.record = record_impl;
    self->launcher.query = query_impl;
    self->launcher.carried_at = carried_at_impl;
    self->launcher.graphed = graphed_impl;
    self->launcher.capturing = capturing_impl;
    self->launcher.copy = copy_impl;
    self->launcher.graph_cap = self->graph_cap;
    self->launcher.graphed_tag = graphed_tag_impl;
    PyObject *cap = PyCapsule_New(&self->launcher, LAUNCHER_NAME, launcher_free);
    if (!cap) return NULL;
    if (PyCapsule_SetContext(cap, Py_NewRef(self)) < 0) {
        Py_DECREF(self);
        Py_DECREF(cap);
        return NULL;
    }
    return cap;
}

/* scatter(nblocks, stream, seg) -> CUresult: the kernel that reads the segment at seg */
static PyObject *Driver_scatter(Driver *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long v[3];
    if (ull_args(args, nargs, 3, v, "scatter(nblocks, stream, seg)") < 0) return NULL;
    if (v[0] == 0 || v[0] > 0x7fffffffULL || !self->scatter) return PyLong_FromLong(-1);
    if (!same_context(self)) return PyLong_FromLong(OTHER_CONTEXT);
    uint64_t seg = v[2];
    void *params[1] = {&seg};
    int rc = self->launch(self->scatter, (unsigned)v[0], 1, 1, self->threads, 1, 1, 0,
                          (void *)(uintptr_t)v[1], params, NULL);
    return PyLong_FromLong(rc);
}

static PyMethodDef Driver_methods[] = {
    {"kernels", (PyCFunction)Driver_kernels, METH_VARARGS,
     "kernels(scatter, carried, threads): the kernels to launch ((capacity, CUfunction) pairs)."},
    {"bind", (PyCFunction)Driver_bind, METH_VARARGS,
     "bind(ctx_get_current, ctx): check the current context is ctx before every call."},
    {"events", (PyCFunction)Driver_events, METH_VARARGS,
     "events(record, query): cuEventRecord's and cuEventQuery's addresses."},
    {"copies", (PyCFunction)Driver_copies, METH_VARARGS,
     "copies(htod, copy2d): cuMemcpyHtoDAsync_v2's and cuMemcpy2DAsync_v2's addresses."},
    {"copy", (PyCFunction)(void (*)(void))Driver_copy, METH_FASTCALL,
     "copy(dst, dpitch, src, spitch, width, rows, stream) -> CUresult of one H2D copy; "
     "-1 before copies() or for a pitch past the 2-D limit."},
    {"launcher", (PyCFunction)Driver_launcher, METH_NOARGS,
     "launcher() -> a capsule of the carried launch and event calls for the staging core."},
    {"is_capturing", (PyCFunction)Driver_is_capturing, METH_O,
     "is_capturing(stream) -> capture status (0, 1, 2), or -CUresult on failure."},
    {"carried", (PyCFunction)(void (*)(void))Driver_carried, METH_FASTCALL,
     "carried(nblocks, stream, seg, host, nbytes) -> CUresult; -1 when nothing holds nbytes."},
    {"scatter", (PyCFunction)(void (*)(void))Driver_scatter, METH_FASTCALL,
     "scatter(nblocks, stream, seg) -> CUresult; -1 for a grid out of range."},
    {"event_record", (PyCFunction)(void (*)(void))Driver_event_record, METH_FASTCALL,
     "event_record(event, stream) -> CUresult of cuEventRecord; -1 before events()."},
    {"graphs", (PyCFunction)Driver_graphs, METH_VARARGS,
     "graphs(create, add_kernel_node, instantiate, launch, destroy, exec_destroy, "
     "exec_set_params, kernel, cap): the graph entry points and the whole-segment kernel; "
     "makes the pool of GRAPH_POOL one-node graphs now (the device's context current)."},
    {"graphed", (PyCFunction)(void (*)(void))Driver_graphed, METH_FASTCALL,
     "graphed(stream, seg[, cell]) -> CUresult of launching a pool graph pointed at seg "
     "(and at the completion tag at cell: its kernel copies cell[0] to cell[1] when done), "
     "or of re-pointing one; -1: none launched (every graph another stream's)."},
    {"event_query", (PyCFunction)(void (*)(void))Driver_event_query, METH_FASTCALL,
     "event_query(event) -> CUresult of cuEventQuery (0, 600: not ready); -1 before events()."},
    {"event_wait", (PyCFunction)(void (*)(void))Driver_event_wait, METH_FASTCALL,
     "event_wait(event, timeout_ns) -> CUresult of the last cuEventQuery (600: the deadline "
     "passed); sleeps between queries (20 us doubling to 1 ms) with the GIL released."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject DriverType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cucopy.backends._cudacall.Driver",
    .tp_basicsize = sizeof(Driver),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Driver(launch, is_capturing): the CUDA backend's per-step driver calls, made "
              "from C (cuLaunchKernel's and cuStreamIsCapturing's addresses).",
    .tp_methods = Driver_methods,
    .tp_getset = Driver_getset,
    .tp_dealloc = (destructor)Driver_dealloc,
    .tp_init = (initproc)Driver_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cucopy.backends._cudacall",
    .m_doc = "The CUDA backend's per-step driver calls, made from C (see cuda.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__cudacall(void) {
    if (PyType_Ready(&DriverType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&DriverType);
    if (PyModule_AddObject(m, "Driver", (PyObject *)&DriverType) < 0) {
        Py_DECREF(&DriverType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "PREFIX", PREFIX) < 0 ||
        PyModule_AddIntConstant(m, "OTHER_CONTEXT", OTHER_CONTEXT) < 0 ||
        PyModule_AddIntConstant(m, "GRAPH_POOL", GRAPH_POOL) < 0 ||
        PyModule_AddIntConstant(m, "OTHER_CONTEXT_STATUS", OTHER_CONTEXT_STATUS) < 0 ||
        PyModule_AddIntConstant(m, "LAUNCHER_ABI", LAUNCHER_ABI) < 0 ||
        PyModule_AddStringConstant(m, "LAUNCHER_NAME", LAUNCHER_NAME) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
