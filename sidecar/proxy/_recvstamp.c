/* One read of an upstream socket with the kernel's receive timestamp, in C: what rxstamp.py's
 * `receive_with_python` does with socket.recvmsg_into, without the objects it makes per read
 * (the result tuple, the list of control messages, a tuple and a bytes per message, the
 * struct's tuple, a memoryview slice).
 *
 * Why C: every read of every stream goes through it, and those objects cost more than the
 * rest of the call (benchmarks/meter_instructions.py counts the relay's per-read path; this is
 * the part before it). rxstamp.py keeps the Python version as the fallback where this module
 * is not built, and tests/test_rxstamp.py holds the two to the same answers on real sockets.
 *
 * receive(fd: int, buffer: writable buffer) -> (data: bytes, realtime_ns: int)
 *   One recvmsg(2) into ``buffer``; ``data`` is a copy of what it read (b"" at the peer's
 *   orderly end). ``realtime_ns``: the SO_TIMESTAMPNS stamp of the first control message, when
 *   it is one of the right size, else -1. Raises OSError (BlockingIOError, InterruptedError,
 *   ConnectionResetError, ...) from errno as the socket module does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "../protocol/_laneapi.h"

#ifndef SCM_TIMESTAMPNS
#define SCM_TIMESTAMPNS SO_TIMESTAMPNS
#endif

/* One recvmsg(2) of ``fd`` into [buf, buf + len): its size (-1 with errno set), and in *stamp
 * the SO_TIMESTAMPNS stamp of the first control message when it is one of the right size, in
 * CLOCK_REALTIME nanoseconds, else -1. */
static ssize_t
receive_stamped(int fd, void *buf, size_t len, long long *stamp)
{
    struct iovec iov = {buf, len};
    union {
        char bytes[CMSG_SPACE(sizeof(struct timespec))];
        struct cmsghdr align;
    } control;
    struct msghdr message;
    memset(&message, 0, sizeof message);
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    message.msg_control = control.bytes;
    message.msg_controllen = sizeof control.bytes;
    *stamp = -1;
    ssize_t size = recvmsg(fd, &message, 0);
    if (size < 0) {
        return size;
    }
    struct cmsghdr *first = message.msg_controllen ? CMSG_FIRSTHDR(&message) : NULL;
    if (first != NULL && first->cmsg_level == SOL_SOCKET && first->cmsg_type == SCM_TIMESTAMPNS
        && first->cmsg_len == CMSG_LEN(sizeof(struct timespec))) {
        struct timespec at;
        memcpy(&at, CMSG_DATA(first), sizeof at);
        *stamp = (long long)at.tv_sec * 1000000000LL + (long long)at.tv_nsec;
    }
    return size;
}

