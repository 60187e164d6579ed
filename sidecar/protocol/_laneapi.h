/* What _tokenscan.c offers other extensions of the package, in the capsule named below: the
 * lane's per-read entry, called by the upstream's C reader (sidecar/proxy/_recvstamp.c) with
 * the read still in its receive buffer and its instant as a C integer. The capsule is looked
 * up when a lane is first given to a reader; where _tokenscan is not built there is no lane. */
#ifndef SIDECAR_LANEAPI_H
#define SIDECAR_LANEAPI_H

#include <Python.h>

#define LANE_API_CAPSULE "sidecar.protocol._tokenscan._lane_api"

typedef struct {
    PyTypeObject *lane_type; /* `relay_read` takes a lane of exactly this type */
    /* Lane.relay without its objects: 1 taken whole, 0 left for the Python path, -1 with an
     * exception set. */
    int (*relay_read)(PyObject *lane, const char *data, Py_ssize_t size, long long at_ns);
} lane_api;

#endif
