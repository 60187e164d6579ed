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
 * configure_slots(RequestRecord, Timeline) -> int
 *   Objects of exactly these types have their fields read from their slots (field_of); the
 *   count of the encoder's names that are slots of either.
 * configure_decoder(record, timeline, engine, column, WireError, outcomes, token_sources)
 *   `record`, `timeline`, `engine`: RequestRecord, Timeline and EngineTiming or their
 *   constructors (record.new_record, ...), called with their fields by name;
 *   `column(bytes) -> Int64s`: the type, or the C type's factory (_recordtypes.from_bytes).
 * decode(data: bytes) -> RequestRecord | None
 *   The collector's side: recordwire._decode's record (the version byte already checked by
 *   the caller), or None for a record with a shape (the Python decoder's). Bytes cut short or
 *   not UTF-8 raise WireError as there; an enum index out of range IndexError and columns that
 *   do not agree the record types' ValueError, which the caller turns into WireError as it
 *   does for the Python decoder.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h> /* T_OBJECT_EX: what a __slots__ member is */

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

/* Where each name is a slot of an exact RequestRecord or Timeline (configure_slots; -1: not
 * one of its slots). An object of exactly that type has its field read at that offset: the
 * generic getattr of 34 fields per record (22 of the record's, 6 of each timeline's) was
 * ~5k instructions of a worker's request (benchmarks/RESULTS.md, "Session 27"). Any other object (a subclass, which could override
 * a field; before configure_slots), and an unset slot, are read by getattr as before. */
static PyTypeObject *slotted_record, *slotted_timeline;
static Py_ssize_t record_offset[N_NAMES], timeline_offset[N_NAMES];

static PyObject *
field_of(PyObject *obj, PyTypeObject *type, const Py_ssize_t *offsets, int name)
{
    if (Py_TYPE(obj) == type && offsets[name] >= 0) {
        PyObject *value = *(PyObject **)((char *)obj + offsets[name]);
        if (value != NULL) {
            return Py_NewRef(value);
        }
    }
    return PyObject_GetAttr(obj, names[name]);
}

/* Each name's slot offset in ``type``, -1 where it is not a plain object slot. */
static int
slot_offsets(PyTypeObject *type, Py_ssize_t *offsets)
{
    for (int i = 0; i < N_NAMES; i++) {
        offsets[i] = -1;
        PyObject *descr = PyObject_GetAttr((PyObject *)type, names[i]);
        if (descr == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                return -1;
            }
            PyErr_Clear();
            continue;
        }
        if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == T_OBJECT_EX && member->offset > 0) {
                offsets[i] = member->offset;
            }
        }
        Py_DECREF(descr);
    }
    return 0;
}

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

/* u32 length + the bytes. */
static int
put_sized(out_buffer *out, const char *bytes, Py_ssize_t n)
{
    if (n > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "string longer than 4 GiB");
        return -1;
    }
    if (put_u32(out, (uint32_t)n) < 0) {
        return -1;
    }
    return put(out, bytes, n);
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
        return put_sized(out, utf8, n);
    }
    /* A lone surrogate has no UTF-8 form: "surrogatepass", as recordwire._text. */
    PyErr_Clear();
    PyObject *raw = PyUnicode_AsEncodedString(value, "utf-8", "surrogatepass");
    if (raw == NULL) {
        return -1;
    }
    int status = put_sized(out, PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw));
    Py_DECREF(raw);
    return status;
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
    PyObject *start = field_of(timeline, slotted_timeline, timeline_offset, A_START);
    PyObject *end = field_of(timeline, slotted_timeline, timeline_offset, A_END);
    PyObject *events = field_of(timeline, slotted_timeline, timeline_offset, A_EVENTS_TOTAL);
    PyObject *offsets = field_of(timeline, slotted_timeline, timeline_offset, A_OFFSETS);
    PyObject *tokens = field_of(timeline, slotted_timeline, timeline_offset, A_TOKENS);
    PyObject *choices = field_of(timeline, slotted_timeline, timeline_offset, A_CHOICES);
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
        got[read_first[i]] = field_of(record, slotted_record, record_offset, read_first[i]);
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

/* -- decode: the collector's side ------------------------------------------------------- */

/* Given by configure_decoder, once: the types a record is made of, the enums by wire index,
 * and WireError. */
static PyObject *record_type, *timeline_type, *engine_type, *int64s_type, *wire_error;
static PyObject *outcomes, *sources; /* tuples */
static PyObject *record_kwnames, *timeline_kwnames;

