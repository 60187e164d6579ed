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

#ifndef SCM_TIMESTAMPNS
#define SCM_TIMESTAMPNS SO_TIMESTAMPNS
#endif

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
    struct iovec iov = {view.buf, (size_t)view.len};
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
    ssize_t size = recvmsg((int)fd, &message, 0);
    if (size < 0) {
        PyBuffer_Release(&view);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    long long stamp = -1;
    struct cmsghdr *first = message.msg_controllen ? CMSG_FIRSTHDR(&message) : NULL;
    if (first != NULL && first->cmsg_level == SOL_SOCKET && first->cmsg_type == SCM_TIMESTAMPNS
        && first->cmsg_len == CMSG_LEN(sizeof(struct timespec))) {
        struct timespec at;
        memcpy(&at, CMSG_DATA(first), sizeof at);
        stamp = (long long)at.tv_sec * 1000000000LL + (long long)at.tv_nsec;
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
    return PyModule_Create(&module_def);
}
