/* A record's wire form (recordwire.py, version 2), written in C: what `recordwire._encode`
 * writes, byte for byte, for every record without a request shape.
 *
 * Why C: every record a worker finishes is encoded for the collector, and the Python encoder
 * (a struct.pack per part, an encode and a length per string, a join) was ~625 of the ~9.9k
 * bytecodes a worker spends on a 32-token request. The layout is recordwire.py's; that module's
 * encoder stays its specification and the path for what this one hands back (a record with a
 * shape, attributes that are not a dict, a value of an unexpected type: None, and the Python
 * encoder decides, raising what it raises). tests/test_recordwire.py holds the two to the same
 * bytes on generated records.
 *
 * configure(outcome_index: dict, source_index: dict, version: int)
 *   The enums' wire indexes and the version byte, once, from recordwire.py.
 * encode(record) -> bytes | None
 *   KeyError for an enum member without an index, OverflowError for an integer beyond its
 *   field (the caller maps both to ValueError, as for the Python encoder).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *outcome_index, *source_index;
static int wire_version = -1;

/* Attribute names, interned once. */
enum {
    A_CLIENT, A_SERVER, A_ENGINE, A_SHAPE, A_CLIENT_STREAM, A_UPSTREAM_STREAM, A_N_IN, A_N_OUT,
    A_N_CACHED, A_HTTP_STATUS, A_REQUEST_READ, A_MODEL, A_FINISH_REASON, A_ERROR_TYPE, A_REPLICA,
    A_ROUTE_POLICY, A_WALL, A_OUTCOME, A_SOURCE, A_REQUEST_ID, A_ENDPOINT, A_ATTRIBUTES,
    A_TOKENS, A_OFFSETS, A_CHOICES, A_START, A_END, A_EVENTS_TOTAL, A_DATA, A_E_TTFT, A_E_GEN,
    A_E_QUEUE, A_E_ITL, A_E_TPS, N_NAMES
};
static const char *const name_text[N_NAMES] = {
    "client", "server", "engine", "shape", "client_stream", "upstream_stream", "n_in", "n_out",
    "n_cached", "http_status", "request_read_ns", "model", "finish_reason", "error_type",
    "replica", "route_policy", "wall_time_ns", "outcome", "token_source", "request_id",
    "endpoint", "attributes", "tokens", "offsets_ns", "choices", "start_ns", "end_ns",
    "events_total", "data", "time_to_first_token_ms", "generation_time_ms", "queue_time_ms",
    "mean_itl_ms", "tokens_per_second",
};
static PyObject *names[N_NAMES];

/* recordwire.py's presence bits. */
#define HAS_SERVER (1u << 0)
#define HAS_ENGINE (1u << 1)
#define HAS_N_IN (1u << 3)
#define HAS_N_OUT (1u << 4)
#define HAS_N_CACHED (1u << 5)
#define HAS_HTTP_STATUS (1u << 6)
#define CLIENT_STREAM (1u << 7)
#define UPSTREAM_STREAM (1u << 8)
#define TOKENS_SHARED (1u << 9)
#define STRING_BIT(i) (1u << (10 + (i)))
#define HAS_REQUEST_READ (1u << 15)
#define TIMELINE_HAS_END 1
#define TIMELINE_HAS_CHOICES 2

/* The frame being written: grows by doubling. */
typedef struct {
    char *data;
    Py_ssize_t size, capacity;
} out_buffer;