static PyObject *
receive(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "receive() takes (fd, buffer)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "receive(): not a file descriptor");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    long long stamp;
    ssize_t size = receive_stamped((int)fd, view.buf, (size_t)view.len, &stamp);
    if (size < 0) {
        int error = errno; /* as recvmsg left it, whatever releasing the buffer does */
        PyBuffer_Release(&view);
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *data = PyBytes_FromStringAndSize((const char *)view.buf, size);
    PyBuffer_Release(&view);
    if (data == NULL) {
        return NULL;
    }
    PyObject *answer = PyTuple_New(2);
    PyObject *stamp_object = PyLong_FromLongLong(stamp);
    if (answer == NULL || stamp_object == NULL) {
        Py_XDECREF(answer);
        Py_XDECREF(stamp_object);
        Py_DECREF(data);
        return NULL;
    }
    PyTuple_SET_ITEM(answer, 0, data);
    PyTuple_SET_ITEM(answer, 1, stamp_object);
    return answer;
}

/* -- Reader: the upstream socket's whole reader callback in C ---------------------------------
 *
 * Reader(fd, buffer, transport, protocol): a callable for the loop's add_reader that does what
 * rxstamp.StampedTransport._on_readable does, without a Python frame per read: one recvmsg
 * (`receive`'s), the kernel's stamp put on the monotonic clock by the offset between the two
 * clocks now (clock.from_realtime_ns), never after the read nor before the connection's
 * previous stamp, then the read offered to the stream's C lane (``lane``, settable: None or a
 * `_tokenscan.Lane`) and, when the lane does not take it, handed to
 * ``protocol.data_received_at(data, at_ns)``. What is rare stays in Python, on the transport:
 * `close()` at the peer's orderly end, `_fail(exc)` on a socket error or when the lane or the
 * protocol raised (then the exception goes on to the loop, as uvloop's transports do), and
 * `_count_unstamped()` for a read the kernel did not stamp. `close()` lets go of the transport,
 * the protocol and the lane (they hold this object: the transport ends it when it ends).
 * tests/test_rxstamp.py runs the transport's tests over this and over the Python callback.
 */

typedef struct {
    PyObject_HEAD
    int fd;
    PyObject *buffer;
    PyObject *transport;
    PyObject *protocol;
    PyObject *lane;
    long long last_ns;
} Reader;

static PyObject *data_received_at_name, *relay_name, *close_name, *fail_name,
    *count_unstamped_name;
/* _tokenscan's lane entry (_laneapi.h), looked up when the first lane is set; NULL until then,
 * or for good when it cannot be had (`lane_api_sought`). */
static const lane_api *lane_api_found;
static int lane_api_sought;

static long long
clock_ns(clockid_t which)
{
    struct timespec now;
    clock_gettime(which, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

static int
reader_traverse(Reader *self, visitproc visit, void *arg)
{
    Py_VISIT(self->buffer);
    Py_VISIT(self->transport);
    Py_VISIT(self->protocol);
    Py_VISIT(self->lane);
    return 0;
}

static int
reader_clear(Reader *self)
{
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->protocol);
    Py_CLEAR(self->lane);
    return 0;
}

static void
reader_dealloc(Reader *self)
{
    PyObject_GC_UnTrack(self);
    reader_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
reader_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"fd", "buffer", "transport", "protocol", NULL};
    int fd;
    PyObject *buffer, *transport, *protocol;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOOO:Reader", names, &fd, &buffer,
                                     &transport, &protocol)) {
        return NULL;
    }
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "Reader(): not a file descriptor");
        return NULL;
    }
    Reader *self = (Reader *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->fd = fd;
    self->buffer = Py_NewRef(buffer);
    self->transport = Py_NewRef(transport);
    self->protocol = Py_NewRef(protocol);
    self->lane = NULL;
    return (PyObject *)self;
}

/* transport.<name>(*arg): 0, or -1 with the exception set. */
static int
call_transport(PyObject *transport, PyObject *name, PyObject *arg)
{
    PyObject *call_args[2] = {transport, arg};
    PyObject *answer =
        PyObject_VectorcallMethod(name, call_args, (arg ? 2 : 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                  NULL);
    if (answer == NULL) {
        return -1;
    }
    Py_DECREF(answer);
    return 0;
}

/* An exception from the lane or the protocol: the transport fails with it (its exchange then
 * fails, so the request is still recorded), and it goes on to the loop. */
static void
fail_with_current(PyObject *transport)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return; /* KeyboardInterrupt and the like: on as they are */
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    if (call_transport(transport, fail_name, value) < 0) {
        PyErr_WriteUnraisable(transport);
    }
    PyErr_Restore(type, value, traceback);
}

