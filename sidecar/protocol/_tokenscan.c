/* The common token chunk, recognised in C: what fastchunk.py's `_TOKEN_CHUNK` regex matches,
 * byte for byte, and nothing else. And (`chunk_payload`, at the end) the common HTTP chunk that
 * carries it, so that such a read need not go through httptools' callbacks.
 *
 * Why C: the regex is the largest single cost of relaying one token event (~20k of the ~30k
 * instructions the meter spends on it, benchmarks/meter_instructions.py). The shape is fixed
 * (vLLM writes its chunks with one serializer, members in one order), so recognising it is a
 * walk over literals, three kinds of string and a few integers: no backtracking is ever needed,
 * because every optional part and every alternative starts with bytes no other one can start
 * with at that point. The regex stays the specification and the fallback where this module is
 * not built (see fastchunk.py); tests/test_fastchunk.py holds the two to the same answer on
 * vLLM's shapes, generated chunks and bytes out of place.
 *
 * scan(data: bytes) -> None | (index, prompt, total, completion, usage_start, usage_end,
 *                              id_end, model_start, model_end)
 *   data: one whole SSE event (`data: {...}\n\n`). prompt/total/completion are None and the
 *   usage span is (-1, -1) when the chunk carries no usage; the id starts at byte 13.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef const unsigned char *cursor;

/* The literal `s` at *p: step over it. */
static inline int
literal(cursor *p, cursor end, const char *s, size_t n)
{
    if ((size_t)(end - *p) < n || memcmp(*p, s, n) != 0) {
        return 0;
    }
    *p += n;
    return 1;
}

#define LITERAL(s) literal(&p, end, (s), sizeof(s) - 1)

/* A name (id, model): [^"\\\x00-\x1f]*, left at its closing quote (not consumed). */
static inline int
name(cursor *p, cursor end)
{
    cursor q = *p;
    while (q < end) {
        unsigned char c = *q;
        if (c == '"') {
            *p = q;
            return 1;
        }
        if (c == '\\' || c < 0x20) {
            return 0;
        }
        q++;
    }
    return 0;
}

