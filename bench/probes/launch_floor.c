/*
 * launch_floor.c: what the CUDA driver itself charges the host for one stream operation.
 *
 * Built and run by launch_floor.py, which compiles the kernels (its KERNELS string) to a
 * cubin with NVRTC:
 *
 *     gcc -O2 -std=c11 -Wall -Wextra -o launch_floor launch_floor.c -ldl
 *     ./launch_floor kernels.cubin [out.json]
 *
 * No CUDA headers: the few driver types, constants and entry points used are declared
 * here (layouts as in cuda.h of CUDA 12/13) and looked up in libcuda.so.1 at run time.
 * Each variant is one driver call on one non-blocking stream of device 0's primary
 * context, timed with CLOCK_MONOTONIC around that call alone, in three regimes:
 *
 *   drained  the stream synchronized before each timed call;
 *   busy     a ~30 us spin kernel queued first, the timed call queued behind it;
 *   burst    BURST calls back to back timed together, divided by BURST.
 *
 * Prints one line per variant and regime (median, p10, p90 in microseconds) and, with a
 * second argument, writes a summary of every sample set as JSON to that path. A variant
 * whose setup or first call fails is reported as unavailable, with the CUresult.
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- driver types (cuda.h) ------------------------------------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr; /* CUdeviceptr_v2: 64-bit */
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUkern_st *CUkernel;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUlaunchAttribute_st CUlaunchAttribute; /* only ever passed as NULL */

/* CUlaunchConfig (CUlaunchConfig_st): 7 unsigned, then the stream at offset 32 (8-byte
 * aligned), attrs at 40, numAttrs at 48; 56 bytes. */
typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ;
    unsigned blockDimX, blockDimY, blockDimZ;
    unsigned sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned numAttrs;
} CUlaunchConfig;

/* CUDA_KERNEL_NODE_PARAMS_v2. The v1 struct (taken by the unsuffixed
 * cuGraphAddKernelNode) is this one's prefix up to and including `extra`. */