static int
reserve(out_buffer *out, Py_ssize_t more)
{
    if (out->size + more <= out->capacity) {
        return 0;
    }
    Py_ssize_t capacity = out->capacity ? out->capacity : 512;
    while (capacity < out->size + more) {
        capacity *= 2;
    }
    char *data = PyMem_Realloc(out->data, (size_t)capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    out->data = data;
    out->capacity = capacity;
    return 0;
}

static int
put(out_buffer *out, const void *bytes, Py_ssize_t n)
{
    if (reserve(out, n) < 0) {
        return -1;
    }
    memcpy(out->data + out->size, bytes, (size_t)n);
    out->size += n;
    return 0;
}

/* Little-endian fields (the module is built only where that is the native order: see
 * PyInit__recordwire). */
static int
put_u8(out_buffer *out, unsigned v)
{
    unsigned char b = (unsigned char)v;
    return put(out, &b, 1);
}

static int
put_u32(out_buffer *out, uint32_t v)
{
    return put(out, &v, 4);
}

static int
put_i64(out_buffer *out, long long v)
{
    int64_t w = (int64_t)v;
    return put(out, &w, 8);
}

static int
put_f64(out_buffer *out, double v)
{
    return put(out, &v, 8);
}

/* An int for a q field: OverflowError beyond 64 bits (struct.pack's struct.error, here). A
 * bool is an int to struct as well. */
static int
as_i64(PyObject *value, long long *v)
{
    if (!PyLong_Check(value)) {
        return 1; /* not an int: the Python encoder decides */
    }
    *v = PyLong_AsLongLong(value);
    if (*v == -1 && PyErr_Occurred()) {
        return -1;
    }
    return 0;
}

/* u32 length + UTF-8 (surrogates passed through). 1: not a str. */
static int
put_text(out_buffer *out, PyObject *value)
{
    if (!PyUnicode_Check(value)) {
        return 1;
    }
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(value, &n);
    if (utf8 != NULL) {
        if (n > (Py_ssize_t)UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "string longer than 4 GiB");
            return -1;
        }
        if (put_u32(out, (uint32_t)n) < 0) {
            return -1;
        }
        return put(out, utf8, n);
    }
    /* A lone surrogate has no UTF-8 form: "surrogatepass", as recordwire._text. */
    PyErr_Clear();
    PyObject *raw = PyUnicode_AsEncodedString(value, "utf-8", "surrogatepass");
    if (raw == NULL) {
        return -1;
    }
    n = PyBytes_GET_SIZE(raw);
    int failed = n > (Py_ssize_t)UINT32_MAX || put_u32(out, (uint32_t)n) < 0
                 || put(out, PyBytes_AS_STRING(raw), n) < 0;
    if (n > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "string longer than 4 GiB");
    }
    Py_DECREF(raw);
    return failed ? -1 : 0;
}

/* The packed bytes of an Int64s (its `data`), new reference; NULL with no error: not bytes. */
static PyObject *
column_bytes(PyObject *column)
{
    PyObject *data = PyObject_GetAttr(column, names[A_DATA]);
    if (data == NULL) {
        return NULL;
    }
    if (!PyBytes_CheckExact(data) || PyBytes_GET_SIZE(data) % 8) {
        Py_DECREF(data);
        return NULL;
    }
    return data;
}

/* The parts of one timeline the frame needs: its head fields and its columns' bytes. */
typedef struct {
    long long start, end, events_total;
    int has_end;
    PyObject *offsets, *tokens, *choices; /* bytes, owned; choices NULL when absent */
} timeline_parts;

static void
release_timeline(timeline_parts *t)
{
    Py_CLEAR(t->offsets);
    Py_CLEAR(t->tokens);
    Py_CLEAR(t->choices);
}

/* 0: read; 1: not what the Python encoder would take as is (it decides); -1: an error. */
static int
read_timeline(PyObject *timeline, timeline_parts *t)
{
    int status = 1;
    PyObject *start = PyObject_GetAttr(timeline, names[A_START]);
    PyObject *end = PyObject_GetAttr(timeline, names[A_END]);
    PyObject *events = PyObject_GetAttr(timeline, names[A_EVENTS_TOTAL]);
    PyObject *offsets = PyObject_GetAttr(timeline, names[A_OFFSETS]);
    PyObject *tokens = PyObject_GetAttr(timeline, names[A_TOKENS]);
    PyObject *choices = PyObject_GetAttr(timeline, names[A_CHOICES]);
    if (start == NULL || end == NULL || events == NULL || offsets == NULL || tokens == NULL
        || choices == NULL) {
        status = -1;
        goto done;
    }
    int r;
    if ((r = as_i64(start, &t->start)) != 0 || (r = as_i64(events, &t->events_total)) != 0) {
        status = r;
        goto done;
    }
    t->has_end = end != Py_None;
    t->end = 0;
    if (t->has_end && (r = as_i64(end, &t->end)) != 0) {
        status = r;
        goto done;
    }
    /* each read only if the one before went well (no call with an exception pending) */
    if ((t->offsets = column_bytes(offsets)) == NULL
        || (t->tokens = column_bytes(tokens)) == NULL
        || (choices != Py_None && (t->choices = column_bytes(choices)) == NULL)) {
        status = PyErr_Occurred() ? -1 : 1;
        goto done;
    }
    status = 0;
done:
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(events);
    Py_XDECREF(offsets);
    Py_XDECREF(tokens);
    Py_XDECREF(choices);
    if (status != 0) {
        release_timeline(t);
    }
    return status;
}

static int
put_timeline_head(out_buffer *out, const timeline_parts *t)
{
    Py_ssize_t n = PyBytes_GET_SIZE(t->offsets) / 8;
    if (n > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more than 2**32 events");
        return -1;
    }
    unsigned bits = (t->has_end ? TIMELINE_HAS_END : 0) | (t->choices ? TIMELINE_HAS_CHOICES : 0);
    if (put_i64(out, t->start) < 0 || put_i64(out, t->end) < 0
        || put_i64(out, t->events_total) < 0 || put_u8(out, bits) < 0
        || put_u32(out, (uint32_t)n) < 0) {
        return -1;
    }
    return 0;
}