static inline int
is_hex(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* A text: non-empty JSON string content (plain bytes but '"', '\\' and controls, and JSON's own
 * escapes), left at its closing quote (not consumed). */
static inline int
text(cursor *p, cursor end)
{
    cursor q = *p;
    while (q < end) {
        unsigned char c = *q;
        if (c == '"') {
            if (q == *p) {
                return 0; /* empty: not a token */
            }
            *p = q;
            return 1;
        }
        if (c < 0x20) {
            return 0;
        }
        if (c == '\\') {
            if (end - q < 2) {
                return 0;
            }
            switch (q[1]) {
            case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
                q += 2;
                continue;
            case 'u':
                if (end - q < 6 || !is_hex(q[2]) || !is_hex(q[3]) || !is_hex(q[4])
                    || !is_hex(q[5])) {
                    return 0;
                }
                q += 6;
                continue;
            default:
                return 0;
            }
        }
        q++;
    }
    return 0;
}

/* 0 | [1-9][0-9]{0,max_digits-1}. A longer run of digits is left for the literal after it to
 * refuse, as the regex does. */
static inline int
integer(cursor *p, cursor end, int max_digits, long long *value)
{
    cursor q = *p;
    if (q >= end || *q < '0' || *q > '9') {
        return 0;
    }
    if (*q == '0') {
        *value = 0;
        *p = q + 1;
        return 1;
    }
    long long v = 0;
    int digits = 0;
    while (q < end && *q >= '0' && *q <= '9' && digits < max_digits) {
        v = v * 10 + (*q - '0');
        q++;
        digits++;
    }
    *value = v;
    *p = q;
    return 1;
}

#define INT_DIGITS 18   /* fastchunk._INT: fits an int64 */
#define COUNT_DIGITS 15 /* fastchunk._COUNT: below MAX_TOKEN_COUNT */

/* The answer's tuple, built by hand: Py_BuildValue would parse its format on every event. */
static PyObject *
result(long long index, int has_usage, long long prompt, long long total, long long completion,
       Py_ssize_t usage_start, Py_ssize_t usage_end, Py_ssize_t id_end, Py_ssize_t model_start,
       Py_ssize_t model_end)
{
    PyObject *tuple = PyTuple_New(9);
    if (tuple == NULL) {
        return NULL;
    }
    PyObject *items[9];
    items[0] = PyLong_FromLongLong(index);
    if (has_usage) {
        items[1] = PyLong_FromLongLong(prompt);
        items[2] = PyLong_FromLongLong(total);
        items[3] = PyLong_FromLongLong(completion);
    }
    else {
        items[1] = Py_NewRef(Py_None);
        items[2] = Py_NewRef(Py_None);
        items[3] = Py_NewRef(Py_None);
    }
    items[4] = PyLong_FromSsize_t(usage_start);
    items[5] = PyLong_FromSsize_t(usage_end);
    items[6] = PyLong_FromSsize_t(id_end);
    items[7] = PyLong_FromSsize_t(model_start);
    items[8] = PyLong_FromSsize_t(model_end);
    for (int i = 0; i < 9; i++) {
        if (items[i] == NULL) {
            for (int j = 0; j < 9; j++) {
                Py_XDECREF(items[j]);
            }
            Py_DECREF(tuple);
            return NULL;
        }
    }
    for (int i = 0; i < 9; i++) {
        PyTuple_SET_ITEM(tuple, i, items[i]);
    }
    return tuple;
}

static PyObject *scan_bytes(cursor start, cursor end);

static PyObject *
scan(PyObject *module, PyObject *arg)
{
    (void)module;
    if (PyBytes_CheckExact(arg)) { /* what the data path reads: no buffer to take and give back */
        cursor start = (cursor)PyBytes_AS_STRING(arg);
        return scan_bytes(start, start + PyBytes_GET_SIZE(arg));
    }
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *answer = scan_bytes((cursor)view.buf, (cursor)view.buf + view.len);
    PyBuffer_Release(&view);
    return answer;
}

static PyObject *
scan_bytes(cursor start, cursor end)
{
    cursor p = start;
    long long ignored, index, prompt = 0, total = 0, completion = 0;
    Py_ssize_t id_end, model_start, model_end, usage_start, usage_end = -1;
    int has_usage = 0;

    if (!LITERAL("data: {\"id\":\"") || !name(&p, end)) {
        Py_RETURN_NONE;
    }
    id_end = p - start;
    if (!LITERAL("\",\"object\":\"")) {
        Py_RETURN_NONE;
    }
    if (!LITERAL("chat.completion.chunk") && !LITERAL("text_completion")) {
        Py_RETURN_NONE;
    }
    if (!LITERAL("\",\"created\":") || !integer(&p, end, INT_DIGITS, &ignored)
        || !LITERAL(",\"model\":\"")) {
        Py_RETURN_NONE;
    }
    model_start = p - start;
    if (!name(&p, end)) {
        Py_RETURN_NONE;
    }
    model_end = p - start;
    if (!LITERAL("\",\"choices\":[{\"index\":") || !integer(&p, end, INT_DIGITS, &index)
        || !LITERAL(",")) {
        Py_RETURN_NONE;
    }
    if (LITERAL("\"delta\":{\"content\":\"")) {
        if (!text(&p, end)
            || !LITERAL("\"},\"logprobs\":null,\"finish_reason\":null,\"token_ids\":null}]")) {
            Py_RETURN_NONE;
        }
    }
    else if (LITERAL("\"text\":\"")) {
        if (!text(&p, end)
            || !LITERAL("\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null,"
                        "\"prompt_token_ids\":null,\"token_ids\":null")) {
            Py_RETURN_NONE;
        }
        (void)LITERAL(",\"weight_versions\":null");
        if (!LITERAL("}]")) {
            Py_RETURN_NONE;
        }
    }
    else {
        Py_RETURN_NONE;
    }
    usage_start = p - start;
    if (LITERAL(",\"usage\":{\"prompt_tokens\":")) {
        if (!integer(&p, end, COUNT_DIGITS, &prompt) || !LITERAL(",\"total_tokens\":")
            || !integer(&p, end, COUNT_DIGITS, &total)
            || !LITERAL(",\"completion_tokens\":")
            || !integer(&p, end, COUNT_DIGITS, &completion)) {
            Py_RETURN_NONE;
        }
        (void)LITERAL(",\"completion_tokens_details\":null");
        if (!LITERAL("}")) {
            Py_RETURN_NONE;
        }
        usage_end = p - start;
        has_usage = 1;
    }
    (void)LITERAL(",\"kv_transfer_params\":null");
    if (!LITERAL("}\n\n") || p != end) {
        Py_RETURN_NONE;
    }
    if (!has_usage) {
        usage_start = -1;
    }
    return result(index, has_usage, prompt, total, completion, usage_start, usage_end, id_end,
                  model_start, model_end);
}

/* cut(data, start, end) -> data without data[start:end], in one copy (the slices and their
 * concatenation make three objects). 0 <= start <= end <= len(data), else ValueError. */
static PyObject *
cut(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "cut() takes (bytes, start, end)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t stop = PyLong_AsSsize_t(args[2]);
    if (stop == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    if (start < 0 || stop < start || stop > size) {
        PyErr_SetString(PyExc_ValueError, "cut(): the span is not within the bytes");
        return NULL;
    }
    const char *data = PyBytes_AS_STRING(args[0]);
    PyObject *out = PyBytes_FromStringAndSize(NULL, size - (stop - start));
    if (out == NULL) {
        return NULL;
    }
    char *to = PyBytes_AS_STRING(out);
    memcpy(to, data, (size_t)start);
    memcpy(to + start, data + stop, (size_t)(size - stop));
    return out;
}

/* chunk_payload(read) -> bytes | None: the payload of ``read`` when the read is exactly one
 * whole HTTP/1.1 chunk as uvicorn (h11) writes them, `<size in hex>\r\n<payload>\r\n`, with a
 * size > 0 of at most 8 digits, no leading zero, no extension and nothing after it; else None.
 *
 * Not a parser of the chunked coding (llhttp, through httptools, stays that): the caller asks
 * only when llhttp itself said it is between chunks (its on_chunk_complete), and a read that
 * is one such chunk leaves llhttp where it found it, having handed over exactly these bytes
 * (on_chunk_header, on_body, on_chunk_complete). Anything else goes to llhttp; the tests hold
 * every answer here to llhttp's on the same bytes. */
static PyObject *
chunk_payload(PyObject *module, PyObject *arg)
{
    (void)module;
    if (!PyBytes_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "chunk_payload() takes bytes");
        return NULL;
    }
    cursor p = (cursor)PyBytes_AS_STRING(arg);
    cursor end = p + PyBytes_GET_SIZE(arg);
    if (p == end || *p == '0') {
        Py_RETURN_NONE; /* empty, the last chunk, or leading zeros */
    }
    size_t size = 0;
    int digits = 0;
    while (p < end && is_hex(*p)) {
        if (++digits > 8) {
            Py_RETURN_NONE;
        }
        unsigned char c = *p++;
        size = size * 16 + (size_t)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    if (digits == 0 || end - p < 2 || p[0] != '\r' || p[1] != '\n') {
        Py_RETURN_NONE;
    }
    p += 2;
    if ((size_t)(end - p) != size + 2 || p[size] != '\r' || p[size + 1] != '\n') {
        Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)size);
}

static PyMethodDef methods[] = {
    {"chunk_payload", chunk_payload, METH_O,
     "chunk_payload(read) -> the payload of a read that is exactly one whole HTTP/1.1 chunk "
     "(hex size, no extension), else None."},
    {"scan", scan, METH_O,
     "scan(data) -> None | (index, prompt, total, completion, usage_start, usage_end, id_end, "
     "model_start, model_end): the common token chunk (fastchunk._TOKEN_CHUNK), or None."},
    {"cut", (PyCFunction)(void (*)(void))cut, METH_FASTCALL,
     "cut(data, start, end) -> data without data[start:end], in one copy."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "sidecar.protocol._tokenscan",
    "The common token chunk, recognised in C (see fastchunk.py).",
    0,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__tokenscan(void)
{
    return PyModule_Create(&module_def);
}