typedef struct {
    CUfunction func;
    unsigned gridDimX, gridDimY, gridDimZ;
    unsigned blockDimX, blockDimY, blockDimZ;
    unsigned sharedMemBytes;
    void **kernelParams;
    void **extra;
    CUkernel kern;
    CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS;

_Static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig layout");
_Static_assert(sizeof(CUDA_KERNEL_NODE_PARAMS) == 72, "CUDA_KERNEL_NODE_PARAMS_v2 layout");

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_NOT_FOUND 500
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_LAUNCH_PARAM_END ((void *)0x00)
#define CU_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define CU_LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)

/* Not a driver code: the entry point is not exported by this driver. */
#define ERR_NO_SYMBOL (-1)

/* ---- driver entry points -------------------------------------------------------- */

typedef CUresult (*PFN_cuInit)(unsigned);
typedef CUresult (*PFN_cuDriverGetVersion)(int *);
typedef CUresult (*PFN_cuDeviceGet)(CUdevice *, int);
typedef CUresult (*PFN_cuDeviceGetName)(char *, int, CUdevice);
typedef CUresult (*PFN_cuDeviceGetAttribute)(int *, int, CUdevice);
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
typedef CUresult (*PFN_cuCtxSetCurrent)(CUcontext);
typedef CUresult (*PFN_cuCtxGetCurrent)(CUcontext *);
typedef CUresult (*PFN_cuCtxSynchronize)(void);
typedef CUresult (*PFN_cuGetErrorString)(CUresult, const char **);
typedef CUresult (*PFN_cuGetErrorName)(CUresult, const char **);
typedef CUresult (*PFN_cuModuleLoadData)(CUmodule *, const void *);
typedef CUresult (*PFN_cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
typedef CUresult (*PFN_cuStreamCreate)(CUstream *, unsigned);
typedef CUresult (*PFN_cuStreamSynchronize)(CUstream);
typedef CUresult (*PFN_cuStreamQuery)(CUstream);
typedef CUresult (*PFN_cuStreamIsCapturing)(CUstream, int *);
typedef CUresult (*PFN_cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                       unsigned, unsigned, unsigned, CUstream, void **,
                                       void **);
typedef CUresult (*PFN_cuLaunchKernelEx)(const CUlaunchConfig *, CUfunction, void **,
                                         void **);
typedef CUresult (*PFN_cuMemHostAlloc)(void **, size_t, unsigned);
typedef CUresult (*PFN_cuMemAlloc)(CUdeviceptr *, size_t);
typedef CUresult (*PFN_cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
typedef CUresult (*PFN_cuEventCreate)(CUevent *, unsigned);
typedef CUresult (*PFN_cuEventRecord)(CUevent, CUstream);
typedef CUresult (*PFN_cuEventQuery)(CUevent);
typedef CUresult (*PFN_cuEventSynchronize)(CUevent);
typedef CUresult (*PFN_cuStreamWriteValue32)(CUstream, CUdeviceptr, uint32_t, unsigned);
typedef CUresult (*PFN_cuGraphCreate)(CUgraph *, unsigned);
typedef CUresult (*PFN_cuGraphAddKernelNode)(CUgraphNode *, CUgraph, const CUgraphNode *,
                                             size_t, const CUDA_KERNEL_NODE_PARAMS *);
typedef CUresult (*PFN_cuGraphInstantiateWithFlags)(CUgraphExec *, CUgraph,
                                                    unsigned long long);
typedef CUresult (*PFN_cuGraphLaunch)(CUgraphExec, CUstream);
typedef CUresult (*PFN_cuGraphExecKernelNodeSetParams)(CUgraphExec, CUgraphNode,
                                                       const CUDA_KERNEL_NODE_PARAMS *);
typedef CUresult (*PFN_cuEventElapsedTime)(float *, CUevent, CUevent);

static struct {
    PFN_cuInit Init;
    PFN_cuDriverGetVersion DriverGetVersion;
    PFN_cuDeviceGet DeviceGet;
    PFN_cuDeviceGetName DeviceGetName;
    PFN_cuDeviceGetAttribute DeviceGetAttribute;
    PFN_cuDevicePrimaryCtxRetain DevicePrimaryCtxRetain;
    PFN_cuCtxSetCurrent CtxSetCurrent;
    PFN_cuCtxGetCurrent CtxGetCurrent;
    PFN_cuCtxSynchronize CtxSynchronize;
    PFN_cuGetErrorString GetErrorString;
    PFN_cuGetErrorName GetErrorName;
    PFN_cuModuleLoadData ModuleLoadData;
    PFN_cuModuleGetFunction ModuleGetFunction;
    PFN_cuStreamCreate StreamCreate;
    PFN_cuStreamSynchronize StreamSynchronize;
    PFN_cuStreamQuery StreamQuery;
    PFN_cuStreamIsCapturing StreamIsCapturing;
    PFN_cuLaunchKernel LaunchKernel;
    PFN_cuLaunchKernelEx LaunchKernelEx;
    PFN_cuMemHostAlloc MemHostAlloc;
    PFN_cuMemAlloc MemAlloc;
    PFN_cuMemcpyHtoDAsync MemcpyHtoDAsync;
    PFN_cuEventCreate EventCreate;
    PFN_cuEventRecord EventRecord;
    PFN_cuEventQuery EventQuery;
    PFN_cuEventSynchronize EventSynchronize;
    PFN_cuStreamWriteValue32 StreamWriteValue32;
    PFN_cuGraphCreate GraphCreate;
    PFN_cuGraphAddKernelNode GraphAddKernelNode;
    PFN_cuGraphInstantiateWithFlags GraphInstantiateWithFlags;
    PFN_cuGraphLaunch GraphLaunch;
    PFN_cuGraphExecKernelNodeSetParams GraphExecKernelNodeSetParams;
    PFN_cuEventElapsedTime EventElapsedTime;
} api;

/* Names each entry point was found under (for the report). */
static const char *found_write_value32 = "";
static const char *found_add_kernel_node = "";
static const char *found_exec_set_params = "";

static void *lib;

/* First of `names` that libcuda exports, or NULL; its name goes to *found. */
static void *find_sym(const char *const *names, const char **found) {
    for (; *names; names++) {
        void *p = dlsym(lib, *names);
        if (p) {
            if (found) *found = *names;
            return p;
        }
    }
    return NULL;
}

/* Look up api.FIELD under the listed names, in order. The plain names that cuda.h maps to
 * a _v2 symbol (cuMemAlloc, cuMemcpyHtoDAsync) are the 32-bit v1 entry points and are
 * never used; no _ptsz (per-thread default stream) name is used. */
#define LOAD(field, found, ...)                                                       \
    do {                                                                              \
        static const char *const names_[] = {__VA_ARGS__, NULL};                      \
        void *p_ = find_sym(names_, found);                                           \
        _Static_assert(sizeof api.field == sizeof p_, "function pointer size");       \
        memcpy(&api.field, &p_, sizeof p_); /* POSIX: dlsym'd code address */         \
    } while (0)

static void load_api(void) {
    LOAD(Init, NULL, "cuInit");
    LOAD(DriverGetVersion, NULL, "cuDriverGetVersion");
    LOAD(DeviceGet, NULL, "cuDeviceGet");
    LOAD(DeviceGetName, NULL, "cuDeviceGetName");
    LOAD(DeviceGetAttribute, NULL, "cuDeviceGetAttribute");
    LOAD(DevicePrimaryCtxRetain, NULL, "cuDevicePrimaryCtxRetain");
    LOAD(CtxSetCurrent, NULL, "cuCtxSetCurrent");
    LOAD(CtxGetCurrent, NULL, "cuCtxGetCurrent");
    LOAD(CtxSynchronize, NULL, "cuCtxSynchronize");
    LOAD(GetErrorString, NULL, "cuGetErrorString");
    LOAD(GetErrorName, NULL, "cuGetErrorName");
    LOAD(ModuleLoadData, NULL, "cuModuleLoadData");
    LOAD(ModuleGetFunction, NULL, "cuModuleGetFunction");
    LOAD(StreamCreate, NULL, "cuStreamCreate");
    LOAD(StreamSynchronize, NULL, "cuStreamSynchronize");
    LOAD(StreamQuery, NULL, "cuStreamQuery");
    LOAD(StreamIsCapturing, NULL, "cuStreamIsCapturing");
    LOAD(LaunchKernel, NULL, "cuLaunchKernel");
    LOAD(LaunchKernelEx, NULL, "cuLaunchKernelEx");
    LOAD(MemHostAlloc, NULL, "cuMemHostAlloc");
    LOAD(MemAlloc, NULL, "cuMemAlloc_v2");
    LOAD(MemcpyHtoDAsync, NULL, "cuMemcpyHtoDAsync_v2");
    LOAD(EventCreate, NULL, "cuEventCreate");
    LOAD(EventRecord, NULL, "cuEventRecord");
    LOAD(EventQuery, NULL, "cuEventQuery");
    LOAD(EventSynchronize, NULL, "cuEventSynchronize");
    LOAD(StreamWriteValue32, &found_write_value32, "cuStreamWriteValue32_v2",
         "cuStreamWriteValue32");
    LOAD(GraphCreate, NULL, "cuGraphCreate");
    LOAD(GraphAddKernelNode, &found_add_kernel_node, "cuGraphAddKernelNode_v2",
         "cuGraphAddKernelNode");
    LOAD(GraphInstantiateWithFlags, NULL, "cuGraphInstantiateWithFlags");
    LOAD(GraphLaunch, NULL, "cuGraphLaunch");
    /* the _v2 entry point takes CUDA_KERNEL_NODE_PARAMS_v2; the v1 one its prefix */
    LOAD(GraphExecKernelNodeSetParams, &found_exec_set_params,
         "cuGraphExecKernelNodeSetParams_v2", "cuGraphExecKernelNodeSetParams");
    LOAD(EventElapsedTime, NULL, "cuEventElapsedTime_v2", "cuEventElapsedTime");
}

static const char *err_name(CUresult r) {
    const char *s = NULL;
    if (r == ERR_NO_SYMBOL) return "ENTRY_POINT_NOT_FOUND";
    if (!api.GetErrorName || api.GetErrorName(r, &s) != CUDA_SUCCESS || !s) return "?";
    return s;
}

static const char *err_string(CUresult r) {
    const char *s = NULL;
    if (r == ERR_NO_SYMBOL) return "entry point not exported by this driver";
    if (!api.GetErrorString || api.GetErrorString(r, &s) != CUDA_SUCCESS || !s)
        return "unknown error";
    return s;
}

static void die(const char *what, CUresult r) {
    fprintf(stderr, "launch_floor: %s failed: CUresult %d %s (%s)\n", what, r, err_name(r),
            err_string(r));
    exit(1);
}

#define CHECK_FATAL(call, what)                                                       \
    do {                                                                              \
        CUresult r_ = (call);                                                         \
        if (r_ != CUDA_SUCCESS) die(what, r_);                                        \
    } while (0)

/* ---- measurement settings ------------------------------------------------------- */

#define BLOCK 256
#define WARMUP_DRAINED 200
#define WARMUP_BUSY 100
#define WARMUP_BURST 50
#define R_DRAINED 2000
#define R_BUSY 1000
#define R_BURST 500
#define R_MAX 2000
#define BURST 8
#define SPIN_NS 30000ULL

/* Kernel parameter capacities of the k_1k .. k_32k kernels: 16 + CAP bytes of params. */
#define CAP_1K 1008
#define CAP_6K 6128
#define CAP_20K 20464
#define CAP_32K 32736
#define COPY_SMALL 4
#define COPY_LARGE 20480
#define DBUF_BYTES 65536 /* device buffer: copies land at 0, the 32-bit writes at 32 KiB */
#define DBUF_WRITE_OFFSET 32768

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* ---- shared state --------------------------------------------------------------- */

static struct {
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUstream stream;
    CUfunction spin;
    CUdeviceptr dbuf;
    void *hbuf;
    CUevent ev_record;
    CUevent ev_done;
    CUgraphExec graph_exec;
    uint32_t write_counter;
    CUevent ev_gpu0, ev_gpu1; /* timing events of the gpu regime */
} g;

/* {u64 a; u32 n; u32 r; unsigned char b[CAP];}: built in a byte buffer of 16 + CAP. */
typedef struct {
    unsigned char *buf;
    size_t size;
    void *extra[5];
} big_params;

typedef struct variant variant;
typedef CUresult (*call_fn)(variant *);

enum { DRAINED, BUSY, BURST_REGIME, ANY, GPU, N_REGIMES };
static const char *const regime_names[N_REGIMES] = {"drained", "busy", "burst", "any", "gpu"};

typedef struct {
    int ran;          /* measured */
    CUresult err;     /* a call that failed during the measurement, else CUDA_SUCCESS */
    const char *where;
    int count;
    double median, p10, p90, mean, min;
    int busy_seen;    /* busy regime: reps where the stream was still busy after the call */
} summary;

struct variant {
    const char *name;
    const char *what;
    int stream_op;    /* 0: not a stream operation, timed once (regime "any") */
    int not_ready_ok; /* CUDA_ERROR_NOT_READY is an answer, not a failure */
    call_fn call;
    /* launch variants */
    const char *kernel;
    size_t cap;       /* k_1k .. k_32k: the b[CAP] of the parameter struct */
    big_params big;
    unsigned grid;
    void **params;
    void **extra;
    CUfunction f;
    CUlaunchConfig cfg;
    /* graph variants: an instantiated graph of one kernel node, its node and params */
    CUgraphExec exec;
    CUgraphNode node;
    CUDA_KERNEL_NODE_PARAMS np;
    unsigned flip;
    int gpu; /* also time the call's GPU work (the gpu regime) */
    /* copies */
    size_t bytes;
    /* outcome */
    int available;
    CUresult setup_err;
    const char *setup_where;
    summary res[N_REGIMES];
};

/* ---- the timed calls ------------------------------------------------------------ */

static CUresult call_launch(variant *v) {
    return api.LaunchKernel(v->f, v->grid, 1, 1, BLOCK, 1, 1, 0, g.stream, v->params,
                            v->extra);
}

static CUresult call_launch_ex(variant *v) {
    return api.LaunchKernelEx(&v->cfg, v->f, v->params, NULL);
}

static CUresult call_memcpy(variant *v) {
    return api.MemcpyHtoDAsync(g.dbuf, g.hbuf, v->bytes, g.stream);
}

static CUresult call_event_record(variant *v) {
    (void)v;
    return api.EventRecord(g.ev_record, g.stream);
}

static CUresult call_event_query_done(variant *v) {
    (void)v;
    return api.EventQuery(g.ev_done);
}

static CUresult call_stream_query(variant *v) {
    (void)v;
    return api.StreamQuery(g.stream);
}

static CUresult call_stream_is_capturing(variant *v) {
    (void)v;
    int status = 0;
    return api.StreamIsCapturing ? api.StreamIsCapturing(g.stream, &status)
                                 : CUDA_ERROR_NOT_FOUND;
}

static CUresult call_write_value32(variant *v) {
    (void)v;
    return api.StreamWriteValue32(g.stream, g.dbuf + DBUF_WRITE_OFFSET, ++g.write_counter, 0);
}

static CUresult call_graph_launch(variant *v) {
    (void)v;
    return api.GraphLaunch(g.graph_exec, g.stream);
}

/* the node's parameters set anew (the grid alternating between grid and grid + 1, one
 * carried byte changed) and the graph launched: a launch whose parameters change every
 * step, through the graph path */
static CUresult call_graph_set(variant *v) {
    v->flip ^= 1;
    v->np.gridDimX = v->grid + v->flip;
    if (v->big.buf) v->big.buf[16] ^= 1;
    CUresult r = api.GraphExecKernelNodeSetParams(v->exec, v->node, &v->np);
    if (r != CUDA_SUCCESS) return r;
    return api.GraphLaunch(v->exec, g.stream);
}

/* the parameter update alone (no stream operation) */
static CUresult call_graph_set_only(variant *v) {
    v->flip ^= 1;
    v->np.gridDimX = v->grid + v->flip;
    if (v->big.buf) v->big.buf[16] ^= 1;
    return api.GraphExecKernelNodeSetParams(v->exec, v->node, &v->np);
}

/* a step's 6 KB rewritten by the host (as a copier stages it), then carried in the
 * launch's parameters */
static CUresult call_carried_write(variant *v) {
    v->flip ^= 1;
    memset(v->big.buf + 16, (int)(v->flip + 1), 6144 - 16);
    return api.LaunchKernel(v->f, 1, 1, 1, BLOCK, 1, 1, 0, g.stream, NULL, v->extra);
}

/* the same 6 KB rewritten in mapped pinned memory, then the graph whose node reads it */
static CUresult call_graph_whole(variant *v) {
    v->flip ^= 1;
    memset(g.hbuf, (int)(v->flip + 1), 6144);
    return api.GraphLaunch(v->exec, g.stream);
}

/* the graph launched as instantiated (its parameters fixed) */
static CUresult call_graph_fixed(variant *v) { return api.GraphLaunch(v->exec, g.stream); }

static CUresult call_ctx_get_current(variant *v) {
    (void)v;
    CUcontext c;
    return api.CtxGetCurrent(&c);
}

static CUresult call_nothing(variant *v) {
    (void)v;
    return CUDA_SUCCESS;
}

/* ---- parameters of the launch variants ------------------------------------------ */

typedef struct {
    unsigned long long a, b;
} p16_t;

static p16_t p16;
static void *p16_params[] = {&p16};
static size_t p16_size = sizeof(p16_t);
static void *p16_extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &p16, CU_LAUNCH_PARAM_BUFFER_SIZE,
                            &p16_size, CU_LAUNCH_PARAM_END};

static int make_big(big_params *p, size_t cap) {
    p->size = 16 + cap;
    p->buf = calloc(1, p->size);
    if (!p->buf) return 0;
    memcpy(p->buf, &g.dbuf, 8); /* a: a device address, never written (n != ~0) */
    /* n = 0, r = 0: already zero */
    for (size_t i = 0; i < cap; i++) p->buf[16 + i] = (unsigned char)(i * 7 + 1);
    p->extra[0] = CU_LAUNCH_PARAM_BUFFER_POINTER;
    p->extra[1] = p->buf;
    p->extra[2] = CU_LAUNCH_PARAM_BUFFER_SIZE;
    p->extra[3] = &p->size;
    p->extra[4] = CU_LAUNCH_PARAM_END;
    return 1;
}

/* ---- statistics ----------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Quantile q of sorted s[0..n), linear between the closest ranks. */
static double quantile(const double *s, int n, double q) {
    double pos = q * (n - 1);
    int lo = (int)pos;
    if (lo >= n - 1) return s[n - 1];
    return s[lo] + (pos - lo) * (s[lo + 1] - s[lo]);
}

static void summarize(double *s, int n, summary *out) {
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += s[i];
    out->ran = 1;
    out->count = n;
    out->median = quantile(s, n, 0.5);
    out->p10 = quantile(s, n, 0.1);
    out->p90 = quantile(s, n, 0.9);
    out->mean = sum / n;
    out->min = s[0];
}

/* ---- regimes -------------------------------------------------------------------- */

static double samples[R_MAX];

static int call_ok(const variant *v, CUresult r) {
    return r == CUDA_SUCCESS || (v->not_ready_ok && r == CUDA_ERROR_NOT_READY);
}

#define FAIL(res, r, w)                                                               \
    do {                                                                              \
        (res)->err = (r);                                                             \
        (res)->where = (w);                                                           \
        api.StreamSynchronize(g.stream);                                              \
        return;                                                                       \
    } while (0)

static CUresult launch_spin(void) {
    unsigned long long ns = SPIN_NS;
    void *params[] = {&ns};
    return api.LaunchKernel(g.spin, 1, 1, 1, 32, 1, 1, 0, g.stream, params, NULL);
}

static void run_drained(variant *v, summary *res) {
    for (int i = -WARMUP_DRAINED; i < R_DRAINED; i++) {
        CUresult r = api.StreamSynchronize(g.stream);
        if (r != CUDA_SUCCESS) FAIL(res, r, "cuStreamSynchronize");
        uint64_t t0 = now_ns();
        r = v->call(v);
        uint64_t t1 = now_ns();
        if (!call_ok(v, r)) FAIL(res, r, "timed call");
        if (i >= 0) samples[i] = (double)(t1 - t0) * 1e-3;
    }
    CUresult r = api.StreamSynchronize(g.stream);
    if (r != CUDA_SUCCESS) FAIL(res, r, "cuStreamSynchronize");
    summarize(samples, R_DRAINED, res);
}

static void run_busy(variant *v, summary *res) {
    int busy_seen = 0;
    for (int i = -WARMUP_BUSY; i < R_BUSY; i++) {
        CUresult r = launch_spin();
        if (r != CUDA_SUCCESS) FAIL(res, r, "spin kernel launch");
        uint64_t t0 = now_ns();
        r = v->call(v);
        uint64_t t1 = now_ns();
        if (!call_ok(v, r)) FAIL(res, r, "timed call");
        /* Was the stream still busy once the call returned? (Not timed.) */
        if (i >= 0 && api.StreamQuery(g.stream) == CUDA_ERROR_NOT_READY) busy_seen++;
        r = api.StreamSynchronize(g.stream);
        if (r != CUDA_SUCCESS) FAIL(res, r, "cuStreamSynchronize");
        if (i >= 0) samples[i] = (double)(t1 - t0) * 1e-3;
    }
    summarize(samples, R_BUSY, res);
    res->busy_seen = busy_seen;
}

static void run_burst(variant *v, summary *res) {
    for (int i = -WARMUP_BURST; i < R_BURST; i++) {
        CUresult bad = CUDA_SUCCESS; /* the first failing call's result */
        uint64_t t0 = now_ns();
        for (int k = 0; k < BURST; k++) {
            CUresult rk = v->call(v);
            if (!call_ok(v, rk) && bad == CUDA_SUCCESS) bad = rk;
        }
        uint64_t t1 = now_ns();
        if (bad != CUDA_SUCCESS) FAIL(res, bad, "timed call");
        CUresult r = api.StreamSynchronize(g.stream);
        if (r != CUDA_SUCCESS) FAIL(res, r, "cuStreamSynchronize");
        if (i >= 0) samples[i] = (double)(t1 - t0) * 1e-3 / BURST;
    }
    summarize(samples, R_BURST, res);
}

/* GPU microseconds of the call's work: the stream held by the spin kernel, a timing
 * event, the call, a timing event; the interval is the work run back to back */
static void run_gpu(variant *v, summary *res) {
    for (int i = -WARMUP_BUSY / 4; i < R_BUSY / 4; i++) {
        CUresult r = launch_spin();
        if (r != CUDA_SUCCESS) FAIL(res, r, "spin kernel launch");
        r = api.EventRecord(g.ev_gpu0, g.stream);
        if (r != CUDA_SUCCESS) FAIL(res, r, "cuEventRecord");
        r = v->call(v);
        if (!call_ok(v, r)) FAIL(res, r, "timed call");
        r = api.EventRecord(g.ev_gpu1, g.stream);
        if (r != CUDA_SUCCESS) FAIL(res, r, "cuEventRecord");
        r = api.StreamSynchronize(g.stream);
        if (r != CUDA_SUCCESS) FAIL(res, r, "cuStreamSynchronize");
        float ms = 0;
        r = api.EventElapsedTime(&ms, g.ev_gpu0, g.ev_gpu1);
        if (r != CUDA_SUCCESS) FAIL(res, r, "cuEventElapsedTime");
        if (i >= 0) samples[i] = (double)ms * 1e3;
    }
    summarize(samples, R_BUSY / 4, res);
}

static void run_any(variant *v, summary *res) {
    for (int i = -WARMUP_DRAINED; i < R_DRAINED; i++) {
        uint64_t t0 = now_ns();
        CUresult r = v->call(v);
        uint64_t t1 = now_ns();
        if (!call_ok(v, r)) FAIL(res, r, "timed call");
        if (i >= 0) samples[i] = (double)(t1 - t0) * 1e-3;
    }
    summarize(samples, R_DRAINED, res);
}

/* ---- variants ------------------------------------------------------------------- */

static variant variants[] = {
    {.name = "launch_empty", .what = "cuLaunchKernel, empty kernel, no params", .stream_op = 1,
     .call = call_launch, .kernel = "k_empty", .grid = 1, .gpu = 1},
    {.name = "launch_p16_params", .what = "cuLaunchKernel, 16 B struct via kernelParams",
     .stream_op = 1, .call = call_launch, .kernel = "k_p16", .grid = 1, .params = p16_params},
    {.name = "launch_p16_extra", .what = "cuLaunchKernel, 16 B struct via extra buffer",
     .stream_op = 1, .call = call_launch, .kernel = "k_p16", .grid = 1, .extra = p16_extra},
    {.name = "launch_1k", .what = "cuLaunchKernel, 1024 B of params via extra buffer",
     .stream_op = 1, .call = call_launch, .kernel = "k_1k", .cap = CAP_1K,
     .grid = 1},
    {.name = "launch_6k", .what = "cuLaunchKernel, 6144 B of params via extra buffer",
     .stream_op = 1, .call = call_launch, .kernel = "k_6k", .cap = CAP_6K,
     .grid = 1},
    {.name = "launch_20k", .what = "cuLaunchKernel, 20480 B of params via extra buffer",
     .stream_op = 1, .call = call_launch, .kernel = "k_20k", .cap = CAP_20K,
     .grid = 1},
    {.name = "launch_32k", .what = "cuLaunchKernel, 32752 B of params via extra buffer",
     .stream_op = 1, .call = call_launch, .kernel = "k_32k", .cap = CAP_32K,
     .grid = 1},
    {.name = "launchex_p16", .what = "cuLaunchKernelEx, 16 B struct via kernelParams",
     .stream_op = 1, .call = call_launch_ex, .kernel = "k_p16", .grid = 1,
     .params = p16_params},
    {.name = "launch_grid8", .what = "cuLaunchKernel, 16 B struct via kernelParams, grid 8",
     .stream_op = 1, .call = call_launch, .kernel = "k_p16", .grid = 8, .params = p16_params},
    {.name = "memcpy_h2d_4", .what = "cuMemcpyHtoDAsync, 4 B from pinned host memory",
     .stream_op = 1, .call = call_memcpy, .bytes = COPY_SMALL},
    {.name = "memcpy_h2d_20k", .what = "cuMemcpyHtoDAsync, 20 KiB from pinned host memory",
     .stream_op = 1, .call = call_memcpy, .bytes = COPY_LARGE},
    {.name = "event_record", .what = "cuEventRecord (CU_EVENT_DISABLE_TIMING)", .stream_op = 1,
     .call = call_event_record},
    {.name = "event_query_done", .what = "cuEventQuery of an event that has completed",
     .stream_op = 1, .call = call_event_query_done},
    {.name = "stream_query", .what = "cuStreamQuery (NOT_READY counts as an answer)",
     .stream_op = 1, .not_ready_ok = 1, .call = call_stream_query},
    {.name = "stream_is_capturing", .what = "cuStreamIsCapturing (the copier asks it each step)",
     .stream_op = 1, .call = call_stream_is_capturing},
    {.name = "write_value32", .what = "cuStreamWriteValue32 to device memory, flags 0",
     .stream_op = 1, .call = call_write_value32},
    {.name = "graph_launch", .what = "cuGraphLaunch, graph of one empty kernel node",
     .stream_op = 1, .call = call_graph_launch, .gpu = 1},
    {.name = "graph_set_p16",
     .what = "cuGraphExecKernelNodeSetParams (16 B via kernelParams, grid 1/2) + cuGraphLaunch",
     .stream_op = 1, .call = call_graph_set, .kernel = "k_p16", .grid = 1, .params = p16_params,
     .gpu = 1},
    {.name = "graph_set_1k",
     .what = "cuGraphExecKernelNodeSetParams (1024 B via extra, grid 1/2) + cuGraphLaunch",
     .stream_op = 1, .call = call_graph_set, .kernel = "k_1k", .cap = CAP_1K, .grid = 1},
    {.name = "graph_set_6k",
     .what = "cuGraphExecKernelNodeSetParams (6144 B via extra, grid 1/2) + cuGraphLaunch",
     .stream_op = 1, .call = call_graph_set, .kernel = "k_6k", .cap = CAP_6K, .grid = 1,
     .gpu = 1},
    {.name = "graph_set_20k",
     .what = "cuGraphExecKernelNodeSetParams (20480 B via extra, grid 1/2) + cuGraphLaunch",
     .stream_op = 1, .call = call_graph_set, .kernel = "k_20k", .cap = CAP_20K, .grid = 1,
     .gpu = 1},
    {.name = "graph_set_only_6k",
     .what = "cuGraphExecKernelNodeSetParams alone (6144 B via extra, grid 1/2)",
     .stream_op = 0, .call = call_graph_set_only, .kernel = "k_6k", .cap = CAP_6K, .grid = 1},
    {.name = "graph_fixed_6k", .what = "cuGraphLaunch of a node with 6144 B of params, fixed",
     .stream_op = 1, .call = call_graph_fixed, .kernel = "k_6k", .cap = CAP_6K, .grid = 1},
    {.name = "launch_6k_gpu", .what = "cuLaunchKernel, 6144 B via extra (GPU time only)",
     .stream_op = 0, .call = call_launch, .kernel = "k_6k", .cap = CAP_6K, .grid = 1,
     .gpu = 2},
    {.name = "launch_20k_gpu", .what = "cuLaunchKernel, 20480 B via extra (GPU time only)",
     .stream_op = 0, .call = call_launch, .kernel = "k_20k", .cap = CAP_20K, .grid = 1,
     .gpu = 2},
    {.name = "launch_p16_gpu", .what = "cuLaunchKernel, 16 B via kernelParams (GPU time only)",
     .stream_op = 0, .call = call_launch, .kernel = "k_p16", .grid = 1, .params = p16_params,
     .gpu = 2},
    {.name = "carried_6k_write",
     .what = "6 KB rewritten, then carried in a launch's parameters and scattered (8 pieces)",
     .stream_op = 1, .call = call_carried_write, .kernel = "k_6k_write", .cap = CAP_6K,
     .grid = 1, .gpu = 1},
    {.name = "graph_whole8k",
     .what = "6 KB rewritten in mapped memory, then a one-node graph reading 8 KB of it",
     .stream_op = 1, .call = call_graph_whole, .kernel = "k_whole8k", .grid = 1, .gpu = 1},
    {.name = "ctx_get_current", .what = "cuCtxGetCurrent (no stream operation)",
     .stream_op = 0, .call = call_ctx_get_current},
    {.name = "timer_overhead", .what = "nothing: the two clock_gettime calls around a no-op",
     .stream_op = 0, .call = call_nothing},
};

#define N_VARIANTS ((int)(sizeof(variants) / sizeof(variants[0])))

/* Set up what `v` needs; return CUDA_SUCCESS or the failing CUresult (and *where). */
static CUresult setup_variant(variant *v, const char **where) {
    CUresult r;
    if (v->kernel) {
        *where = "cuModuleGetFunction";
        r = api.ModuleGetFunction(&v->f, g.mod, v->kernel);
        if (r != CUDA_SUCCESS) return r;
    }
    if (v->cap) {
        *where = "parameter buffer";
        if (!make_big(&v->big, v->cap)) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
        v->extra = v->big.extra;
    }
    if (v->call == call_launch_ex) {
        *where = "cuLaunchKernelEx lookup";
        if (!api.LaunchKernelEx) return ERR_NO_SYMBOL;
        memset(&v->cfg, 0, sizeof v->cfg);
        v->cfg.gridDimX = v->grid;
        v->cfg.gridDimY = 1;
        v->cfg.gridDimZ = 1;
        v->cfg.blockDimX = BLOCK;
        v->cfg.blockDimY = 1;
        v->cfg.blockDimZ = 1;
        v->cfg.sharedMemBytes = 0;
        v->cfg.hStream = g.stream;
        v->cfg.attrs = NULL;
        v->cfg.numAttrs = 0;
    }
    if (v->call == call_event_record) {
        *where = "cuEventCreate";
        r = api.EventCreate(&g.ev_record, CU_EVENT_DISABLE_TIMING);
        if (r != CUDA_SUCCESS) return r;
    }
    if (v->call == call_event_query_done) {
        *where = "cuEventCreate";
        r = api.EventCreate(&g.ev_done, CU_EVENT_DISABLE_TIMING);
        if (r != CUDA_SUCCESS) return r;
        *where = "cuEventRecord";
        r = api.EventRecord(g.ev_done, g.stream);
        if (r != CUDA_SUCCESS) return r;
        *where = "cuEventSynchronize";
        r = api.EventSynchronize(g.ev_done);
        if (r != CUDA_SUCCESS) return r;
    }
    if (v->call == call_write_value32) {
        *where = "cuStreamWriteValue32 lookup";
        if (!api.StreamWriteValue32) return ERR_NO_SYMBOL;
    }
    if (v->call == call_graph_launch) {
        CUgraph graph;
        CUgraphNode node;
        CUDA_KERNEL_NODE_PARAMS np;
        *where = "graph entry point lookup";
        if (!api.GraphCreate || !api.GraphAddKernelNode || !api.GraphInstantiateWithFlags ||
            !api.GraphLaunch)
            return ERR_NO_SYMBOL;
        *where = "cuModuleGetFunction";
        memset(&np, 0, sizeof np);
        r = api.ModuleGetFunction(&np.func, g.mod, "k_empty");
        if (r != CUDA_SUCCESS) return r;
        np.gridDimX = np.gridDimY = np.gridDimZ = 1;
        np.blockDimX = BLOCK;
        np.blockDimY = np.blockDimZ = 1;
        *where = "cuGraphCreate";
        r = api.GraphCreate(&graph, 0);
        if (r != CUDA_SUCCESS) return r;
        *where = "cuGraphAddKernelNode";
        r = api.GraphAddKernelNode(&node, graph, NULL, 0, &np);
        if (r != CUDA_SUCCESS) return r;
        *where = "cuGraphInstantiateWithFlags";
        r = api.GraphInstantiateWithFlags(&g.graph_exec, graph, 0);
        if (r != CUDA_SUCCESS) return r;
    }
    if (v->call == call_graph_whole) {
        static void *whole_args[2];
        static unsigned long long whole_seg, whole_dst;
        whole_seg = (unsigned long long)(uintptr_t)g.hbuf; /* mapped: unified addressing */
        whole_dst = g.dbuf;
        whole_args[0] = &whole_seg;
        whole_args[1] = &whole_dst;
        v->params = whole_args;
    }
    if (v->call == call_carried_write) {
        memcpy(v->big.buf, &g.dbuf, 8); /* a: where the pieces land */
    }
    if (v->call == call_graph_set || v->call == call_graph_set_only ||
        v->call == call_graph_fixed || v->call == call_graph_whole) {
        CUgraph graph;
        *where = "graph entry point lookup";
        if (!api.GraphCreate || !api.GraphAddKernelNode || !api.GraphInstantiateWithFlags ||
            !api.GraphLaunch || !api.GraphExecKernelNodeSetParams)
            return ERR_NO_SYMBOL;
        memset(&v->np, 0, sizeof v->np);
        v->np.func = v->f;
        v->np.gridDimX = v->grid;
        v->np.gridDimY = v->np.gridDimZ = 1;
        v->np.blockDimX = BLOCK;
        v->np.blockDimY = v->np.blockDimZ = 1;
        v->np.kernelParams = v->params;
        v->np.extra = v->extra;
        *where = "cuGraphCreate";
        r = api.GraphCreate(&graph, 0);
        if (r != CUDA_SUCCESS) return r;
        *where = "cuGraphAddKernelNode";
        r = api.GraphAddKernelNode(&v->node, graph, NULL, 0, &v->np);
        if (r != CUDA_SUCCESS) return r;
        *where = "cuGraphInstantiateWithFlags";
        r = api.GraphInstantiateWithFlags(&v->exec, graph, 0);
        if (r != CUDA_SUCCESS) return r;
    }
    if (v->gpu) {
        *where = "timing events";
        if (!api.EventElapsedTime) return ERR_NO_SYMBOL;
        if (!g.ev_gpu0) {
            r = api.EventCreate(&g.ev_gpu0, 0);
            if (r != CUDA_SUCCESS) return r;
            r = api.EventCreate(&g.ev_gpu1, 0);
            if (r != CUDA_SUCCESS) return r;
        }
    }
    /* One call and a synchronize: a variant the driver refuses is unavailable. */
    *where = "first call";
    r = v->call(v);
    if (!call_ok(v, r)) {
        api.StreamSynchronize(g.stream);
        return r;
    }
    *where = "cuStreamSynchronize after the first call";
    return api.StreamSynchronize(g.stream);
}

/* ---- output --------------------------------------------------------------------- */

static void print_summary(const variant *v, int regime) {
    const summary *s = &v->res[regime];
    if (!s->ran && s->err == CUDA_SUCCESS) return;
    if (s->err != CUDA_SUCCESS) {
        printf("%-18s %-7s failed: CUresult %d %s (%s) at %s\n", v->name,
               regime_names[regime], s->err, err_name(s->err), err_string(s->err), s->where);
        return;
    }
    printf("%-18s %-7s median %7.3f us  p10 %7.3f  p90 %7.3f  mean %7.3f  min %7.3f  n %d",
           v->name, regime_names[regime], s->median, s->p10, s->p90, s->mean, s->min,
           s->count);
    if (regime == BUSY) printf("  busy %d/%d", s->busy_seen, s->count);
    printf("\n");
}

static void json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void json_error(FILE *f, CUresult r, const char *where) {
    fprintf(f, "{\"code\": %d, \"name\": ", r);
    json_string(f, err_name(r));
    fprintf(f, ", \"message\": ");
    json_string(f, err_string(r));
    fprintf(f, ", \"where\": ");
    json_string(f, where ? where : "");
    fprintf(f, "}");
}

static int write_json(const char *path, int driver_version, const char *device_name, int cc_major,
                      int cc_minor, double spin_check_us) {
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        return 0;
    }
    fprintf(f, "{\n  \"probe\": \"launch_floor\",\n  \"units\": \"us\",\n");
    fprintf(f, "  \"clock\": \"CLOCK_MONOTONIC\",\n");
    fprintf(f, "  \"driver_version\": %d,\n  \"device\": ", driver_version);
    json_string(f, device_name);
    fprintf(f, ",\n  \"compute_capability\": \"%d.%d\",\n", cc_major, cc_minor);
    fprintf(f, "  \"entry_points\": {\"write_value32\": ");
    json_string(f, found_write_value32);
    fprintf(f, ", \"graph_add_kernel_node\": ");
    json_string(f, found_add_kernel_node);
    fprintf(f, ", \"graph_exec_kernel_node_set_params\": ");
    json_string(f, found_exec_set_params);
    fprintf(f, "},\n");
    fprintf(f,
            "  \"settings\": {\"block\": %d, \"burst\": %d, \"spin_ns\": %llu, "
            "\"repeats\": {\"drained\": %d, \"busy\": %d, \"burst\": %d, \"any\": %d}, "
            "\"warmups\": {\"drained\": %d, \"busy\": %d, \"burst\": %d, \"any\": %d}},\n",
            BLOCK, BURST, SPIN_NS, R_DRAINED, R_BUSY, R_BURST, R_DRAINED, WARMUP_DRAINED,
            WARMUP_BUSY, WARMUP_BURST, WARMUP_DRAINED);
    fprintf(f, "  \"spin_check_us\": %.3f,\n", spin_check_us);
    fprintf(f, "  \"results\": {\n");
    for (int i = 0; i < N_VARIANTS; i++) {
        const variant *v = &variants[i];
        fprintf(f, "    ");
        json_string(f, v->name);
        fprintf(f, ": {\"what\": ");
        json_string(f, v->what);
        fprintf(f, ", \"available\": %s", v->available ? "true" : "false");
        if (!v->available) {
            fprintf(f, ", \"error\": ");
            json_error(f, v->setup_err, v->setup_where);
        }
        for (int k = 0; k < N_REGIMES; k++) {
            const summary *s = &v->res[k];
            if (!s->ran && s->err == CUDA_SUCCESS) continue;
            fprintf(f, ",\n      \"%s\": ", regime_names[k]);
            if (s->err != CUDA_SUCCESS) {
                fprintf(f, "{\"error\": ");
                json_error(f, s->err, s->where);
                fprintf(f, "}");
                continue;
            }
            fprintf(f,
                    "{\"median\": %.4f, \"p10\": %.4f, \"p90\": %.4f, \"mean\": %.4f, "
                    "\"min\": %.4f, \"count\": %d",
                    s->median, s->p10, s->p90, s->mean, s->min, s->count);
            if (k == BUSY) fprintf(f, ", \"busy_seen\": %d", s->busy_seen);
            fprintf(f, "}");
        }
        fprintf(f, "}%s\n", i + 1 < N_VARIANTS ? "," : "");
    }
    fprintf(f, "  }\n}\n");
    if (fclose(f) != 0) {
        perror(path);
        return 0;
    }
    return 1;
}

/* ---- main ----------------------------------------------------------------------- */

static void *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return NULL;
    }
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return NULL;
    }
    long n = ftell(f);
    rewind(f);
    unsigned char *buf = n > 0 ? malloc((size_t)n) : NULL;
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "launch_floor: cannot read %s\n", path);
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    return buf;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s KERNELS.cubin [OUT.json]\n", argv[0]);
        return 2;
    }
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "launch_floor: cannot load libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    load_api();
    {
        /* Entry points without which nothing here runs. */
        const struct {
            const char *name;
            int missing;
        } need[] = {
            {"cuInit", !api.Init},
            {"cuDriverGetVersion", !api.DriverGetVersion},
            {"cuDeviceGet", !api.DeviceGet},
            {"cuDeviceGetName", !api.DeviceGetName},
            {"cuDeviceGetAttribute", !api.DeviceGetAttribute},
            {"cuDevicePrimaryCtxRetain", !api.DevicePrimaryCtxRetain},
            {"cuCtxSetCurrent", !api.CtxSetCurrent},
            {"cuCtxGetCurrent", !api.CtxGetCurrent},
            {"cuCtxSynchronize", !api.CtxSynchronize},
            {"cuGetErrorString", !api.GetErrorString},
            {"cuModuleLoadData", !api.ModuleLoadData},
            {"cuModuleGetFunction", !api.ModuleGetFunction},
            {"cuStreamCreate", !api.StreamCreate},
            {"cuStreamSynchronize", !api.StreamSynchronize},
            {"cuStreamQuery", !api.StreamQuery},
            {"cuLaunchKernel", !api.LaunchKernel},
            {"cuMemHostAlloc", !api.MemHostAlloc},
            {"cuMemAlloc_v2", !api.MemAlloc},
            {"cuMemcpyHtoDAsync_v2", !api.MemcpyHtoDAsync},
            {"cuEventCreate", !api.EventCreate},
            {"cuEventRecord", !api.EventRecord},
            {"cuEventQuery", !api.EventQuery},
            {"cuEventSynchronize", !api.EventSynchronize},
        };
        for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
            if (need[i].missing) {
                fprintf(stderr, "launch_floor: libcuda.so.1 does not export %s\n",
                        need[i].name);
                return 1;
            }
        }
    }

    int driver_version = 0, cc_major = 0, cc_minor = 0;
    char device_name[256] = "";
    CHECK_FATAL(api.Init(0), "cuInit");
    CHECK_FATAL(api.DriverGetVersion(&driver_version), "cuDriverGetVersion");
    CHECK_FATAL(api.DeviceGet(&g.dev, 0), "cuDeviceGet(0)");
    CHECK_FATAL(api.DeviceGetName(device_name, (int)sizeof device_name, g.dev),
                "cuDeviceGetName");
    CHECK_FATAL(api.DeviceGetAttribute(&cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                       g.dev),
                "cuDeviceGetAttribute");
    CHECK_FATAL(api.DeviceGetAttribute(&cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                       g.dev),
                "cuDeviceGetAttribute");
    CHECK_FATAL(api.DevicePrimaryCtxRetain(&g.ctx, g.dev), "cuDevicePrimaryCtxRetain");
    CHECK_FATAL(api.CtxSetCurrent(g.ctx), "cuCtxSetCurrent");

    void *image = read_file(argv[1]);
    if (!image) return 1;
    {
        CUresult r = api.ModuleLoadData(&g.mod, image);
        if (r != CUDA_SUCCESS) {
            fprintf(stderr,
                    "launch_floor: cuModuleLoadData(%s) failed: CUresult %d %s (%s); the "
                    "device is sm_%d%d: was the cubin built for it?\n",
                    argv[1], r, err_name(r), err_string(r), cc_major, cc_minor);
            return 1;
        }
    }
    free(image);

    /* What every regime needs: the stream, the spin kernel, the buffers. */
    CHECK_FATAL(api.StreamCreate(&g.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    CHECK_FATAL(api.ModuleGetFunction(&g.spin, g.mod, "k_spin"), "cuModuleGetFunction(k_spin)");
    CHECK_FATAL(api.MemAlloc(&g.dbuf, DBUF_BYTES), "cuMemAlloc_v2");
    CHECK_FATAL(api.MemHostAlloc(&g.hbuf, COPY_LARGE, 0), "cuMemHostAlloc");
    memset(g.hbuf, 0x5a, COPY_LARGE);
    p16.a = g.dbuf; /* never written: the kernel writes only if b == ~0 */
    p16.b = 0;

    printf("launch_floor: driver %d.%d (%d), device 0: %s (sm_%d%d)\n", driver_version / 1000,
           (driver_version % 1000) / 10, driver_version, device_name, cc_major, cc_minor);
    printf("entry points: %s, %s, %s\n", found_write_value32[0] ? found_write_value32 : "-",
           found_add_kernel_node[0] ? found_add_kernel_node : "-",
           found_exec_set_params[0] ? found_exec_set_params : "-");

    /* The spin kernel must hold the stream for about SPIN_NS: check it from the host. */
    double spin_check_us;
    {
        double s[21];
        for (int i = 0; i < 21; i++) {
            uint64_t t0 = now_ns();
            CHECK_FATAL(launch_spin(), "spin kernel launch");
            CHECK_FATAL(api.StreamSynchronize(g.stream), "cuStreamSynchronize after spin");
            s[i] = (double)(now_ns() - t0) * 1e-3;
        }
        qsort(s, 21, sizeof(double), cmp_double);
        spin_check_us = s[10];
        printf("spin kernel: launch to synchronize return %.1f us (median of 21; spins %.1f)\n",
               spin_check_us, SPIN_NS * 1e-3);
    }
    printf("%d warmups, then drained R=%d, busy R=%d, burst R=%d x %d; microseconds of host "
           "time per call\n",
           WARMUP_DRAINED, R_DRAINED, R_BUSY, R_BURST, BURST);
    fflush(stdout);

    for (int i = 0; i < N_VARIANTS; i++) {
        variant *v = &variants[i];
        const char *where = "";
        CUresult r = setup_variant(v, &where);
        if (r != CUDA_SUCCESS) {
            v->available = 0;
            v->setup_err = r;
            v->setup_where = where;
            printf("%-18s unavailable: CUresult %d %s (%s) at %s\n", v->name, r, err_name(r),
                   err_string(r), where);
            fflush(stdout);
            continue;
        }
        v->available = 1;
        if (v->gpu == 2) { /* GPU time only */
        } else if (v->stream_op) {
            run_drained(v, &v->res[DRAINED]);
            run_busy(v, &v->res[BUSY]);
            run_burst(v, &v->res[BURST_REGIME]);
            for (int k = DRAINED; k <= BURST_REGIME; k++) print_summary(v, k);
        } else {
            run_any(v, &v->res[ANY]);
            print_summary(v, ANY);
        }
        if (v->gpu) {
            run_gpu(v, &v->res[GPU]);
            print_summary(v, GPU);
        }
        fflush(stdout);
    }

    CUresult r = api.CtxSynchronize();
    if (r != CUDA_SUCCESS)
        fprintf(stderr, "launch_floor: cuCtxSynchronize at the end: CUresult %d %s (%s)\n", r,
                err_name(r), err_string(r));
    if (argc == 3 && !write_json(argv[2], driver_version, device_name, cc_major, cc_minor,
                                 spin_check_us))
        return 1;
    return r == CUDA_SUCCESS ? 0 : 1;
}