static PyObject *
reader_call(Reader *self, PyObject *args, PyObject *kwargs)
{
    (void)args;
    (void)kwargs;
    if (self->transport == NULL) {
        Py_RETURN_NONE; /* closed: a callback the loop still had queued */
    }
    /* Held for the call: `_fail` or `close` may end this reader (`reader_clear`) inside it. */
    PyObject *transport = Py_NewRef(self->transport);
    PyObject *protocol = Py_NewRef(self->protocol);
    PyObject *lane = Py_XNewRef(self->lane);
    PyObject *result = NULL, *data = NULL, *at_object = NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(self->buffer, &view, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    long long realtime_ns;
    ssize_t size = receive_stamped(self->fd, view.buf, (size_t)view.len, &realtime_ns);
    if (size < 0) {
        int error = errno; /* as recvmsg left it, whatever releasing the buffer does */
        PyBuffer_Release(&view);
        errno = error;
        if (error == EAGAIN || error == EWOULDBLOCK || error == EINTR) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyErr_SetFromErrno(PyExc_OSError);
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        int failed = call_transport(transport, fail_name, value);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        if (failed == 0) {
            result = Py_NewRef(Py_None);
        }
        goto done;
    }
    long long now_ns = clock_ns(CLOCK_MONOTONIC);
    if (size == 0) { /* the upstream's orderly end: connection_lost(None) follows */
        PyBuffer_Release(&view);
        if (call_transport(transport, close_name, NULL) == 0) {
            result = Py_NewRef(Py_None);
        }
        goto done;
    }
    long long at_ns = now_ns;
    int stamped = 0;
    if (realtime_ns >= 0) {
        /* clock.from_realtime_ns, then the transport's clamp. */
        at_ns = realtime_ns - (clock_ns(CLOCK_REALTIME) - now_ns);
        if (at_ns > now_ns) {
            at_ns = now_ns;
        }
        else if (at_ns < self->last_ns) {
            at_ns = self->last_ns;
        }
        stamped = 1;
    }
    self->last_ns = at_ns;
    if (!stamped && call_transport(transport, count_unstamped_name, NULL) < 0) {
        PyBuffer_Release(&view);
        goto done;
    }
    int direct =
        lane != NULL && lane_api_found != NULL && Py_TYPE(lane) == lane_api_found->lane_type;
    if (direct) {
        /* The read, from the buffer it arrived in; a bytes object is made only for a read the
         * lane leaves to the Python path. */
        int taken = lane_api_found->relay_read(lane, (const char *)view.buf, size, at_ns);
        if (taken != 0) {
            PyBuffer_Release(&view);
            if (taken < 0) {
                fail_with_current(transport);
                goto done;
            }
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    data = PyBytes_FromStringAndSize((const char *)view.buf, size);
    PyBuffer_Release(&view);
    if (data == NULL) {
        goto done;
    }
    at_object = PyLong_FromLongLong(at_ns);
    if (at_object == NULL) {
        goto done;
    }
    if (lane != NULL && !direct) {
        PyObject *relay_args[3] = {lane, data, at_object};
        PyObject *taken = PyObject_VectorcallMethod(
            relay_name, relay_args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (taken == NULL) {
            fail_with_current(transport);
            goto done;
        }
        int whole = taken == Py_True;
        Py_DECREF(taken);
        if (whole) { /* parsed, counted, stamped and written to the client */
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    PyObject *deliver_args[3] = {protocol, data, at_object};
    PyObject *delivered = PyObject_VectorcallMethod(
        data_received_at_name, deliver_args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (delivered == NULL) {
        fail_with_current(transport);
        goto done;
    }
    Py_DECREF(delivered);
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(data);
    Py_XDECREF(at_object);
    Py_DECREF(transport);
    Py_DECREF(protocol);
    Py_XDECREF(lane);
    return result;
}

static PyObject *
reader_close(Reader *self, PyObject *unused)
{
    (void)unused;
    reader_clear(self);
    Py_RETURN_NONE;
}

static PyObject *
reader_get_lane(Reader *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->lane ? self->lane : Py_None);
}

static int
reader_set_lane(Reader *self, PyObject *value, void *closure)
{
    (void)closure;
    if (self->transport == NULL && value != NULL && value != Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "the reader is closed");
        return -1;
    }
    if (value != NULL && value != Py_None && !lane_api_sought) {
        lane_api_sought = 1;
        lane_api_found = PyCapsule_Import(LANE_API_CAPSULE, 0);
        if (lane_api_found == NULL) {
            PyErr_Clear(); /* no C lane entry: lanes are called by name */
        }
    }
    Py_XSETREF(self->lane, value == NULL || value == Py_None ? NULL : Py_NewRef(value));
    return 0;
}

static PyMethodDef reader_methods[] = {
    {"close", (PyCFunction)reader_close, METH_NOARGS,
     "close(): read no more; let go of the transport, the protocol and the lane."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef reader_getset[] = {
    {"lane", (getter)reader_get_lane, (setter)reader_set_lane,
     "The stream's C lane, offered each read first (None: none).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.proxy._recvstamp.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An upstream socket's reader callback in C (see _recvstamp.c).",
    .tp_new = reader_new,
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_traverse = (traverseproc)reader_traverse,
    .tp_clear = (inquiry)reader_clear,
    .tp_call = (ternaryfunc)reader_call,
    .tp_methods = reader_methods,
    .tp_getset = reader_getset,
};

static PyMethodDef methods[] = {
    {"receive", (PyCFunction)(void (*)(void))receive, METH_FASTCALL,
     "receive(fd, buffer) -> (data, realtime_ns): one recvmsg with the kernel's SO_TIMESTAMPNS "
     "stamp (-1 without one)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "sidecar.proxy._recvstamp",
    "One socket read with the kernel's receive timestamp, in C (see rxstamp.py).",
    0,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__recvstamp(void)
{
    if (PyType_Ready(&ReaderType) < 0) {
        return NULL;
    }
    data_received_at_name = PyUnicode_InternFromString("data_received_at");
    relay_name = PyUnicode_InternFromString("relay");
    close_name = PyUnicode_InternFromString("close");
    fail_name = PyUnicode_InternFromString("_fail");
    count_unstamped_name = PyUnicode_InternFromString("_count_unstamped");
    if (data_received_at_name == NULL || relay_name == NULL || close_name == NULL
        || fail_name == NULL || count_unstamped_name == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