static const char *const record_fields[] = {
    "request_id", "wall_time_ns", "outcome", "endpoint", "model", "client_stream",
    "upstream_stream", "client", "server", "engine", "n_in", "n_out", "n_cached",
    "token_source", "finish_reason", "http_status", "error_type", "replica", "route_policy",
    "attributes", "request_read_ns",
};
#define N_RECORD_FIELDS ((Py_ssize_t)(sizeof record_fields / sizeof record_fields[0]))
static const char *const timeline_fields[] = {
    "start_ns", "offsets_ns", "tokens", "end_ns", "events_total", "choices",
};
#define N_TIMELINE_FIELDS 6

#define FIXED_SIZE 54    /* <IqBBqqqqq */
#define TIMELINE_SIZE 29 /* <qqqBI */
#define ENGINE_SIZE 41   /* <B5d */
#define HAS_SHAPE (1u << 2)

typedef struct {
    const unsigned char *data;
    Py_ssize_t size, pos;
} reader;

static int
cut_short(void)
{
    PyErr_SetString(wire_error, "record bytes cut short");
    return -1;
}

static int
need(reader *r, Py_ssize_t n)
{
    return r->pos + n > r->size ? cut_short() : 0;
}

static long long
i64_at(const unsigned char *p)
{
    int64_t v;
    memcpy(&v, p, 8);
    return (long long)v;
}

static uint32_t
u32_at(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* A string (u32 length + UTF-8, surrogates passed): new reference, or NULL and WireError. */
static PyObject *
text_at(reader *r)
{
    if (need(r, 4) < 0) {
        return NULL;
    }
    Py_ssize_t n = (Py_ssize_t)u32_at(r->data + r->pos);
    r->pos += 4;
    if (need(r, n) < 0) {
        return NULL;
    }
    PyObject *value =
        PyUnicode_DecodeUTF8((const char *)r->data + r->pos, n, "surrogatepass");
    if (value == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyObject *type, *exc, *tb;
            PyErr_Fetch(&type, &exc, &tb);
            PyErr_NormalizeException(&type, &exc, &tb);
            PyErr_Format(wire_error, "not UTF-8: %S", exc);
            Py_XDECREF(type);
            Py_XDECREF(exc);
            Py_XDECREF(tb);
        }
        return NULL;
    }
    r->pos += n;
    return value;
}

/* An Int64s of ``count`` values at the reader, new reference. */
static PyObject *
column_at(reader *r, Py_ssize_t count)
{
    if (count > (r->size - r->pos) / 8) {
        cut_short();
        return NULL;
    }
    PyObject *raw = PyBytes_FromStringAndSize((const char *)r->data + r->pos, 8 * count);
    if (raw == NULL) {
        return NULL;
    }
    r->pos += 8 * count;
    PyObject *column = PyObject_CallOneArg(int64s_type, raw);
    Py_DECREF(raw);
    return column;
}

typedef struct {
    long long start, end, events_total;
    unsigned bits;
    uint32_t n;
} timeline_head;

static void
head_at(reader *r, timeline_head *h)
{
    const unsigned char *p = r->data + r->pos;
    h->start = i64_at(p);
    h->end = i64_at(p + 8);
    h->events_total = i64_at(p + 16);
    h->bits = p[24];
    h->n = u32_at(p + 25);
    r->pos += TIMELINE_SIZE;
}

/* Timeline(start_ns=, offsets_ns=, tokens=, end_ns=, events_total=, choices=); steals the
 * three columns (choices may be NULL: None). */
static PyObject *
make_timeline(const timeline_head *h, PyObject *offsets, PyObject *tokens, PyObject *choices)
{
    PyObject *args[N_TIMELINE_FIELDS] = {
        PyLong_FromLongLong(h->start),
        offsets,
        tokens,
        h->bits & TIMELINE_HAS_END ? PyLong_FromLongLong(h->end) : Py_NewRef(Py_None),
        PyLong_FromLongLong(h->events_total),
        choices ? choices : Py_NewRef(Py_None),
    };
    PyObject *timeline = NULL;
    int ok = 1;
    for (int i = 0; i < N_TIMELINE_FIELDS; i++) {
        ok &= args[i] != NULL;
    }
    if (ok) {
        timeline = PyObject_Vectorcall(timeline_type, args, 0, timeline_kwnames);
    }
    for (int i = 0; i < N_TIMELINE_FIELDS; i++) {
        Py_XDECREF(args[i]);
    }
    return timeline;
}