static int
put_column(out_buffer *out, PyObject *data)
{
    return put(out, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
}

/* An enum member's wire index (KeyError without one, as the Python encoder's dict lookup). */
static int
enum_index(PyObject *table, PyObject *member, unsigned *index)
{
    PyObject *value = PyDict_GetItemWithError(table, member);
    if (value == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, member);
        }
        return -1;
    }
    long v = PyLong_AsLong(value);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *index = (unsigned)v;
    return 0;
}

static PyObject *
encode(PyObject *module, PyObject *record)
{
    (void)module;
    if (wire_version < 0) {
        PyErr_SetString(PyExc_RuntimeError, "encode() before configure()");
        return NULL;
    }
    PyObject *got[N_NAMES] = {NULL};
    timeline_parts client = {0}, server = {0};
    out_buffer out = {NULL, 0, 0};
    PyObject *answer = NULL;
    int r = 0;
    static const int read_first[] = {
        A_CLIENT, A_SERVER, A_ENGINE, A_SHAPE, A_CLIENT_STREAM, A_UPSTREAM_STREAM, A_N_IN,
        A_N_OUT, A_N_CACHED, A_HTTP_STATUS, A_REQUEST_READ, A_MODEL, A_FINISH_REASON,
        A_ERROR_TYPE, A_REPLICA, A_ROUTE_POLICY, A_WALL, A_OUTCOME, A_SOURCE, A_REQUEST_ID,
        A_ENDPOINT, A_ATTRIBUTES,
    };
    for (size_t i = 0; i < sizeof read_first / sizeof read_first[0]; i++) {
        got[read_first[i]] = PyObject_GetAttr(record, names[read_first[i]]);
        if (got[read_first[i]] == NULL) {
            goto fail;
        }
    }
    if (got[A_SHAPE] != Py_None || !PyDict_CheckExact(got[A_ATTRIBUTES])) {
        goto python; /* rare: a shape (capture, prefix routing), odd attributes */
    }
    if ((r = read_timeline(got[A_CLIENT], &client)) != 0) {
        goto decided;
    }
    int has_server = got[A_SERVER] != Py_None;
    if (has_server && (r = read_timeline(got[A_SERVER], &server)) != 0) {
        goto decided;
    }

    uint32_t flags = 0;
    int truth;
    if ((truth = PyObject_IsTrue(got[A_CLIENT_STREAM])) < 0) {
        goto fail;
    }
    flags |= truth ? CLIENT_STREAM : 0;
    if ((truth = PyObject_IsTrue(got[A_UPSTREAM_STREAM])) < 0) {
        goto fail;
    }
    flags |= truth ? UPSTREAM_STREAM : 0;
    if (has_server) {
        flags |= HAS_SERVER;
        Py_ssize_t client_size = PyBytes_GET_SIZE(client.tokens);
        if (client_size <= PyBytes_GET_SIZE(server.tokens)
            && memcmp(PyBytes_AS_STRING(server.tokens), PyBytes_AS_STRING(client.tokens),
                      (size_t)client_size) == 0) {
            flags |= TOKENS_SHARED;
        }
    }
    flags |= got[A_ENGINE] != Py_None ? HAS_ENGINE : 0;
    static const int counts[] = {A_N_IN, A_N_OUT, A_N_CACHED, A_HTTP_STATUS, A_REQUEST_READ};
    static const uint32_t count_bits[] = {HAS_N_IN, HAS_N_OUT, HAS_N_CACHED, HAS_HTTP_STATUS,
                                          HAS_REQUEST_READ};
    long long count_values[5] = {0, 0, 0, 0, 0};
    for (int i = 0; i < 5; i++) {
        PyObject *value = got[counts[i]];
        if (value != Py_None) {
            flags |= count_bits[i];
            /* `n or 0`: the value itself, 0 when falsy */
            if ((r = as_i64(value, &count_values[i])) != 0) {
                goto decided;
            }
        }
    }
    static const int optional[] = {A_MODEL, A_FINISH_REASON, A_ERROR_TYPE, A_REPLICA,
                                   A_ROUTE_POLICY};
    for (int i = 0; i < 5; i++) {
        flags |= got[optional[i]] != Py_None ? STRING_BIT(i) : 0;
    }
    long long wall;
    if ((r = as_i64(got[A_WALL], &wall)) != 0) {
        goto decided;
    }
    unsigned outcome, source;
    if (enum_index(outcome_index, got[A_OUTCOME], &outcome) < 0
        || enum_index(source_index, got[A_SOURCE], &source) < 0) {
        goto fail;
    }
    if (outcome > 255 || source > 255) {
        PyErr_SetString(PyExc_OverflowError, "an enum index beyond a byte");
        goto fail;
    }

    /* version | _FIXED | client head | [server head] | [engine] */
    if (put_u8(&out, (unsigned)wire_version) < 0 || put_u32(&out, flags) < 0
        || put_i64(&out, wall) < 0 || put_u8(&out, outcome) < 0 || put_u8(&out, source) < 0) {
        goto fail;
    }
    for (int i = 0; i < 5; i++) {
        if (put_i64(&out, count_values[i]) < 0) {
            goto fail;
        }
    }
    if (put_timeline_head(&out, &client) < 0
        || (has_server && put_timeline_head(&out, &server) < 0)) {
        goto fail;
    }
    if (flags & HAS_ENGINE) {
        static const int engine_fields[] = {A_E_TTFT, A_E_GEN, A_E_QUEUE, A_E_ITL, A_E_TPS};
        double values[5] = {0, 0, 0, 0, 0};
        unsigned present = 0;
        for (int i = 0; i < 5; i++) {
            PyObject *value = PyObject_GetAttr(got[A_ENGINE], names[engine_fields[i]]);
            if (value == NULL) {
                goto fail;
            }
            if (value != Py_None) {
                if (!PyFloat_Check(value) && !PyLong_Check(value)) {
                    Py_DECREF(value);
                    goto python;
                }
                present |= 1u << i;
                values[i] = PyFloat_AsDouble(value);
                if (values[i] == -1.0 && PyErr_Occurred()) {
                    Py_DECREF(value);
                    goto fail;
                }
            }
            Py_DECREF(value);
        }
        if (put_u8(&out, present) < 0) {
            goto fail;
        }
        for (int i = 0; i < 5; i++) {
            if (put_f64(&out, values[i]) < 0) {
                goto fail;
            }
        }
    }
    /* strings: request_id, endpoint, the optional ones present, the attributes */
    if ((r = put_text(&out, got[A_REQUEST_ID])) != 0
        || (r = put_text(&out, got[A_ENDPOINT])) != 0) {
        goto decided;
    }
    for (int i = 0; i < 5; i++) {
        if (got[optional[i]] != Py_None && (r = put_text(&out, got[optional[i]])) != 0) {
            goto decided;
        }
    }
    PyObject *attributes = got[A_ATTRIBUTES];
    Py_ssize_t n_attributes = PyDict_GET_SIZE(attributes);
    if (put_u32(&out, (uint32_t)n_attributes) < 0) {
        goto fail;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(attributes, &pos, &key, &value)) {
        if ((r = put_text(&out, key)) != 0 || (r = put_text(&out, value)) != 0) {
            goto decided;
        }
    }
    /* columns: client offsets, [client tokens unless shared], [client choices], then the
     * server's offsets, tokens, [choices] */
    if (put_column(&out, client.offsets) < 0
        || (!(flags & TOKENS_SHARED) && put_column(&out, client.tokens) < 0)
        || (client.choices && put_column(&out, client.choices) < 0)) {
        goto fail;
    }
    if (has_server
        && (put_column(&out, server.offsets) < 0 || put_column(&out, server.tokens) < 0
            || (server.choices && put_column(&out, server.choices) < 0))) {
        goto fail;
    }
    answer = PyBytes_FromStringAndSize(out.data, out.size);
    goto done;

decided:
    if (r < 0) {
        goto fail;
    }
python:
    answer = Py_NewRef(Py_None);
    goto done;
fail:
    answer = NULL;
done:
    PyMem_Free(out.data);
    release_timeline(&client);
    release_timeline(&server);
    for (int i = 0; i < N_NAMES; i++) {
        Py_XDECREF(got[i]);
    }
    return answer;
}

