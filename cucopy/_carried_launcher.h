/* The carried scatter launch as a C function: made by the CUDA backend's compiled
 * driver calls (cucopy/backends/_cudacall.c, Driver.launcher()) and called by the
 * compiled core at flush (cucopy/_core/wire.c and copier.c: Segment.flush_carried and
 * CopierCore._flush_fast), handed from one extension module to the other in a capsule
 * of this name whose pointer is this struct.
 *
 * carried() returns the CUresult, or a negative value when it launched nothing (no
 * capacity holds nbytes, a grid out of range, or another context current). With
 * nbytes smaller than the segment, the kernel reads the rest of it at seg when it runs
 * (a mapped launch carrying its header and table).
 *
 * record() and query() are cuEventRecord and cuEventQuery on a raw event handle (the
 * slot's event, for a launch that reads the slot when it runs): each returns the
 * CUresult (query: 0 complete, 600 not ready), or a negative value when it called
 * nothing (another context current, or no entry point: record and query may be NULL).
 * carried_at() is carried() that may hand the driver the caller's own bytes instead of
 * a copy of them: the CARRY_PREFIX bytes before host must be writable and read by
 * nothing else during the call (it writes the prefix there), and readable is how many
 * bytes from host on may be read (the driver reads the carrying kernel's whole
 * capacity). With too few it copies, as carried() does.
 *
 * graphed() returns the CUresult of cuGraphLaunch (or of re-pointing a graph of the
 * driver's pool at seg: cuGraphExecKernelNodeSetParams), or a negative value when it
 * launched nothing: -1 when no graph may launch on this stream (no graphs, or every
 * graph of the pool last launched on another stream), the caller then launching the
 * segment another way; OTHER_CONTEXT (-2) when another context is current. No graph
 * is made after set-up. The graph's kernel reads the segment when it runs, as a mapped
 * launch does: its slot's event must follow it, and all graph_cap bytes at seg stay
 * unwritten until that event completes.
 *
 * copy() (ABI 6, with graphed_tag) is the eager path's one driver copy (_core/copier.c,
 * core_eager).
 *
 * abi is LAUNCHER_ABI: a caller built against another layout uses none of it. */
#ifndef CUCOPY_CARRIED_LAUNCHER_H
#define CUCOPY_CARRIED_LAUNCHER_H

#include <stddef.h>

#define LAUNCHER_ABI 6

typedef struct {
    int (*carried)(void *drv, unsigned long long nblocks, unsigned long long stream,
                   unsigned long long seg, const void *host, size_t nbytes);
    void *drv;
    int abi;
    int (*record)(void *drv, unsigned long long event, unsigned long long stream);
    int (*query)(void *drv, unsigned long long event);
    int (*carried_at)(void *drv, unsigned long long nblocks, unsigned long long stream,
                      unsigned long long seg, char *host, size_t nbytes, size_t readable);
    /* graphed() launches a one-node graph of the driver's pool (made at set-up) pointed
     * at segment address seg: its kernel reads graph_cap bytes at seg when it runs.
     * graph_cap is 0 when the driver offers no graphs (graphed then answers -1). */
    int (*graphed)(void *drv, unsigned long long stream, unsigned long long seg);
    size_t graph_cap;
    /* capturing() is cuStreamIsCapturing: the CUresult, *status the capture status;
     * OTHER_CONTEXT (-2) and nothing called when another context is current */
    int (*capturing)(void *drv, unsigned long long stream, int *status);
    /* copy() is one eager H2D copy of rows x width bytes from pinned host memory (rows
     * spitch apart) to the device (rows dpitch apart): cuMemcpyHtoDAsync for one row,
     * cuMemcpy2DAsync for several. The CUresult, or a negative value when it copied
     * nothing (no entry points, another context current, a pitch past the 2-D copy's
     * limit): the caller then copies through the backend. NULL until copies(). */
    int (*copy)(void *drv, unsigned long long dst, unsigned long long dpitch, const void *src,
                unsigned long long spitch, unsigned long long width, unsigned long long rows,
                unsigned long long stream);
    /* graphed_tag() is graphed() whose kernel, once its reads of the segment are done,
     * copies the u64 at cell (the device address of the slot's completion tag,
     * pack.TAG_AT) to cell + 8 (cucopy_scatter_w8k): a slot whose last reader it is
     * needs no event after it. NULL where graphed is. */
    int (*graphed_tag)(void *drv, unsigned long long stream, unsigned long long seg,
                       unsigned long long cell);
} CarriedLauncher;

#define LAUNCHER_NAME "cucopy.carried_launcher"

#endif