/* decode(data: bytes) -> RequestRecord | None: recordwire._decode's record (None: one with a
 * request shape, for the Python decoder); WireError for bytes cut short or not UTF-8; what the
 * record's types raise (ValueError) for columns that do not agree. */
static PyObject *
decode(PyObject *module, PyObject *arg)
{
    (void)module;
    if (record_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "decode() before configure_decoder()");
        return NULL;
    }
    if (!PyBytes_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "decode() takes bytes");
        return NULL;
    }
    reader r = {(const unsigned char *)PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg), 0};
    PyObject *values[N_RECORD_FIELDS] = {NULL};
    PyObject *optional[5] = {NULL};
    PyObject *attributes = NULL, *client_offsets = NULL, *client_tokens = NULL;
    PyObject *client_choices = NULL, *server_offsets = NULL, *server_tokens = NULL;
    PyObject *server_choices = NULL, *server = NULL, *client = NULL, *engine = NULL;
    PyObject *answer = NULL;

    r.pos = 1 + FIXED_SIZE;
    if (need(&r, TIMELINE_SIZE) < 0) {
        goto done;
    }
    const unsigned char *fixed = r.data + 1;
    uint32_t flags = u32_at(fixed);
    if (flags & HAS_SHAPE) {
        answer = Py_NewRef(Py_None);
        goto done;
    }
    long long wall = i64_at(fixed + 4);
    unsigned outcome = fixed[12], source = fixed[13];
    long long counts[5];
    for (int i = 0; i < 5; i++) {
        counts[i] = i64_at(fixed + 14 + 8 * i);
    }
    timeline_head client_head, server_head;
    head_at(&r, &client_head);
    int has_server = (flags & HAS_SERVER) != 0;
    if (has_server) {
        if (need(&r, TIMELINE_SIZE) < 0) {
            goto done;
        }
        head_at(&r, &server_head);
    }
    if (flags & HAS_ENGINE) {
        if (need(&r, ENGINE_SIZE) < 0) {
            goto done;
        }
        const unsigned char *p = r.data + r.pos;
        PyObject *fields[5] = {NULL};
        int ok = 1;
        for (int i = 0; i < 5; i++) {
            double v;
            memcpy(&v, p + 1 + 8 * i, 8);
            fields[i] = p[0] & (1u << i) ? PyFloat_FromDouble(v) : Py_NewRef(Py_None);
            ok &= fields[i] != NULL;
        }
        if (ok) {
            engine = PyObject_Vectorcall(engine_type, fields, 5, NULL);
        }
        for (int i = 0; i < 5; i++) {
            Py_XDECREF(fields[i]);
        }
        if (engine == NULL) {
            goto done;
        }
        r.pos += ENGINE_SIZE;
    }
    PyObject *request_id = text_at(&r);
    if (request_id == NULL) {
        goto done;
    }
    values[0] = request_id;
    if ((values[3] = text_at(&r)) == NULL) { /* endpoint */
        goto done;
    }
    for (int i = 0; i < 5; i++) {
        if (flags & STRING_BIT(i)) {
            if ((optional[i] = text_at(&r)) == NULL) {
                goto done;
            }
        }
        else {
            optional[i] = Py_NewRef(Py_None);
        }
    }
    if (need(&r, 4) < 0) {
        goto done;
    }
    uint32_t n_attributes = u32_at(r.data + r.pos);
    r.pos += 4;
    if ((attributes = PyDict_New()) == NULL) {
        goto done;
    }
    for (uint32_t i = 0; i < n_attributes; i++) {
        PyObject *key = text_at(&r);
        if (key == NULL) {
            goto done;
        }
        PyObject *value = text_at(&r);
        if (value == NULL) {
            Py_DECREF(key);
            goto done;
        }
        int failed = PyDict_SetItem(attributes, key, value) < 0;
        Py_DECREF(key);
        Py_DECREF(value);
        if (failed) {
            goto done;
        }
    }
    Py_ssize_t n_client = client_head.n;
    if ((client_offsets = column_at(&r, n_client)) == NULL) {
        goto done;
    }
    int shared = (flags & TOKENS_SHARED) && has_server;
    if (!shared && (client_tokens = column_at(&r, n_client)) == NULL) {
        goto done;
    }
    if ((client_head.bits & TIMELINE_HAS_CHOICES)
        && (client_choices = column_at(&r, n_client)) == NULL) {
        goto done;
    }
    if (has_server) {
        Py_ssize_t n_server = server_head.n;
        if ((server_offsets = column_at(&r, n_server)) == NULL
            || (server_tokens = column_at(&r, n_server)) == NULL) {
            goto done;
        }
        if ((server_head.bits & TIMELINE_HAS_CHOICES)
            && (server_choices = column_at(&r, n_server)) == NULL) {
            goto done;
        }
        if (client_tokens == NULL) {
            if (n_client > n_server) {
                PyErr_SetString(wire_error,
                                "shared token column shorter than the client's events");
                goto done;
            }
            if (n_client == n_server) { /* one object for both sides, as records keep it */
                client_tokens = Py_NewRef(server_tokens);
            }
            else {
                PyObject *data = PyObject_GetAttr(server_tokens, names[A_DATA]);
                if (data == NULL) {
                    goto done;
                }
                PyObject *prefix = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data),
                                                             8 * n_client);
                Py_DECREF(data);
                if (prefix == NULL) {
                    goto done;
                }
                client_tokens = PyObject_CallOneArg(int64s_type, prefix);
                Py_DECREF(prefix);
                if (client_tokens == NULL) {
                    goto done;
                }
            }
        }
        server = make_timeline(&server_head, server_offsets, server_tokens, server_choices);
        server_offsets = server_tokens = server_choices = NULL; /* stolen */
        if (server == NULL) {
            goto done;
        }
    }
    client = make_timeline(&client_head, client_offsets, client_tokens, client_choices);
    client_offsets = client_tokens = client_choices = NULL;
    if (client == NULL) {
        goto done;
    }
    if (r.pos != r.size) {
        PyErr_Format(wire_error, "%zd bytes after the record", r.size - r.pos);
        goto done;
    }
    if (outcome >= (unsigned)PyTuple_GET_SIZE(outcomes)
        || source >= (unsigned)PyTuple_GET_SIZE(sources)) {
        PyErr_SetString(PyExc_IndexError, "tuple index out of range");
        goto done;
    }
    /* RequestRecord(request_id, wall_time_ns, outcome, endpoint, model, client_stream,
     * upstream_stream, client, server, engine, n_in, n_out, n_cached, token_source,
     * finish_reason, http_status, error_type, replica, route_policy, attributes,
     * request_read_ns), by keyword */
    values[1] = PyLong_FromLongLong(wall);
    values[2] = Py_NewRef(PyTuple_GET_ITEM(outcomes, outcome));
    values[4] = Py_NewRef(optional[0]);
    values[5] = PyBool_FromLong(flags & CLIENT_STREAM);
    values[6] = PyBool_FromLong(flags & UPSTREAM_STREAM);
    values[7] = Py_NewRef(client);
    values[8] = server ? Py_NewRef(server) : Py_NewRef(Py_None);
    values[9] = engine ? Py_NewRef(engine) : Py_NewRef(Py_None);
    static const uint32_t count_bits[] = {HAS_N_IN, HAS_N_OUT, HAS_N_CACHED};
    for (int i = 0; i < 3; i++) {
        values[10 + i] =
            flags & count_bits[i] ? PyLong_FromLongLong(counts[i]) : Py_NewRef(Py_None);
    }
    values[13] = Py_NewRef(PyTuple_GET_ITEM(sources, source));
    values[14] = Py_NewRef(optional[1]);
    values[15] = flags & HAS_HTTP_STATUS ? PyLong_FromLongLong(counts[3]) : Py_NewRef(Py_None);
    values[16] = Py_NewRef(optional[2]);
    values[17] = Py_NewRef(optional[3]);
    values[18] = Py_NewRef(optional[4]);
    values[19] = Py_NewRef(attributes);
    values[20] =
        flags & HAS_REQUEST_READ ? PyLong_FromLongLong(counts[4]) : Py_NewRef(Py_None);
    for (Py_ssize_t i = 0; i < N_RECORD_FIELDS; i++) {
        if (values[i] == NULL) {
            goto done;
        }
    }
    answer = PyObject_Vectorcall(record_type, values, 0, record_kwnames);
    if (answer != NULL) {
        /* Out of the cycle collector's reach. The collector process holds a window of records
         * (100,000 by default), each tracked with its timelines: ~3.8 objects per record for
         * every full collection to scan, 54-72 ms at 100,000 records, about one every 25,000
         * records taken. A record decoded here refers to strings, ints, enum members, an
         * attributes dict of strings, its engine timings (floats) and its timelines (ints and
         * columns): it can be in no reference cycle, so no garbage can hide behind it. (A
         * subtype's dealloc untracks only what is tracked.) */
        PyObject *const kept[] = {answer, client, server, engine};
        for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++) {
            if (kept[i] != NULL && PyObject_IS_GC(kept[i])) {
                PyObject_GC_UnTrack(kept[i]);
            }
        }
    }