static PyObject *
configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1])
        || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "configure() takes (outcome index, token source index, version)");
        return NULL;
    }
    long version = PyLong_AsLong(args[2]);
    if (version < 0 || version > 255) {
        PyErr_SetString(PyExc_ValueError, "configure(): a version is one byte");
        return NULL;
    }
    Py_XSETREF(outcome_index, Py_NewRef(args[0]));
    Py_XSETREF(source_index, Py_NewRef(args[1]));
    wire_version = (int)version;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_O,
     "encode(record) -> bytes | None: recordwire._encode's bytes, or None for a record the "
     "Python encoder must take (a shape, odd types)."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(outcome_index, source_index, version): recordwire's tables, once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "sidecar.proxy._recordwire",
    "A record's wire form written in C (see recordwire.py).",
    0,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__recordwire(void)
{
#if PY_BIG_ENDIAN
    /* The frame is little-endian and written with memcpy: elsewhere, the Python encoder. */
    PyErr_SetString(PyExc_ImportError, "_recordwire is for little-endian hosts");
    return NULL;
#endif
    for (int i = 0; i < N_NAMES; i++) {
        names[i] = PyUnicode_InternFromString(name_text[i]);
        if (names[i] == NULL) {
            return NULL;
        }
    }
    return PyModule_Create(&module_def);
}
