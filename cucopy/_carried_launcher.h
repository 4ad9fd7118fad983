/* The carried scatter launch as a C function: made by the CUDA backend's compiled
 * driver calls (cucopy/backends/_cudacall.c, Driver.launcher()) and called by the
 * compiled staging core at flush (cucopy/_segment.c, Segment.flush_carried), handed
 * from one extension module to the other in a capsule of this name whose pointer is
 * this struct. carried() returns the CUresult, or a negative value when it launched
 * nothing (no capacity holds nbytes, a grid out of range, or another context current). */
#ifndef CUCOPY_CARRIED_LAUNCHER_H
#define CUCOPY_CARRIED_LAUNCHER_H

#include <stddef.h>

typedef struct {
    int (*carried)(void *drv, unsigned long long nblocks, unsigned long long stream,
                   unsigned long long seg, const void *host, size_t nbytes);
    void *drv;
} CarriedLauncher;

#define LAUNCHER_NAME "cucopy.carried_launcher"

#endif