done:
    for (Py_ssize_t i = 0; i < N_RECORD_FIELDS; i++) {
        Py_XDECREF(values[i]);
    }
    for (int i = 0; i < 5; i++) {
        Py_XDECREF(optional[i]);
    }
    Py_XDECREF(attributes);
    Py_XDECREF(client_offsets);
    Py_XDECREF(client_tokens);
    Py_XDECREF(client_choices);
    Py_XDECREF(server_offsets);
    Py_XDECREF(server_tokens);
    Py_XDECREF(server_choices);
    Py_XDECREF(server);
    Py_XDECREF(client);
    Py_XDECREF(engine);
    return answer;
}

static PyObject *
names_tuple(const char *const *fields, Py_ssize_t n)
{
    PyObject *tuple = PyTuple_New(n);
    if (tuple == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyUnicode_InternFromString(fields[i]);
        if (name == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, i, name);
    }
    return tuple;
}

/* configure_decoder(RequestRecord, Timeline, EngineTiming, column, WireError, outcomes,
 * token_sources): recordwire's types and tables, once. */
static PyObject *
configure_decoder(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7 || !PyTuple_CheckExact(args[5]) || !PyTuple_CheckExact(args[6])
        || !PyExceptionClass_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "configure_decoder() takes (RequestRecord, Timeline, EngineTiming, "
                        "Int64s, WireError, outcomes, token_sources)");
        return NULL;
    }
    if (record_kwnames == NULL) {
        record_kwnames = names_tuple(record_fields, N_RECORD_FIELDS);
        timeline_kwnames = names_tuple(timeline_fields, N_TIMELINE_FIELDS);
        if (record_kwnames == NULL || timeline_kwnames == NULL) {
            return NULL;
        }
    }
    Py_XSETREF(record_type, Py_NewRef(args[0]));
    Py_XSETREF(timeline_type, Py_NewRef(args[1]));
    Py_XSETREF(engine_type, Py_NewRef(args[2]));
    Py_XSETREF(int64s_type, Py_NewRef(args[3]));
    Py_XSETREF(wire_error, Py_NewRef(args[4]));
    Py_XSETREF(outcomes, Py_NewRef(args[5]));
    Py_XSETREF(sources, Py_NewRef(args[6]));
    Py_RETURN_NONE;
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

static PyObject *
configure_slots(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "configure_slots() takes (RequestRecord, Timeline)");
        return NULL;
    }
    Py_ssize_t record_offsets[N_NAMES], timeline_offsets[N_NAMES];
    if (slot_offsets((PyTypeObject *)args[0], record_offsets) < 0
        || slot_offsets((PyTypeObject *)args[1], timeline_offsets) < 0) {
        return NULL;
    }
    memcpy(record_offset, record_offsets, sizeof record_offset);
    memcpy(timeline_offset, timeline_offsets, sizeof timeline_offset);
    Py_XSETREF(slotted_record, (PyTypeObject *)Py_NewRef(args[0]));
    Py_XSETREF(slotted_timeline, (PyTypeObject *)Py_NewRef(args[1]));
    int slots = 0;
    for (int i = 0; i < N_NAMES; i++) {
        slots += (record_offset[i] >= 0) + (timeline_offset[i] >= 0);
    }
    return PyLong_FromLong(slots);
}

static PyMethodDef methods[] = {
    {"configure_slots", (PyCFunction)(void (*)(void))configure_slots, METH_FASTCALL,
     "configure_slots(RequestRecord, Timeline) -> int: read the fields of objects of exactly "
     "these types from their slots (returns how many of the encoder's names are slots)."},
    {"encode", encode, METH_O,
     "encode(record) -> bytes | None: recordwire._encode's bytes, or None for a record the "
     "Python encoder must take (a shape, odd types)."},
    {"decode", decode, METH_O,
     "decode(data) -> RequestRecord | None: recordwire._decode's record, or None for one with "
     "a request shape (the Python decoder's)."},
    {"configure_decoder", (PyCFunction)(void (*)(void))configure_decoder, METH_FASTCALL,
     "configure_decoder(RequestRecord, Timeline, EngineTiming, Int64s, WireError, outcomes, "
     "token_sources): the record's types and the enums by wire index, once."},
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
