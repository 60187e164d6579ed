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
 *
 * scan_chunk(data: bytes) -> None | (kind, index, prompt, total, completion, usage_start,
 *                                    usage_end, id_end, model_start, model_end, finish_start,
 *                                    finish_end, fingerprint_start, fingerprint_end)
 *   The same walk, wider: fastchunk.py's `_COMMON_CHUNK`, which adds the other chunks every
 *   stream has (the finish chunk, the chat role chunk, the usage-only chunk), so that they too
 *   skip json.loads, the classifier and the usage regex. kind: 0 token, 1 role, 2 empty,
 *   3 usage; index None for the usage-only chunk; absent spans (-1, -1).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
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

/* A text: JSON string content (plain bytes but '"', '\\' and controls, and JSON's own
 * escapes), non-empty unless allow_empty, left at its closing quote (not consumed). */
static inline int
text(cursor *p, cursor end, int allow_empty)
{
    cursor q = *p;
    while (q < end) {
        unsigned char c = *q;
        if (c == '"') {
            if (q == *p && !allow_empty) {
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

/* What `scan` finds in one token chunk (spans are offsets from its first byte); `scan_chunk`
 * also the kind, the finish reason's span and the system fingerprint's ((-1, -1) absent). */
struct token_chunk {
    long long index; /* -1: no choice (the usage-only chunk) */
    int has_usage;
    long long prompt, total, completion;
    Py_ssize_t usage_start, usage_end, id_end, model_start, model_end;
    int kind; /* CHUNK_* */
    Py_ssize_t finish_start, finish_end, fingerprint_start, fingerprint_end;
};

/* `scan_chunk`'s kinds: fastchunk._KINDS maps them to ChunkKind. */
#define CHUNK_TOKEN 0
#define CHUNK_ROLE 1
#define CHUNK_EMPTY 2
#define CHUNK_USAGE 3

/* `"finish_reason":"<name>","stop_reason":(null|<int>|"<name>")` at *p (after the choice's
 * logprobs), the reason's span noted. */
static int
finish(cursor *at, cursor start, cursor end, struct token_chunk *out)
{
    cursor p = *at;
    long long ignored;
    if (!LITERAL("\"finish_reason\":\"")) {
        return 0;
    }
    out->finish_start = p - start;
    if (!name(&p, end)) {
        return 0;
    }
    out->finish_end = p - start;
    if (!LITERAL("\",\"stop_reason\":")) {
        return 0;
    }
    if (LITERAL("\"")) {
        if (!name(&p, end) || !LITERAL("\"")) {
            return 0;
        }
    }
    else if (!LITERAL("null") && !integer(&p, end, INT_DIGITS, &ignored)) {
        return 0;
    }
    *at = p;
    return 1;
}

#define ID_START 13 /* len('data: {"id":"'): fastchunk.ID_START */

/* A stream's chunk head: everything before the choices (`data: {"id":"..","object":"..",
 * "created":..,"model":"..","choices":[`), which vLLM writes the same in every chunk of one
 * answer (one id, one creation second, one model). The lane keeps the first head it walks, and
 * a later chunk that begins with the same bytes skips the walk over them (~120-180 bytes of
 * names and literals) for one memcmp. Sound because the walk of a head reads no byte past its
 * end: bytes equal to a head that walked to its end walk there again, with the same spans. */
struct chunk_head {
    unsigned char *bytes; /* NULL: none kept */
    Py_ssize_t size, id_end, model_start, model_end;
};

/* Keep the head [start, start + size) that walked with ``out``'s spans (no memory: none kept,
 * each chunk walks). */
static void
keep_head(struct chunk_head *head, cursor start, Py_ssize_t size, const struct token_chunk *out)
{
    unsigned char *bytes = PyMem_Malloc((size_t)size);
    if (bytes == NULL) {
        return;
    }
    memcpy(bytes, start, (size_t)size);
    head->bytes = bytes;
    head->size = size;
    head->id_end = out->id_end;
    head->model_start = out->model_start;
    head->model_end = out->model_end;
}

/* The walk itself: 1 and ``out`` filled when [start, end) is one common token chunk, else 0.
 * ``wide`` (`scan_chunk`): also the other chunks every stream has (fastchunk._COMMON_CHUNK):
 * the finish chunk (its text may be empty), the chat role chunk and the usage-only chunk;
 * ``wide`` 2 (the lane's): and a text chunk whose text is empty without a finish (EMPTY). */
static int
scan_span(cursor start, cursor end, struct token_chunk *out, int wide, struct chunk_head *head)
{
    cursor p = start;
    long long ignored;

    out->has_usage = 0;
    out->prompt = out->total = out->completion = 0;
    out->usage_end = -1;
    out->kind = CHUNK_TOKEN;
    out->finish_start = out->finish_end = -1;
    out->fingerprint_start = out->fingerprint_end = -1;
    if (head != NULL && head->bytes != NULL && end - start >= head->size
        && memcmp(start, head->bytes, (size_t)head->size) == 0) {
        p += head->size;
        out->id_end = head->id_end;
        out->model_start = head->model_start;
        out->model_end = head->model_end;
    }
    else {
        if (!LITERAL("data: {\"id\":\"") || !name(&p, end)) {
            return 0;
        }
        out->id_end = p - start;
        if (!LITERAL("\",\"object\":\"")) {
            return 0;
        }
        if (!LITERAL("chat.completion.chunk") && !LITERAL("text_completion")) {
            return 0;
        }
        if (!LITERAL("\",\"created\":") || !integer(&p, end, INT_DIGITS, &ignored)
            || !LITERAL(",\"model\":\"")) {
            return 0;
        }
        out->model_start = p - start;
        if (!name(&p, end)) {
            return 0;
        }
        out->model_end = p - start;
        if (!LITERAL("\",\"choices\":[")) {
            return 0;
        }
        if (head != NULL && head->bytes == NULL) {
            keep_head(head, start, p - start, out);
        }
    }
    if (wide && LITERAL("]")) {
        out->kind = CHUNK_USAGE;
        out->index = -1;
    }
    else if (!LITERAL("{\"index\":") || !integer(&p, end, INT_DIGITS, &out->index)
             || !LITERAL(",")) {
        return 0;
    }
    else if (LITERAL("\"delta\":{\"content\":\"")) {
        cursor text_start = p;
        if (!text(&p, end, wide)) {
            return 0;
        }
        int empty = p == text_start;
        if (!LITERAL("\"},\"logprobs\":null,")) {
            return 0;
        }
        if (LITERAL("\"finish_reason\":null,")) {
            if (empty) {
                if (wide < 2) {
                    return 0; /* empty text, no finish: not a common chunk */
                }
                out->kind = CHUNK_EMPTY;
            }
        }
        else if (!wide || !finish(&p, start, end, out) || !LITERAL(",")) {
            return 0;
        }
        else if (empty) {
            out->kind = CHUNK_EMPTY;
        }
        if (!LITERAL("\"token_ids\":null")) {
            return 0;
        }
        if (out->finish_start >= 0) {
            (void)LITERAL(",\"weight_versions\":null");
        }
        if (!LITERAL("}]")) {
            return 0;
        }
    }
    else if (LITERAL("\"text\":\"")) {
        cursor text_start = p;
        if (!text(&p, end, wide)) {
            return 0;
        }
        int empty = p == text_start;
        if (!LITERAL("\",\"logprobs\":null,")) {
            return 0;
        }
        if (LITERAL("\"finish_reason\":null,\"stop_reason\":null,")) {
            if (empty) {
                if (wide < 2) {
                    return 0;
                }
                out->kind = CHUNK_EMPTY;
            }
        }
        else if (!wide || !finish(&p, start, end, out) || !LITERAL(",")) {
            return 0;
        }
        else if (empty) {
            out->kind = CHUNK_EMPTY;
        }
        if (!LITERAL("\"prompt_token_ids\":null,\"token_ids\":null")) {
            return 0;
        }
        (void)LITERAL(",\"weight_versions\":null");
        if (!LITERAL("}]")) {
            return 0;
        }
    }
    else if (wide && LITERAL("\"delta\":{\"role\":\"")) {
        cursor role_start = p;
        if (!name(&p, end)) {
            return 0;
        }
        if (p == role_start && wide == 2) {
            return 0; /* the lane's: an empty role is no empty text (the Python path's) */
        }
        out->kind = p == role_start ? CHUNK_EMPTY : CHUNK_ROLE;
        if (!LITERAL("\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]")) {
            return 0;
        }
    }
    else {
        return 0;
    }
    out->usage_start = p - start;
    if (LITERAL(",\"usage\":{\"prompt_tokens\":")) {
        if (!integer(&p, end, COUNT_DIGITS, &out->prompt) || !LITERAL(",\"total_tokens\":")
            || !integer(&p, end, COUNT_DIGITS, &out->total)
            || !LITERAL(",\"completion_tokens\":")
            || !integer(&p, end, COUNT_DIGITS, &out->completion)) {
            return 0;
        }
        (void)LITERAL(",\"completion_tokens_details\":null");
        if (!LITERAL("}")) {
            return 0;
        }
        out->usage_end = p - start;
        out->has_usage = 1;
    }
    else if (out->kind == CHUNK_USAGE) {
        return 0; /* no choice and no usage: not a common chunk */
    }
    if (wide) {
        if (LITERAL(",\"system_fingerprint\":\"")) {
            out->fingerprint_start = p - start;
            if (!name(&p, end)) {
                return 0;
            }
            out->fingerprint_end = p - start;
            p++; /* the closing quote `name` stopped at */
        }
        (void)LITERAL(",\"prompt_token_ids\":null,\"prompt_text\":null");
    }
    (void)LITERAL(",\"kv_transfer_params\":null");
    if (!LITERAL("}\n\n") || p != end) {
        return 0;
    }
    if (!out->has_usage) {
        out->usage_start = -1;
    }
    return 1;
}

/* The answer's tuple, built by hand: Py_BuildValue would parse its format on every event.
 * `scan`: (index, prompt, total, completion, usage_start, usage_end, id_end, model_start,
 * model_end); `scan_chunk` (wide): (kind, those nine with index None for no choice,
 * finish_start, finish_end, fingerprint_start, fingerprint_end). */
static PyObject *
scan_bytes(cursor start, cursor end, int wide)
{
    struct token_chunk chunk;
    if (!scan_span(start, end, &chunk, wide, NULL)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t size = wide ? 14 : 9;
    PyObject *tuple = PyTuple_New(size);
    if (tuple == NULL) {
        return NULL;
    }
    PyObject *items[14] = {NULL};
    PyObject **at = items;
    if (wide) {
        *at++ = PyLong_FromLong(chunk.kind);
    }
    *at++ = chunk.index < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(chunk.index);
    if (chunk.has_usage) {
        *at++ = PyLong_FromLongLong(chunk.prompt);
        *at++ = PyLong_FromLongLong(chunk.total);
        *at++ = PyLong_FromLongLong(chunk.completion);
    }
    else {
        *at++ = Py_NewRef(Py_None);
        *at++ = Py_NewRef(Py_None);
        *at++ = Py_NewRef(Py_None);
    }
    *at++ = PyLong_FromSsize_t(chunk.usage_start);
    *at++ = PyLong_FromSsize_t(chunk.usage_end);
    *at++ = PyLong_FromSsize_t(chunk.id_end);
    *at++ = PyLong_FromSsize_t(chunk.model_start);
    *at++ = PyLong_FromSsize_t(chunk.model_end);
    if (wide) {
        *at++ = PyLong_FromSsize_t(chunk.finish_start);
        *at++ = PyLong_FromSsize_t(chunk.finish_end);
        *at++ = PyLong_FromSsize_t(chunk.fingerprint_start);
        *at++ = PyLong_FromSsize_t(chunk.fingerprint_end);
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        if (items[i] == NULL) {
            for (Py_ssize_t j = 0; j < size; j++) {
                Py_XDECREF(items[j]);
            }
            Py_DECREF(tuple);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        PyTuple_SET_ITEM(tuple, i, items[i]);
    }
    return tuple;
}

static PyObject *
scan_any(PyObject *arg, int wide)
{
    if (PyBytes_CheckExact(arg)) { /* what the data path reads: no buffer to take and give back */
        cursor start = (cursor)PyBytes_AS_STRING(arg);
        return scan_bytes(start, start + PyBytes_GET_SIZE(arg), wide);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *answer = scan_bytes((cursor)view.buf, (cursor)view.buf + view.len, wide);
    PyBuffer_Release(&view);
    return answer;
}

static PyObject *
scan(PyObject *module, PyObject *arg)
{
    (void)module;
    return scan_any(arg, 0);
}

static PyObject *
scan_chunk(PyObject *module, PyObject *arg)
{
    (void)module;
    return scan_any(arg, 1);
}

/* fast_chunk(data) -> None | (ChunkInfo, usage_start, usage_end): `scan_chunk` and what
 * fastchunk.fast_chunk_from_scan makes of its answer, in one call (that Python function, its
 * 14-tuple and the Usage it builds were ~70 bytecodes per event of the general path). The
 * types come from `configure`, once, at import. */
static PyTypeObject *chunk_info_type, *usage_type;
static PyObject *chunk_kinds; /* a tuple: ChunkKind by `scan_chunk`'s kind number */

static PyObject *
configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyType_Check(args[0]) || !PyType_Check(args[1])
        || !PyType_IsSubtype((PyTypeObject *)args[0], &PyTuple_Type)
        || !PyType_IsSubtype((PyTypeObject *)args[1], &PyTuple_Type)
        || !PyTuple_CheckExact(args[2]) || PyTuple_GET_SIZE(args[2]) != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "configure() takes (ChunkInfo, Usage, the four kinds as a tuple)");
        return NULL;
    }
    Py_XSETREF(chunk_info_type, (PyTypeObject *)Py_NewRef(args[0]));
    Py_XSETREF(usage_type, (PyTypeObject *)Py_NewRef(args[1]));
    Py_XSETREF(chunk_kinds, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

/* A name's bytes as fastchunk decodes them (UTF-8, invalid bytes replaced). */
static PyObject *
name_at(cursor start, Py_ssize_t from, Py_ssize_t to)
{
    return PyUnicode_DecodeUTF8((const char *)start + from, to - from, "replace");
}

/* A tuple subclass (a NamedTuple) holding `items`, whose references it steals; NULL (and every
 * item released) on failure or when an item is NULL. */
static PyObject *
named_tuple(PyTypeObject *type, PyObject **items, Py_ssize_t n)
{
    PyObject *tuple = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == NULL) {
            goto fail;
        }
    }
    tuple = type == &PyTuple_Type ? PyTuple_New(n) : type->tp_alloc(type, n);
    if (tuple == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTuple_SET_ITEM(tuple, i, items[i]);
    }
    return tuple;
fail:
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(items[i]);
    }
    return NULL;
}

static PyObject *
fast_chunk(PyObject *module, PyObject *arg)
{
    (void)module;
    if (chunk_info_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fast_chunk() before configure()");
        return NULL;
    }
    if (!PyBytes_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "fast_chunk() takes bytes");
        return NULL;
    }
    cursor start = (cursor)PyBytes_AS_STRING(arg);
    struct token_chunk chunk;
    if (!scan_span(start, start + PyBytes_GET_SIZE(arg), &chunk, 1, NULL)) {
        Py_RETURN_NONE;
    }
    PyObject *usage;
    if (chunk.has_usage) {
        /* Usage(prompt_tokens, completion_tokens, total_tokens, cached_tokens) */
        PyObject *parts[4] = {PyLong_FromLongLong(chunk.prompt),
                              PyLong_FromLongLong(chunk.completion),
                              PyLong_FromLongLong(chunk.total), Py_NewRef(Py_None)};
        usage = named_tuple(usage_type, parts, 4);
        if (usage == NULL) {
            return NULL;
        }
    }
    else {
        usage = Py_NewRef(Py_None);
    }
    /* ChunkInfo(kind, usage, finish_reason, choice_index, metrics, error, model, id,
     *           system_fingerprint, usage_malformed) */
    PyObject *fields[10] = {
        Py_NewRef(PyTuple_GET_ITEM(chunk_kinds, chunk.kind)),
        usage,
        chunk.finish_start < 0 ? Py_NewRef(Py_None)
                               : name_at(start, chunk.finish_start, chunk.finish_end),
        chunk.index < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(chunk.index),
        Py_NewRef(Py_None),
        Py_NewRef(Py_None),
        name_at(start, chunk.model_start, chunk.model_end),
        name_at(start, ID_START, chunk.id_end),
        chunk.fingerprint_start < 0
            ? Py_NewRef(Py_None)
            : name_at(start, chunk.fingerprint_start, chunk.fingerprint_end),
        Py_NewRef(Py_False),
    };
    PyObject *info = named_tuple(chunk_info_type, fields, 10);
    if (info == NULL) {
        return NULL;
    }
    PyObject *answer[3] = {info, PyLong_FromSsize_t(chunk.usage_start),
                           PyLong_FromSsize_t(chunk.usage_end)};
    return named_tuple(&PyTuple_Type, answer, 3);
}

/* data_events(data, max_event_size) -> (events, stop): the whole `data:<payload>\n\n` events
 * at the start of `data` as SSEEvent(payload, raw, None, None, None, None), in order, and where
 * the first thing that is not one begins (len(data) when there is none). What the loop at the
 * top of sse.SSEParser.feed does for a read while nothing is pending (the spec of this function,
 * and the parser's answer where it is not built): an event stops the run when it has no LF LF
 * end within `data`, holds a CR, or is over `max_event_size` bytes. The payload is decoded as
 * UTF-8 with invalid bytes replaced; a read that is one event is its own `raw`. The type comes
 * from `configure_events`, once, at import. */
static PyTypeObject *sse_event_type;

static PyObject *
configure_events(PyObject *module, PyObject *arg)
{
    (void)module;
    if (!PyType_Check(arg) || !PyType_IsSubtype((PyTypeObject *)arg, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "configure_events() takes SSEEvent");
        return NULL;
    }
    Py_XSETREF(sse_event_type, (PyTypeObject *)Py_NewRef(arg));
    Py_RETURN_NONE;
}

static PyObject *
data_events(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (sse_event_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "data_events() before configure_events()");
        return NULL;
    }
    if (nargs != 2 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "data_events() takes (bytes, max_event_size)");
        return NULL;
    }
    Py_ssize_t max_size = PyLong_AsSsize_t(args[1]);
    if (max_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *data = args[0];
    const char *base = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    PyObject *events = PyList_New(0);
    if (events == NULL) {
        return NULL;
    }
    Py_ssize_t pos = 0;
    while (n - pos >= 5 && memcmp(base + pos, "data:", 5) == 0) {
        const char *nl = memchr(base + pos, '\n', (size_t)(n - pos));
        if (nl == NULL) {
            break;
        }
        Py_ssize_t at = nl - base;
        Py_ssize_t end = at + 2;
        if (end > n || base[at + 1] != '\n' || memchr(base + pos, '\r', (size_t)(at - pos)) != NULL
            || end - pos > max_size) {
            break;
        }
        Py_ssize_t value = base[pos + 5] == ' ' ? pos + 6 : pos + 5;
        PyObject *raw = pos == 0 && end == n ? Py_NewRef(data)
                                             : PyBytes_FromStringAndSize(base + pos, end - pos);
        PyObject *fields[6] = {PyUnicode_DecodeUTF8(base + value, at - value, "replace"), raw,
                               Py_NewRef(Py_None), Py_NewRef(Py_None), Py_NewRef(Py_None),
                               Py_NewRef(Py_None)};
        PyObject *event = named_tuple(sse_event_type, fields, 6);
        if (event == NULL || PyList_Append(events, event) < 0) {
            Py_XDECREF(event);
            Py_DECREF(events);
            return NULL;
        }
        Py_DECREF(event);
        pos = end;
    }
    PyObject *answer[2] = {events, PyLong_FromSsize_t(pos)};
    return named_tuple(&PyTuple_Type, answer, 2);
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

/* One whole HTTP/1.1 chunk at *p as uvicorn (h11) writes them, `<size in hex>\r\n<payload>\r\n`,
 * with a size > 0 of at most 8 digits, no leading zero and no extension: 1, its payload's span,
 * and *p past it; else 0 (*p unmoved). */
static int
chunk_span(cursor *at, cursor end, cursor *payload, size_t *payload_size)
{
    cursor p = *at;
    if (p == end || *p == '0') {
        return 0; /* empty, the last chunk, or leading zeros */
    }
    size_t size = 0;
    int digits = 0;
    while (p < end && is_hex(*p)) {
        if (++digits > 8) {
            return 0;
        }
        unsigned char c = *p++;
        size = size * 16 + (size_t)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    if (digits == 0 || end - p < 2 || p[0] != '\r' || p[1] != '\n') {
        return 0;
    }
    p += 2;
    if ((size_t)(end - p) < size + 2 || p[size] != '\r' || p[size + 1] != '\n') {
        return 0;
    }
    *payload = p;
    *payload_size = size;
    *at = p + size + 2;
    return 1;
}

/* chunk_payload(read) -> bytes | None: the payload of ``read`` when the read is exactly one
 * whole HTTP/1.1 chunk (`chunk_span`'s shape) and nothing after it; else None.
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
    cursor payload;
    size_t size;
    if (!chunk_span(&p, end, &payload, &size) || p != end) {
        Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize((const char *)payload, (Py_ssize_t)size);
}

/* -- Lane: the whole per-read path of a stream's common read, in one call ------------------
 *
 * Lane(client, relay, origin_ns, high_water, max_event_bytes, strip, drop_usage_chunk=False)
 *
 * The read that makes up almost every read of a streamed answer is one or a few whole HTTP
 * chunks, each exactly one common token event of choice 0 (carrying one token, or several
 * under speculative decoding). In Python it
 * went through ten frames (the connection, the exchange, the relay's callback, the meter, the
 * token counter, the client's framing, the builder's stamps: ~390 bytecodes per read,
 * benchmarks/request_instructions.py). `relay` does all of it for such a read: the chunk and
 * token-chunk checks, the token count, the server-side stamp, the usage the proxy asked for cut
 * back out, the client's chunk framing and write, the client-side stamp, the idle timeout's
 * read instant and the back-pressure check. It keeps what it counted here, and the Python
 * measuring core takes it (`take`) before it handles any read itself or ends the stream.
 *
 * It never decides anything the Python path would decide differently: a read it does not take
 * whole (another shape, another choice, the stream's event limit, a client that is going) is
 * left untouched for the Python path (False), and the caller
 * arms it (`arm`) only in the state where the Python path's own one-event lane would run
 * (stream_relay.MeteredRead says when). tests/test_lane.py holds the two paths to the same
 * client bytes and the same records.
 *
 * client: the client's transport (its write, get_write_buffer_size and is_closing are looked
 * up once per transport type, _methodcache.h: a stream in flight holds one reference, not
 * three bound methods); relay: its on_client_full() is called once the client's buffer holds
 * more than high_water bytes (the relay pauses the upstream), after which the lane is
 * disarmed; origin_ns: the request's arrival (every offset is from it); strip: the usage
 * member the proxy asked for is cut out of token chunks; drop_usage_chunk: the client did not
 * ask for usage (a stream's end, below, leaves without the usage chunk). `last_read_ns` is
 * the instant of the last read it took, which the request's idle timeout reads when its timer
 * wakes (timeouts.Timeouts.lane), instead of an int stored per read. All instants are
 * CLOCK_MONOTONIC nanoseconds, the clock of clock.monotonic_ns (time.perf_counter_ns on Linux).
 */

#include <errno.h>
#include <sys/socket.h>
#include <time.h>

#ifndef MSG_NOSIGNAL /* (not on macOS: there CPython ignores SIGPIPE, the send's EPIPE stays) */
#define MSG_NOSIGNAL 0
#endif

#include "../_methodcache.h"
#include "_laneapi.h"

#define LANE_MAX_CHUNKS 64 /* per read; more goes to the Python path */
/* Events counted before a take: past it, the next read goes to the Python path, which takes
 * them (the Python columns hold them from then on) and frees the lane's buffer. What a stream in
 * flight holds here stays small (at most 128 x 24 bytes, 8 x 24 for a slow stream), at the
 * price of one read in 128 on the Python path. */
#define LANE_MAX_PENDING 128
#define LANE_FIRST_CAPACITY 4
/* A read's client bytes up to this size are made on the stack (`lane_relay_read`). */
#define LANE_STACK_OUT 4096
/* `arm`'s end flags (StreamMeter.lane_start): the stream's end may be taken here (the meter
 * has nothing the end's chunks could still give it but what the lane hands back), and the
 * meter knows a system_fingerprint already (a held finish chunk would get it back from there
 * when the usage chunk has none: left to the Python path). */
#define LANE_END_OK 1
#define LANE_END_FINGERPRINT_KNOWN 2
/* ... and the stream's first read (StreamMeter.lane_start, before any event): it may begin
 * with chat's role chunk, and its first chunk names the answer (model and id), which the
 * relay's `first_in_lane` hands to the meter (below, "The first read"). */
#define LANE_FIRST 4
/* How far the lane took a stream's end that came over several reads (below, "An end over
 * several reads"): the finish chunk, then the usage chunk, then [DONE]; a read's `to` is
 * END_BODY when it brought the body's last chunk too (the stream ended). */
#define END_FINISH 1
#define END_USAGE 2
#define END_DONE 3
#define END_BODY 4

/* One counted event: its two instants. Its output tokens go in a column of their own, made
 * only from the first event that did not carry one (as the meter's own column). */
struct lane_event {
    long long up;   /* server-side offset */
    long long down; /* client-side offset */
};

typedef struct {
    PyObject_HEAD
    PyObject *client;
    PyObject *relay;
    long long origin_ns;
    long long last_read_ns; /* when the last read it took was read; 0: none yet */
    long long high_water;
    Py_ssize_t max_event_bytes;
    int strip;
    int drop_usage; /* the client did not ask for usage: the usage chunk is not forwarded */
    int armed;
    int end_flags; /* LANE_END_*, from `arm`: whether the stream's end may be taken here */
    long long events_left;     /* events the stream may still take, from `arm` */
    long long last_cumulative; /* choice 0's completion tokens so far, from `arm` */
    /* Counted since the last `take`: */
    struct lane_event *events;
    long long *tokens; /* each event's output tokens, from the first that was not 1 */
    int all_ones;      /* every event carried one token: no `tokens` column, and none handed */
    long long gained; /* their tokens' sum */
    Py_ssize_t pending;
    Py_ssize_t capacity;
    int inexact; /* an event without usage (one token counted for it) */
    int token_awaited; /* the first read was chat's role chunk alone: the next token is the
                        * stream's first (`first_in_lane` says so) */
    int has_usage;
    long long prompt, total, completion; /* the last usage seen */
    long long other_events; /* events without a token taken since the last `take` */
    long long carry; /* choice 0's tokens an empty text carried, for its next token event */
    /* A stream's end taken over several reads, until its last read or a `take_end`: */
    int end_stage;           /* END_*: how far; 0: not begun */
    PyObject *finish_reason; /* the finish chunk's reason (a str) */
    PyObject *fingerprint;   /* the usage chunk's system_fingerprint (a str), or NULL */
    char *held;              /* drop_usage, END_FINISH: the finish chunk's event, usage cut, */
    Py_ssize_t held_size;    /* held for the usage chunk's fingerprint; where the usage was */
    Py_ssize_t held_cut;     /* cut; and whether it is a token event (the pending event last */
    int held_token;          /* counted, not yet written) or, its text empty, one without */
    struct chunk_head head;  /* the stream's chunk head, from the first chunk walked */
    int client_fd;           /* the client transport's socket, for `lane_send`; -1: none */
    /* Over the lane's life, for whoever watches it work (tests/test_lane.py's census): */
    long long reads_taken;   /* reads taken whole */
    long long events_handed; /* events handed over by `take` */
} Lane;

/* Interned at import. */
static PyObject *write_name, *buffer_size_name, *is_closing_name, *full_name, *end_name,
    *first_name;
/* The client transport's three methods, found once per transport type (_methodcache.h). */
static method_cache is_closing_method, write_method, buffer_size_method;

static long long
monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

static int
lane_traverse(Lane *self, visitproc visit, void *arg)
{
    Py_VISIT(self->client);
    Py_VISIT(self->relay);
    return 0;
}

/* Forget the part of a stream's end taken so far (handed over, ended, or the lane closed). */
static void
lane_forget_end(Lane *self)
{
    self->end_stage = 0;
    Py_CLEAR(self->finish_reason);
    Py_CLEAR(self->fingerprint);
    PyMem_Free(self->held);
    self->held = NULL;
    self->held_size = self->held_cut = 0;
    self->held_token = 0;
}

static int
lane_clear(Lane *self)
{
    self->armed = 0;
    Py_CLEAR(self->client);
    Py_CLEAR(self->relay);
    lane_forget_end(self);
    return 0;
}

static void
lane_dealloc(Lane *self)
{
    PyObject_GC_UnTrack(self);
    lane_clear(self);
    PyMem_Free(self->events);
    PyMem_Free(self->tokens);
    PyMem_Free(self->head.bytes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
lane_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"client",    "relay",           "origin_ns",
                            "high_water", "max_event_bytes", "strip",
                            "drop_usage_chunk", "client_fd", NULL};
    PyObject *client, *relay;
    long long origin_ns, high_water;
    Py_ssize_t max_event_bytes;
    int strip, drop_usage = 0, client_fd = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOLLnp|pi:Lane", names, &client, &relay,
                                     &origin_ns, &high_water, &max_event_bytes, &strip,
                                     &drop_usage, &client_fd)) {
        return NULL;
    }
    Lane *self = (Lane *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->client = Py_NewRef(client);
    self->relay = Py_NewRef(relay);
    self->origin_ns = origin_ns;
    self->high_water = high_water;
    self->max_event_bytes = max_event_bytes;
    self->strip = strip;
    self->drop_usage = drop_usage;
    self->client_fd = client_fd;
    self->all_ones = 1;
    return (PyObject *)self;
}

/* Room for ``more`` events beyond those pending. */
static int
lane_reserve(Lane *self, Py_ssize_t more)
{
    if (self->pending + more <= self->capacity) {
        return 0;
    }
    Py_ssize_t capacity = self->capacity ? self->capacity : LANE_FIRST_CAPACITY;
    while (capacity < self->pending + more) {
        capacity *= 2;
    }
    struct lane_event *events =
        PyMem_Realloc(self->events, (size_t)capacity * sizeof(struct lane_event));
    if (events == NULL) {
        return -1;
    }
    self->events = events;
    if (self->tokens != NULL) {
        long long *tokens = PyMem_Realloc(self->tokens, (size_t)capacity * sizeof(long long));
        if (tokens == NULL) {
            return -1;
        }
        self->tokens = tokens;
    }
    self->capacity = capacity;
    return 0;
}

/* The token column, with 1 for the events pending before the first that was not 1. */
static int
lane_start_column(Lane *self)
{
    long long *tokens = PyMem_Malloc((size_t)self->capacity * sizeof(long long));
    if (tokens == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->pending; i++) {
        tokens[i] = 1;
    }
    self->tokens = tokens;
    return 0;
}

/* -- The end of a stream, taken by the lane -------------------------------------------------
 *
 * vLLM ends a stream (with the usage the proxy asks for) with four writes: choice 0's last
 * token chunk, which carries the finish reason; the usage-only chunk; `data: [DONE]`; and the
 * chunked body's last chunk. The Python path gives them three events through llhttp, the SSE
 * parser and `StreamMeter._consume`, holds the finish chunk for the usage chunk's
 * system_fingerprint when the client did not ask for usage (the usage chunk is then dropped),
 * and ends the client's answer with the last read's events in one write. A read that is
 * exactly that sequence (after any common token chunks) is taken here: the finish chunk is
 * counted as the token event it is, the client's bytes are made as `_consume` makes them, and
 * the relay's `end_in_lane(out, at_ns, finish_reason, fingerprint, usage_forwarded)` ends both
 * exchanges with them (MeteredRead).
 *
 * An end over several reads. The four writes often reach the proxy in more than one read (a
 * real vLLM on a busy host: the finish chunk alone, or with the usage chunk, then the rest): a
 * read that begins the end and stops after its finish, usage or [DONE] chunk is taken too, and
 * so is each read that brings the next part of it in order, written to the client as the
 * Python path writes that read (a finish chunk held for the fingerprint is held here, in
 * `held`, and leaves with the usage chunk's read). The relay hears of the end at its last read
 * only, by the same `end_in_lane`. A read that brings anything else is left to the Python
 * path, as is the rest of a stream that ends or fails meanwhile: `take_end` then hands the
 * meter what the lane took of the end (`StreamMeter.take_end_in_lane`), the held finish chunk
 * among it. */

static const char done_event[] = "data: [DONE]\n\n";
static const char last_chunk[] = "0\r\n\r\n";
static const char fingerprint_member[] = ",\"system_fingerprint\":\"";

struct lane_end {
    int from, to;          /* END_*: how far the end was taken before this read, and after */
    cursor finish_payload; /* the finish chunk's event (from 0) */
    size_t finish_size;
    struct token_chunk finish;
    cursor usage_payload; /* the usage chunk's event (from < END_USAGE <= to) */
    size_t usage_size;
    struct token_chunk usage;
};

/* 1 and ``out`` filled when [p, end) is, whole, the next part of a stream's end that this lane
 * takes (above), after the part ``from`` (0: none) it took already; else 0. */
static int
end_span(Lane *self, int from, cursor p, cursor end, struct lane_end *out)
{
    size_t limit = (size_t)self->max_event_bytes;
    cursor done;
    size_t done_size;
    int stage = from;
    out->from = from;
    if (stage == 0) {
        /* Its text may be empty (an end at the model's end-of-sequence token): then it is an
         * event without a token, which `lane_relay_read` counts as such. */
        if (!chunk_span(&p, end, &out->finish_payload, &out->finish_size)
            || out->finish_size > limit
            || !scan_span(out->finish_payload, out->finish_payload + out->finish_size,
                          &out->finish, 1, &self->head)
            || (out->finish.kind != CHUNK_TOKEN && out->finish.kind != CHUNK_EMPTY)
            || out->finish.index != 0 || out->finish.finish_start < 0
            || out->finish.fingerprint_start >= 0) {
            return 0;
        }
        /* A finish chunk held for the fingerprint gets it where its usage member was cut. */
        if (self->drop_usage && (!self->strip || !out->finish.has_usage)) {
            return 0;
        }
        stage = END_FINISH;
    }
    if (stage == END_FINISH && p < end) {
        if (!chunk_span(&p, end, &out->usage_payload, &out->usage_size)
            || out->usage_size > limit
            || !scan_span(out->usage_payload, out->usage_payload + out->usage_size, &out->usage,
                          1, &self->head)
            || out->usage.kind != CHUNK_USAGE) {
            return 0;
        }
        if (self->drop_usage && out->usage.fingerprint_start < 0
            && (self->end_flags & LANE_END_FINGERPRINT_KNOWN)) {
            return 0; /* the held finish chunk gets the one the meter knows: the Python path */
        }
        /* The fingerprint's bytes are its JSON text only when ASCII (the scan already refused
         * quotes, backslashes and control bytes): otherwise the Python path decodes and
         * encodes it. */
        for (Py_ssize_t i = out->usage.fingerprint_start; i < out->usage.fingerprint_end; i++) {
            if (out->usage_payload[i] & 0x80) {
                return 0;
            }
        }
        stage = END_USAGE;
    }
    if (stage == END_USAGE && p < end) {
        if (!chunk_span(&p, end, &done, &done_size) || done_size != sizeof(done_event) - 1
            || done_size > limit || memcmp(done, done_event, done_size) != 0) {
            return 0;
        }
        stage = END_DONE;
    }
    if (stage == END_DONE && p < end) {
        if ((size_t)(end - p) != sizeof(last_chunk) - 1
            || memcmp(p, last_chunk, sizeof(last_chunk) - 1) != 0) {
            return 0; /* a trailer, or more after the body: llhttp's */
        }
        p = end;
        stage = END_BODY;
    }
    out->to = stage;
    return p == end && stage > from;
}

/* `<size in lowercase hex>\r\n` into head (at least 19 bytes), what "%zx\r\n" gives: written
 * by hand, as snprintf's format parsing was a tenth of this call's instructions. */
static int
hex_line(char *head, size_t size)
{
    static const char digits[] = "0123456789abcdef";
    char reversed[16];
    int n = 0;
    do {
        reversed[n++] = digits[size & 0xf];
        size >>= 4;
    } while (size != 0);
    for (int i = 0; i < n; i++) {
        head[i] = reversed[n - 1 - i];
    }
    head[n] = '\r';
    head[n + 1] = '\n';
    return n + 2;
}

/* A span of the client's bytes for an end read, and at most how many one read makes: two per
 * token event (its usage member cut), the fingerprint's three twice, the usage chunk, [DONE]. */
struct piece {
    const char *at;
    size_t size;
};
#define END_PIECES (2 * LANE_MAX_CHUNKS + 12)

/* A finish chunk's event (usage cut at ``cut``) with the fingerprint put where its usage was
 * (meter._release_held: rewrite.insert_member) when there is one: pieces from *k on. */
static size_t
finish_pieces(struct piece *pieces, int *k, const char *event, size_t size, size_t cut,
              size_t resume, const char *fingerprint, size_t fingerprint_size)
{
    int i = *k;
    pieces[i++] = (struct piece){event, cut};
    size_t total = cut + (size - resume);
    if (fingerprint != NULL) {
        pieces[i++] = (struct piece){fingerprint_member, sizeof(fingerprint_member) - 1};
        pieces[i++] = (struct piece){fingerprint, fingerprint_size};
        pieces[i++] = (struct piece){"\"", 1};
        total += sizeof(fingerprint_member) - 1 + fingerprint_size + 1;
    }
    pieces[i++] = (struct piece){event + resume, size - resume};
    *k = i;
    return total;
}

/* The client's bytes for a read that takes (a part of) the end (`end_span`), as `_consume`
 * makes them: the read's token events, the finish chunk last among them when the read begins
 * the end, each with its usage member cut when the proxy asked for it, but for a finish chunk
 * held (the usage chunk dropped and not in this read: the caller keeps it); a held finish
 * chunk (`held`, or this read's) with the usage chunk's fingerprint in place of its usage
 * member, when the usage chunk is in the read; the usage chunk unless dropped; [DONE]. Framed
 * as one client chunk (`<size>\r\n...\r\n`, as ClientExchange.write frames) when ``framed``
 * and not empty, else bare (`ClientExchange.end` frames them). */
static PyObject *
end_bytes(const Lane *self, int n, cursor *payloads, const size_t *sizes,
          const struct token_chunk *chunks, const struct lane_end *tail, int framed)
{
    struct piece pieces[END_PIECES];
    int k = 0;
    size_t size = 0;
    int usage_here = tail->from < END_USAGE && tail->to >= END_USAGE;
    int held_here = self->drop_usage && tail->from == 0 && tail->to == END_FINISH;
    const char *fingerprint = NULL;
    size_t fingerprint_size = 0;
    if (self->drop_usage && usage_here && tail->usage.fingerprint_start >= 0) {
        fingerprint = (const char *)tail->usage_payload + tail->usage.fingerprint_start;
        fingerprint_size = (size_t)(tail->usage.fingerprint_end - tail->usage.fingerprint_start);
    }
    for (int i = 0; i < n - held_here; i++) {
        const struct token_chunk *chunk = &chunks[i];
        const char *event = (const char *)payloads[i];
        if (chunk->has_usage && self->strip) {
            int finish = tail->from == 0 && i == n - 1 && self->drop_usage;
            size += finish_pieces(pieces, &k, event, sizes[i], (size_t)chunk->usage_start,
                                  (size_t)chunk->usage_end, finish ? fingerprint : NULL,
                                  fingerprint_size);
        }
        else {
            pieces[k++] = (struct piece){event, sizes[i]};
            size += sizes[i];
        }
    }
    if (self->held != NULL && usage_here) { /* the finish chunk held since an earlier read */
        size += finish_pieces(pieces, &k, self->held, (size_t)self->held_size,
                              (size_t)self->held_cut, (size_t)self->held_cut, fingerprint,
                              fingerprint_size);
    }
    if (usage_here && !self->drop_usage) {
        pieces[k++] = (struct piece){(const char *)tail->usage_payload, tail->usage_size};
        size += tail->usage_size;
    }
    if (tail->from < END_DONE && tail->to >= END_DONE) {
        pieces[k++] = (struct piece){done_event, sizeof(done_event) - 1};
        size += sizeof(done_event) - 1;
    }
    char head[24];
    int head_size = framed && size ? hex_line(head, size) : 0;
    size_t frame = head_size ? (size_t)head_size + 2 : 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(size + frame));
    if (out == NULL) {
        return NULL;
    }
    char *to = PyBytes_AS_STRING(out);
    memcpy(to, head, (size_t)head_size);
    to += head_size;
    for (int i = 0; i < k; i++) {
        memcpy(to, pieces[i].at, pieces[i].size);
        to += pieces[i].size;
    }
    if (frame) {
        to[0] = '\r';
        to[1] = '\n';
    }
    return out;
}

/* The relay's `end_in_lane` for the end's last read: 0 when it returned, -1 with its
 * exception. ``fingerprint`` NULL: None. */
static int
call_end(Lane *self, PyObject *relay, PyObject *out, long long at_ns, PyObject *reason,
         PyObject *fingerprint)
{
    PyObject *at = PyLong_FromLongLong(at_ns);
    if (at == NULL) {
        return -1;
    }
    PyObject *result = PyObject_CallMethodObjArgs(
        relay, end_name, out, at, reason, fingerprint ? fingerprint : Py_None,
        self->drop_usage ? Py_False : Py_True, NULL);
    Py_DECREF(at);
    if (result == NULL) {
        return -1;
    }
    Py_DECREF(result);
    return 0;
}

/* ``out`` written to the client: 1, or 0 when the write raised (cleared: nothing was done). */
static int
lane_write(PyObject *client, PyObject *out)
{
    PyObject *write_args[2] = {client, out};
    PyObject *written = call_method_cached(&write_method, write_name, write_args, 2);
    if (written == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(written);
    return 1;
}

/* After a write: past the high-water mark of the client's buffer, the lane disarms (the
 * upstream pauses; the Python path takes the reads after) and tells the relay
 * (`on_client_full`). 0, or -1 with an exception. */
static int
lane_check_full(Lane *self, PyObject *client, PyObject *relay)
{
    PyObject *held = call_method_cached(&buffer_size_method, buffer_size_name, &client, 1);
    if (held == NULL) {
        return -1;
    }
    long long held_bytes = PyLong_AsLongLong(held);
    Py_DECREF(held);
    if (held_bytes == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (held_bytes > self->high_water) {
        self->armed = 0;
        PyObject *paused = PyObject_CallMethodNoArgs(relay, full_name);
        if (paused == NULL) {
            return -1;
        }
        Py_DECREF(paused);
    }
    return 0;
}

/* The client's bytes [data, data + size) of a read the lane takes, written; 1 when written
 * whole or queued (the rest after a partial send: counted as written, as a transport's queue
 * is), 0 when nothing was written (the Python path writes again), and ``*idle`` whether the
 * transport's buffer is known to be empty after it (then `lane_check_full` need not ask).
 *
 * Where the lane has the client's socket (`client_fd`: a plain TCP or Unix transport, the
 * listener's) and the transport holds nothing unsent, one send(2) from these bytes: no bytes
 * object, and none of the transport's write path (its buffer list, its buffer views, its own
 * attempt; with the bytes object ~1.2k instructions per read, benchmarks/RESULTS.md "The lane's
 * own send"). The order of the client's bytes is kept:
 * everything written before went to the kernel already (nothing is held: get_write_buffer_size
 * is 0), and whatever the send leaves (the kernel's buffer full, EAGAIN, an error) goes to the
 * transport, which queues or fails it as it would have. The socket is the transport's own while
 * it is open, and `client_open` (is_closing) was asked just before, with no Python run between. */
static int
lane_send(Lane *self, PyObject *client, const char *data, Py_ssize_t size, int *idle)
{
    *idle = 0;
    Py_ssize_t sent = 0;
    if (self->client_fd >= 0) {
        PyObject *held = call_method_cached(&buffer_size_method, buffer_size_name, &client, 1);
        if (held == NULL) {
            PyErr_Clear();
            return 0;
        }
        long long held_bytes = PyLong_AsLongLong(held);
        Py_DECREF(held);
        if (held_bytes == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (held_bytes == 0) {
            ssize_t n;
            do {
                n = send(self->client_fd, data, (size_t)size, MSG_DONTWAIT | MSG_NOSIGNAL);
            } while (n < 0 && errno == EINTR);
            if (n == size) {
                *idle = 1;
                return 1;
            }
            sent = n > 0 ? (Py_ssize_t)n : 0; /* the rest, or all of it, to the transport */
        }
    }
    PyObject *rest = PyBytes_FromStringAndSize(data + sent, size - sent);
    if (rest == NULL) {
        PyErr_Clear();
        return sent > 0; /* (bytes the client has: written, not to be written again) */
    }
    int written = lane_write(client, rest);
    Py_DECREF(rest);
    return written || sent > 0;
}

/* Whether the client's transport is open (1), or closing or cannot tell (0: the Python path
 * finds out and says so). */
static int
client_open(Lane *self)
{
    PyObject *transport = self->client;
    PyObject *closing = call_method_cached(&is_closing_method, is_closing_name, &transport, 1);
    if (closing == NULL) {
        PyErr_Clear();
        return 0;
    }
    int gone = PyObject_IsTrue(closing);
    Py_DECREF(closing);
    if (gone != 0) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}


/* The ``n`` token events of a read taken whole, in the pending columns: the server-side
 * instant ``at_ns`` (the read's), the client-side one now (just after their write). Room for
 * them was made (`lane_reserve`, and the token column when needed). */
static void
lane_commit(Lane *self, int n, const struct token_chunk *chunks, const long long *gained,
            const int *index, long long last, long long at_ns, long long read_ns)
{
    long long down_ns = monotonic_ns() - self->origin_ns;
    long long up_ns = at_ns - self->origin_ns;
    for (int k = 0; k < n; k++) {
        int i = index != NULL ? index[k] : k; /* (index: the token events among the chunks) */
        struct lane_event *counted = &self->events[self->pending];
        counted->up = up_ns;
        counted->down = down_ns;
        if (self->tokens != NULL) {
            self->tokens[self->pending] = gained[i];
        }
        self->all_ones &= gained[i] == 1;
        self->gained += gained[i];
        self->pending++;
        const struct token_chunk *chunk = &chunks[i];
        if (chunk->has_usage) {
            self->has_usage = 1;
            self->prompt = chunk->prompt;
            self->total = chunk->total;
            self->completion = chunk->completion;
        }
        else {
            self->inexact = 1;
        }
    }
    self->last_cumulative = last;
    self->last_read_ns = read_ns;
}

static int call_first(PyObject *relay, PyObject *model, PyObject *response_id, int other_events,
                      int first_token);

/* The stream's first read, or the read with its first token, taken: the lane's state after it
 * and the relay's `first_in_lane` (0 when it returned, -1 with its exception). */
static int
lane_first_taken(Lane *self, PyObject *relay, PyObject *model, PyObject *response_id, int role,
                 int first_token)
{
    self->end_flags &= ~LANE_FIRST;
    self->events_left -= role;
    self->token_awaited = !first_token;
    if (first_token) {
        /* The meter knows the answer's model, and its TTFT deadline is met: the stream's end
         * may be taken here. */
        self->end_flags |= LANE_END_OK;
    }
    return call_first(relay, model, response_id, role, first_token);
}

/* A read's token events among its chunks, and what its events without a token leave. */
struct read_tokens {
    int n;            /* token events */
    const int *index; /* their chunks' indices (NULL: chunks 0 to n - 1) */
    int empties;      /* chunks whose text is empty (events without a token; not the role's) */
    int last_usage;   /* the last chunk with usage (-1: none) */
    long long carry;  /* choice 0's tokens carried to its next token event, after the read */
};

/* After a read's token events were committed: the last usage seen when it was an event's
 * without a token (chat's role chunk, an empty text), the empty texts counted (handed over by
 * `take`), and what they carry. */
static void
lane_note_others(Lane *self, const struct token_chunk *chunks, const struct read_tokens *tokens)
{
    int u = tokens->last_usage;
    if (u >= 0 && chunks[u].kind != CHUNK_TOKEN) {
        self->has_usage = 1;
        self->prompt = chunks[u].prompt;
        self->total = chunks[u].total;
        self->completion = chunks[u].completion;
    }
    self->other_events += tokens->empties;
    self->carry = tokens->carry;
}

/* A read that takes (a part of) the stream's end (`end_span`), checked, with room made for
 * its ``n`` token events (none but in the read that begins the end, whose last is the finish
 * chunk): 1 when taken, 0 when left to the Python path (nothing done), -1 with an exception.
 * Its client bytes are written; or, when it brings the body's last chunk, they go to the
 * relay's `end_in_lane`, which ends the client's answer with them in one write and the
 * upstream's exchange, and the lane is disarmed for good. Then its token events are committed
 * (their client-side instant after that write; a held finish chunk's is set when it leaves),
 * the usage chunk's usage is the last seen (the Python path's `usage` is the final one), and
 * what the lane took of the end is kept for the end's next read. */
static int
lane_end_read(Lane *self, int n, cursor *payloads, const size_t *sizes,
              const struct token_chunk *chunks, const long long *gained, long long last,
              const struct lane_end *tail, long long at_ns, long long read_ns,
              int column_needed, int role, const struct read_tokens *tokens, int first_token,
              PyObject *model, PyObject *response_id)
{
    int ended = tail->to == END_BODY;
    int usage_here = tail->from < END_USAGE && tail->to >= END_USAGE;
    int held_here = self->drop_usage && tail->from == 0 && tail->to == END_FINISH;
    /* A finish chunk held since an earlier read leaves with this one: its pending event (a
     * token event's), or one more event without a token. */
    int releasing = self->held != NULL && usage_here;
    Py_ssize_t released = releasing && self->held_token ? self->pending - 1 : -1;
    PyObject *reason, *fingerprint = NULL, *out;
    char *held = NULL;
    size_t held_size = 0;
    int failed = 0;
    if (tail->from == 0) {
        const struct token_chunk *finish = &tail->finish;
        reason = PyUnicode_DecodeUTF8((const char *)tail->finish_payload + finish->finish_start,
                                      finish->finish_end - finish->finish_start, "replace");
    }
    else {
        reason = Py_NewRef(self->finish_reason);
    }
    if (!usage_here) {
        fingerprint = Py_XNewRef(self->fingerprint);
    }
    else if (tail->usage.fingerprint_start >= 0) {
        fingerprint = PyUnicode_DecodeASCII(
            (const char *)tail->usage_payload + tail->usage.fingerprint_start,
            tail->usage.fingerprint_end - tail->usage.fingerprint_start, "strict");
        failed |= fingerprint == NULL;
    }
    if (held_here) { /* the finish chunk's event without its usage member */
        const struct token_chunk *finish = &tail->finish;
        size_t before = (size_t)finish->usage_start;
        size_t after = tail->finish_size - (size_t)finish->usage_end;
        held_size = before + after;
        held = PyMem_Malloc(held_size);
        if (held != NULL) {
            memcpy(held, tail->finish_payload, before);
            memcpy(held + before, tail->finish_payload + finish->usage_end, after);
        }
        failed |= held == NULL;
    }
    out = end_bytes(self, n, payloads, sizes, chunks, tail, !ended);
    if (failed || reason == NULL || out == NULL) {
        PyErr_Clear();
        Py_XDECREF(reason);
        Py_XDECREF(fingerprint);
        Py_XDECREF(out);
        PyMem_Free(held);
        return 0; /* nothing done yet: the Python path takes the read */
    }
    /* Held for the rest of the call: nothing the calls may close this lane under it. */
    PyObject *client = Py_NewRef(self->client);
    PyObject *relay = Py_NewRef(self->relay);
    int result = -1;
    if (ended) {
        self->armed = 0;
        self->end_flags = 0;
        lane_forget_end(self); /* all of it goes to the relay's `end_in_lane` */
        /* The meter learns of the stream's first token (and names) before its end. */
        if ((first_token && call_first(relay, model, response_id, role, 1) < 0)
            || call_end(self, relay, out, at_ns, reason, fingerprint) < 0) {
            goto done;
        }
    }
    else if (PyBytes_GET_SIZE(out) != 0 && !lane_write(client, out)) {
        result = 0; /* nothing counted: the Python path writes again */
        goto done;
    }
    /* Room again, should anything the call or the write did have taken the counts meanwhile. */
    if (n != 0
        && (lane_reserve(self, n) < 0
            || (column_needed && self->tokens == NULL && lane_start_column(self) < 0))) {
        PyErr_NoMemory();
        goto done;
    }
    lane_commit(self, tokens->n, chunks, gained, tokens->index, last, at_ns, read_ns);
    lane_note_others(self, chunks, tokens);
    if (released >= 0 && self->pending == released + 1) {
        self->events[released].down = monotonic_ns() - self->origin_ns;
    }
    else if (releasing && released < 0) {
        self->other_events += 1;
    }
    if (usage_here) {
        self->has_usage = 1;
        self->prompt = tail->usage.prompt;
        self->total = tail->usage.total;
        self->completion = tail->usage.completion;
    }
    if (ended) {
        result = 1;
        goto done;
    }
    if (first_token && lane_first_taken(self, relay, model, response_id, role, 1) < 0) {
        goto done;
    }
    if (self->end_stage == tail->from) { /* (not handed over by a call meanwhile) */
        self->end_stage = tail->to;
        if (tail->from == 0) {
            self->finish_reason = Py_NewRef(reason);
        }
        if (usage_here) {
            Py_XSETREF(self->fingerprint, Py_XNewRef(fingerprint));
        }
        if (releasing) {
            PyMem_Free(self->held);
            self->held = NULL;
            self->held_size = self->held_cut = 0;
            self->held_token = 0;
        }
        if (held_here) {
            self->held = held;
            self->held_size = (Py_ssize_t)held_size;
            self->held_cut = tail->finish.usage_start;
            self->held_token = tail->finish.kind == CHUNK_TOKEN;
            held = NULL;
        }
    }
    result = lane_check_full(self, client, relay) < 0 ? -1 : 1;
done:
    Py_DECREF(client);
    Py_DECREF(relay);
    Py_DECREF(out);
    Py_DECREF(reason);
    Py_XDECREF(fingerprint);
    PyMem_Free(held);
    return result;
}

/* A read after the lane took a part of the stream's end: 1 when it is the end's next part
 * (taken), else 0. */
static int
lane_end_next(Lane *self, cursor p, cursor end, long long at_ns)
{
    struct lane_end tail;
    if (!end_span(self, self->end_stage, p, end, &tail) || !client_open(self)) {
        return 0;
    }
    struct read_tokens none = {0, NULL, 0, -1, self->carry};
    return lane_end_read(self, 0, NULL, NULL, NULL, NULL, self->last_cumulative, &tail, at_ns,
                         monotonic_ns(), 0, 0, &none, 0, NULL, NULL);
}

/* -- The first read of a stream, taken by the lane -----------------------------------------
 *
 * A stream's first read after its head is its first token: for chat, vLLM's role chunk (the
 * role, no content) and choice 0's first token chunk, written in the same turn of its loop
 * (and read together, or the role chunk first and alone); for completions, the first token
 * chunk. Armed before any event (LANE_FIRST), the lane takes such a read as it takes any
 * other, the role chunk forwarded (its usage cut as the token chunks' is) and counted as an
 * event but not a token event, and hands the relay what `StreamMeter._consume` would have
 * read off it besides the counts (`first_in_lane(model, response_id, other_events,
 * first_token)`): the answer's model and id from its first chunk, the role chunk, and whether
 * the stream's first token came (the TTFT deadline is met). A role chunk read alone leaves the
 * lane awaiting the first token, whose read says so (`first_in_lane(None, None, 0, True)`).
 * The read with the first token may bring (a part of) the stream's end too (a short answer
 * written before the proxy first read its body): `first_in_lane` is then called before the
 * relay hears of the end (`lane_end_read`). A role chunk with a system_fingerprint or with
 * completion tokens (which the meter would carry to the next token event), and names the
 * meter decodes or would not keep are left to the Python path. */

/* The longest name the meter keeps (meter._bounded_name). */
#define ANSWER_NAME_MAX 256

/* What meter._bounded_name makes of the name at [start, end) (a `name` span: no quote,
 * backslash or control byte): 1 when kept (at most 256 characters, all printable), 0 when
 * not, -1 when the Python path must decide (a byte outside ASCII, which it decodes first). */
static int
kept_name(cursor start, cursor end)
{
    int kept = end - start <= ANSWER_NAME_MAX;
    for (cursor p = start; p < end; p++) {
        if (*p & 0x80) {
            return -1;
        }
        kept &= *p != 0x7f; /* DEL, the one ASCII byte `name` lets through that is not printable */
    }
    return kept;
}

/* The answer's model and id off the stream's first chunk, as StreamMeter keeps them: 1 with
 * *model and *response_id made (the id None when not kept), 0 when the Python path must read
 * them (a byte outside ASCII; a model the meter would not keep, when it would look at the next
 * chunk's), -1 with an exception set. */
static int
answer_names(cursor payload, const struct token_chunk *chunk, PyObject **model,
             PyObject **response_id)
{
    cursor model_start = payload + chunk->model_start, model_end = payload + chunk->model_end;
    cursor id_start = payload + ID_START, id_end = payload + chunk->id_end;
    int model_kept = kept_name(model_start, model_end);
    int id_kept = kept_name(id_start, id_end);
    if (model_kept != 1 || id_kept < 0) {
        return 0;
    }
    *model = PyUnicode_DecodeASCII((const char *)model_start, model_end - model_start, "strict");
    *response_id = id_kept ? PyUnicode_DecodeASCII((const char *)id_start, id_end - id_start,
                                                   "strict")
                           : Py_NewRef(Py_None);
    if (*model == NULL || *response_id == NULL) {
        Py_CLEAR(*model);
        Py_CLEAR(*response_id);
        return -1;
    }
    return 1;
}

/* The relay's `first_in_lane` (names NULL: None): 0 when it returned, -1 with its exception. */
static int
call_first(PyObject *relay, PyObject *model, PyObject *response_id, int other_events,
           int first_token)
{
    PyObject *other = PyLong_FromLong(other_events);
    if (other == NULL) {
        return -1;
    }
    PyObject *result = PyObject_CallMethodObjArgs(
        relay, first_name, model ? model : Py_None, response_id ? response_id : Py_None, other,
        first_token ? Py_True : Py_False, NULL);
    Py_DECREF(other);
    if (result == NULL) {
        return -1;
    }
    Py_DECREF(result);
    return 0;
}

/* The read [data, data + size) that arrived at ``at_ns``: 1 when taken whole (parsed,
 * counted, stamped and written to the client), 0 when left untouched for the Python path, -1
 * with an exception set. `relay` for Python; the upstream's C reader (_recvstamp.c) calls it
 * through the `_lane_api` capsule, with the bytes still in its receive buffer and the instant
 * as a C integer: no bytes object and no int per read. */
static int
lane_relay_read(Lane *self, const char *data, Py_ssize_t size, long long at_ns)
{
    if (!self->armed) {
        return 0;
    }
    cursor p = (cursor)data;
    cursor end = p + size;
    if (self->end_stage) {
        return lane_end_next(self, p, end, at_ns);
    }
    cursor payloads[LANE_MAX_CHUNKS];
    size_t sizes[LANE_MAX_CHUNKS];
    struct token_chunk chunks[LANE_MAX_CHUNKS];
    long long gained[LANE_MAX_CHUNKS];
    int n = 0;
    size_t out_size = 0;
    long long last = self->last_cumulative;
    struct lane_end tail;
    int ending = 0; /* the read ends the stream (`end_span`): its finish chunk is chunks[n - 1] */
    int first = (self->end_flags & LANE_FIRST) != 0; /* the stream's first read (above) */
    int role = 0; /* chunks[0] is chat's role chunk (a first read's only) */
    int token_index[LANE_MAX_CHUNKS]; /* the token events among the chunks */
    struct read_tokens tokens = {0, token_index, 0, -1, self->carry};
    /* Every check first: a read is taken whole or not at all. */
    while (p < end && !ending) {
        cursor at = p;
        int whole = n < LANE_MAX_CHUNKS && chunk_span(&p, end, &payloads[n], &sizes[n])
                    && sizes[n] <= (size_t)self->max_event_bytes;
        cursor payload_end = whole ? payloads[n] + sizes[n] : NULL;
        int taken = whole && scan_span(payloads[n], payload_end, &chunks[n], 0, &self->head)
                    && chunks[n].index == 0;
        if (whole && !taken && first && n == 0) {
            /* TokenCounter.observe carries a role chunk's completion tokens to the next token
             * event, and the meter keeps a fingerprint off any chunk: the Python path's. */
            role = taken = scan_span(payloads[n], payload_end, &chunks[n], 1, &self->head)
                           && chunks[n].kind == CHUNK_ROLE && chunks[n].index == 0
                           && chunks[n].fingerprint_start < 0
                           && !(chunks[n].has_usage && chunks[n].completion != 0);
        }
        int empty = 0;
        if (whole && !taken) {
            /* A text chunk whose text is empty (vLLM holds back a character whose UTF-8 bytes
             * span two tokens, and sends its text with the next): an event without a token,
             * whose tokens TokenCounter.observe carries to choice 0's next token event. */
            empty = taken = scan_span(payloads[n], payload_end, &chunks[n], 2, &self->head)
                            && chunks[n].kind == CHUNK_EMPTY && chunks[n].index == 0
                            && chunks[n].finish_start < 0 && chunks[n].fingerprint_start < 0;
        }
        if (!taken) {
            /* The end needs the answer's model known: by the meter (END_OK), or from this
             * read's first chunk (a stream whose first read is also its end: a short answer
             * written before the proxy first read its body). */
            int named = (self->end_flags & LANE_END_OK) || first || self->token_awaited;
            if (n == LANE_MAX_CHUNKS || !named || !end_span(self, 0, at, end, &tail)) {
                return 0;
            }
            /* The finish chunk is one more token event of choice 0, counted as they are; or,
             * its text empty, an event without a token (as an empty text: its token carried;
             * held, it is counted when it leaves), taken only where the meter knows the
             * stream's first token. */
            empty = tail.finish.kind == CHUNK_EMPTY;
            if (empty && (first || self->token_awaited || !(self->end_flags & LANE_END_OK))) {
                return 0;
            }
            payloads[n] = tail.finish_payload;
            sizes[n] = tail.finish_size;
            chunks[n] = tail.finish;
            ending = 1;
        }
        struct token_chunk *chunk = &chunks[n];
        /* TokenCounter.token_event: the rise of the cumulative count (0 when it did not
         * rise: released text, no new token), else one token per event without usage. */
        if ((role && n == 0) || empty) { /* events without a token: never committed as one */
            gained[n] = 0;
            if (empty && chunk->has_usage && chunk->completion > last) {
                tokens.carry += chunk->completion - last; /* TokenCounter.observe */
                last = chunk->completion;
            }
            /* (counted when it leaves, if it is a finish chunk held for the fingerprint) */
            tokens.empties += empty && !(ending && self->drop_usage && tail.to == END_FINISH);
        }
        else {
            if (chunk->has_usage) {
                gained[n] = chunk->completion > last ? chunk->completion - last : 0;
                if (chunk->completion > last) {
                    last = chunk->completion;
                }
            }
            else {
                gained[n] = 1;
                last += 1;
            }
            gained[n] += tokens.carry;
            tokens.carry = 0;
            token_index[tokens.n++] = n;
        }
        if (chunk->has_usage) {
            tokens.last_usage = n;
        }
        out_size += sizes[n];
        if (chunk->has_usage && self->strip) {
            out_size -= (size_t)(chunk->usage_end - chunk->usage_start);
        }
        n++;
    }
    /* The end's usage chunk and [DONE] are events of the stream too (StreamMeter.events), as
     * is a role chunk. */
    if (n == 0 || self->pending + self->other_events + n + (ending ? 2 : 0) > self->events_left
        || self->pending + n > LANE_MAX_PENDING) {
        return 0;
    }
    if (tokens.n == n) {
        tokens.index = NULL; /* every chunk a token event: the common read */
    }
    if (!client_open(self)) {
        return 0;
    }
    int column_needed = 0;
    for (int k = 0; k < tokens.n; k++) {
        column_needed |= gained[tokens.index != NULL ? tokens.index[k] : k] != 1;
    }
    if (lane_reserve(self, n) < 0
        || (column_needed && self->tokens == NULL && lane_start_column(self) < 0)) {
        return 0; /* no memory now: the Python path will fail the read if it must */
    }
    PyObject *model = NULL, *response_id = NULL;
    if (first) {
        int named = answer_names(payloads[0], &chunks[0], &model, &response_id);
        if (named <= 0) {
            PyErr_Clear();
            return 0;
        }
    }
    long long read_ns = monotonic_ns();
    if (ending) {
        int taken = lane_end_read(self, n, payloads, sizes, chunks, gained, last, &tail, at_ns,
                                  read_ns, column_needed, role, &tokens,
                                  first || self->token_awaited, model, response_id);
        Py_XDECREF(model);
        Py_XDECREF(response_id);
        return taken;
    }
    /* The client's chunk: `<size in hex>\r\n<payloads>\r\n`, as ClientExchange.write frames;
     * made on the stack when it fits (a read's usual few hundred bytes). */
    char head[24];
    int head_size = hex_line(head, out_size);
    Py_ssize_t client_size = (Py_ssize_t)(head_size + out_size + 2);
    char stack_out[LANE_STACK_OUT];
    char *out = client_size <= LANE_STACK_OUT ? stack_out : PyMem_Malloc((size_t)client_size);
    if (out == NULL) {
        Py_XDECREF(model);
        Py_XDECREF(response_id);
        return 0;
    }
    char *to = out;
    memcpy(to, head, (size_t)head_size);
    to += head_size;
    for (int i = 0; i < n; i++) {
        struct token_chunk *chunk = &chunks[i];
        if (chunk->has_usage && self->strip) {
            size_t before = (size_t)chunk->usage_start;
            size_t after = sizes[i] - (size_t)chunk->usage_end;
            memcpy(to, payloads[i], before);
            memcpy(to + before, payloads[i] + chunk->usage_end, after);
            to += before + after;
        }
        else {
            memcpy(to, payloads[i], sizes[i]);
            to += sizes[i];
        }
    }
    to[0] = '\r';
    to[1] = '\n';
    /* Held for the rest of the call: nothing the write calls may close this lane under it. */
    PyObject *client = Py_NewRef(self->client);
    PyObject *relay = Py_NewRef(self->relay);
    int result = -1;
    int idle;
    int written = lane_send(self, client, out, client_size, &idle);
    if (out != stack_out) {
        PyMem_Free(out);
    }
    if (!written) {
        result = 0; /* nothing counted: the Python path writes again */
        goto done;
    }
    /* Room again, should anything the write called have taken the counts meanwhile. */
    if (lane_reserve(self, n) < 0
        || (column_needed && self->tokens == NULL && lane_start_column(self) < 0)) {
        PyErr_NoMemory();
        goto done;
    }
    /* Committed: the read is this lane's. */
    lane_commit(self, tokens.n, chunks, gained, tokens.index, last, at_ns, read_ns);
    lane_note_others(self, chunks, &tokens);
    int first_token = tokens.n > 0 && (first || self->token_awaited);
    if ((first || first_token)
        && lane_first_taken(self, relay, model, response_id, role, first_token) < 0) {
        goto done;
    }
    if (!idle && lane_check_full(self, client, relay) < 0) {
        goto done;
    }
    result = 1;
done:
    Py_DECREF(client);
    Py_DECREF(relay);
    Py_XDECREF(model);
    Py_XDECREF(response_id);
    return result;
}

/* relay(read, at_ns) -> bool: the read taken whole (True), or left untouched for the Python
 * path (False). ``at_ns``: the read's instant (the kernel's receive stamp). */
static PyObject *
lane_relay(Lane *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "relay() takes (bytes, at_ns)");
        return NULL;
    }
    /* An instant is a three-digit int, which PyLong_AsLongLong converts byte by byte. */
    int overflow;
    long long at_ns = PyLong_AsLongLongAndOverflow(args[1], &overflow);
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "relay(): at_ns does not fit in 64 bits");
        return NULL;
    }
    if (at_ns == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int taken =
        lane_relay_read(self, PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]), at_ns);
    if (taken < 0) {
        return NULL;
    }
    self->reads_taken += taken;
    return PyBool_FromLong(taken);
}

/* arm(events_left, last_cumulative[, end_flags]): take reads from now on; the stream may take
 * ``events_left`` more events, and choice 0 has had ``last_cumulative`` completion tokens;
 * ``end_flags`` (LANE_END_*): whether a read that ends the stream may be taken too. */
static PyObject *
lane_arm(Lane *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "arm() takes (events_left, last_cumulative[, end_flags])");
        return NULL;
    }
    long end_flags = 0;
    if (nargs == 3) {
        end_flags = PyLong_AsLong(args[2]);
        if (end_flags == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    long long events_left = PyLong_AsLongLong(args[0]);
    if (events_left == -1 && PyErr_Occurred()) {
        return NULL;
    }
    long long last = PyLong_AsLongLong(args[1]);
    if (last == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (self->client == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "arm(): the lane is closed");
        return NULL;
    }
    self->events_left = events_left + self->pending + self->other_events;
    self->last_cumulative = last;
    self->end_flags = (int)end_flags;
    self->token_awaited = 0; /* the meter's flags say where the stream is */
    lane_forget_end(self);   /* (handed over by `take_end` before the Python path's read) */
    if (self->pending == 0) {
        self->all_ones = 1;
        self->gained = 0;
    }
    self->armed = 1;
    Py_RETURN_NONE;
}

/* One member of the pending events as native int64 bytes (array('q').frombytes). */
static PyObject *
column_of(const struct lane_event *events, Py_ssize_t n, size_t member)
{
    PyObject *column = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(long long));
    if (column == NULL) {
        return NULL;
    }
    long long *to = (long long *)PyBytes_AS_STRING(column);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(&to[i], (const char *)&events[i] + member, sizeof(long long));
    }
    return column;
}

/* take() -> None | (up: bytes, down: bytes, tokens: bytes | None, gained, last_cumulative,
 * exact, usage, other_events, carry): disarms the lane and hands over what it counted since
 * the last take (None: nothing, and no usage seen: a role chunk read alone has no token event,
 * but its usage).
 * ``up``, ``down`` and ``tokens`` are per event, native int64
 * (array('q').frombytes); ``tokens`` is None when every event carried one token; ``gained``:
 * their sum; ``exact``: every event carried usage; ``usage``: the last usage seen, (prompt,
 * total, completion), or None; ``other_events``: the empty texts (events without a token);
 * ``carry``: the tokens they carry that no token event took yet. A finish chunk held
 * (`take_end`) has no ``down`` yet: it is the last event, and ``down`` stops before it. */
static PyObject *
lane_take(Lane *self, PyObject *unused)
{
    (void)unused;
    self->armed = 0;
    if (self->pending == 0 && !self->has_usage && self->other_events == 0 && self->carry == 0) {
        Py_RETURN_NONE;
    }
    PyObject *up = column_of(self->events, self->pending, offsetof(struct lane_event, up));
    Py_ssize_t written =
        self->pending - (self->held != NULL && self->held_token && self->pending > 0);
    PyObject *down = column_of(self->events, written, offsetof(struct lane_event, down));
    PyObject *tokens = self->all_ones ? Py_NewRef(Py_None)
                                      : PyBytes_FromStringAndSize(
                                            (const char *)self->tokens,
                                            self->pending * (Py_ssize_t)sizeof(long long));
    PyObject *usage = self->has_usage
                          ? Py_BuildValue("(LLL)", self->prompt, self->total, self->completion)
                          : Py_NewRef(Py_None);
    PyObject *answer = NULL;
    if (up != NULL && down != NULL && tokens != NULL && usage != NULL) {
        answer = Py_BuildValue("(OOOLLOOLL)", up, down, tokens, self->gained,
                               self->last_cumulative, self->inexact ? Py_False : Py_True, usage,
                               self->other_events, self->carry);
    }
    Py_XDECREF(up);
    Py_XDECREF(down);
    Py_XDECREF(tokens);
    Py_XDECREF(usage);
    if (answer != NULL) {
        self->events_handed += self->pending;
        self->pending = 0;
        self->inexact = 0;
        self->has_usage = 0;
        self->other_events = 0;
        self->carry = 0;
        self->all_ones = 1;
        self->gained = 0;
        /* Now in the Python columns: a stream in flight keeps no second copy here. */
        PyMem_Free(self->events);
        PyMem_Free(self->tokens);
        self->events = NULL;
        self->tokens = NULL;
        self->capacity = 0;
    }
    return answer;
}

/* take_end() -> None | (stage, finish_reason, fingerprint, held, held_cut, held_token):
 * disarms the lane and hands over what it took of a stream's end that came over several reads
 * ("An end over several reads"), and forgets it (None: nothing of it). ``stage``: END_FINISH,
 * END_USAGE or END_DONE (the finish chunk, the usage chunk, [DONE] taken); ``fingerprint``:
 * the usage chunk's (None: none, or not taken); ``held``: the finish chunk's event held for
 * it, its usage member cut at ``held_cut`` (None: none held), a token event (``held_token``:
 * the last one `take` gave, without its client instant) or one without a token (not counted
 * yet). Called after `take`. */
static PyObject *
lane_take_end(Lane *self, PyObject *unused)
{
    (void)unused;
    self->armed = 0;
    if (self->end_stage == 0) {
        Py_RETURN_NONE;
    }
    PyObject *held = self->held == NULL
                         ? Py_NewRef(Py_None)
                         : PyBytes_FromStringAndSize(self->held, self->held_size);
    if (held == NULL) {
        return NULL;
    }
    PyObject *answer = Py_BuildValue("(iOOOni)", self->end_stage, self->finish_reason,
                                     self->fingerprint ? self->fingerprint : Py_None, held,
                                     self->held_cut, self->held_token);
    Py_DECREF(held);
    if (answer != NULL) {
        lane_forget_end(self);
    }
    return answer;
}

/* close(): disarmed for good, its references let go (what it counted must have been taken). */
static PyObject *
lane_close(Lane *self, PyObject *unused)
{
    (void)unused;
    lane_clear(self);
    Py_RETURN_NONE;
}

static PyObject *
lane_get_armed(Lane *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->armed);
}

static PyObject *
lane_get_last_read_ns(Lane *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(self->last_read_ns);
}

static PyObject *
lane_get_end_stage(Lane *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->end_stage);
}

static PyObject *
lane_get_pending(Lane *self, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(self->pending);
}

static PyObject *
lane_get_reads_taken(Lane *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(self->reads_taken);
}

static PyObject *
lane_get_events_handed(Lane *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(self->events_handed);
}

static int
lane_api_relay_read(PyObject *lane, const char *data, Py_ssize_t size, long long at_ns)
{
    int taken = lane_relay_read((Lane *)lane, data, size, at_ns);
    ((Lane *)lane)->reads_taken += taken > 0;
    return taken;
}

static lane_api lane_api_table; /* the `_lane_api` capsule's: filled at import */

static PyMethodDef lane_methods[] = {
    {"relay", (PyCFunction)(void (*)(void))lane_relay, METH_FASTCALL,
     "relay(read, at_ns) -> bool: the read taken whole, or left untouched (False)."},
    {"arm", (PyCFunction)(void (*)(void))lane_arm, METH_FASTCALL,
     "arm(events_left, last_cumulative): take reads from now on."},
    {"take", (PyCFunction)lane_take, METH_NOARGS,
     "take() -> None | (up, down, tokens, gained, last_cumulative, exact, usage, other_events, "
     "carry): disarm, hand over the counts."},
    {"take_end", (PyCFunction)lane_take_end, METH_NOARGS,
     "take_end() -> None | (stage, finish_reason, fingerprint, held, held_cut, held_token): "
     "disarm, hand over what was taken of a stream's end that came over several reads."},
    {"close", (PyCFunction)lane_close, METH_NOARGS, "close(): disarmed for good."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef lane_getset[] = {
    {"armed", (getter)lane_get_armed, NULL, "Whether `relay` takes reads.", NULL},
    {"pending", (getter)lane_get_pending, NULL, "Events counted since the last `take`.", NULL},
    {"reads_taken", (getter)lane_get_reads_taken, NULL,
     "Reads taken whole (`relay` True), over the lane's life.", NULL},
    {"events_handed", (getter)lane_get_events_handed, NULL,
     "Events handed over by `take`, over the lane's life.", NULL},
    {"end_stage", (getter)lane_get_end_stage, NULL,
     "How far it took a stream's end that came over several reads (END_*; 0: not begun).",
     NULL},
    {"last_read_ns", (getter)lane_get_last_read_ns, NULL,
     "When the last read it took was read (CLOCK_MONOTONIC ns; 0: none yet).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar.protocol._tokenscan.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The per-read path of a stream's common read, in one call (see _tokenscan.c).",
    .tp_new = lane_new,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_traverse = (traverseproc)lane_traverse,
    .tp_clear = (inquiry)lane_clear,
    .tp_methods = lane_methods,
    .tp_getset = lane_getset,
};

static PyMethodDef methods[] = {
    {"chunk_payload", chunk_payload, METH_O,
     "chunk_payload(read) -> the payload of a read that is exactly one whole HTTP/1.1 chunk "
     "(hex size, no extension), else None."},
    {"scan", scan, METH_O,
     "scan(data) -> None | (index, prompt, total, completion, usage_start, usage_end, id_end, "
     "model_start, model_end): the common token chunk (fastchunk._TOKEN_CHUNK), or None."},
    {"scan_chunk", scan_chunk, METH_O,
     "scan_chunk(data) -> None | (kind, index, prompt, total, completion, usage_start, "
     "usage_end, id_end, model_start, model_end, finish_start, finish_end, fingerprint_start, "
     "fingerprint_end): a common chunk (fastchunk._COMMON_CHUNK), or None."},
    {"fast_chunk", fast_chunk, METH_O,
     "fast_chunk(data) -> None | (ChunkInfo, usage_start, usage_end): fastchunk.fast_chunk, "
     "in one call (after configure)."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(ChunkInfo, Usage, kinds): the types fast_chunk builds, and ChunkKind by the "
     "kind numbers of scan_chunk."},
    {"configure_events", configure_events, METH_O,
     "configure_events(SSEEvent): the type data_events builds."},
    {"data_events", (PyCFunction)(void (*)(void))data_events, METH_FASTCALL,
     "data_events(data, max_event_size) -> (events, stop): the whole one-line data events at "
     "the start of data, and where the rest begins (sse.SSEParser.feed's common read)."},
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
    if (PyType_Ready(&LaneType) < 0) {
        return NULL;
    }
    lane_api_table.lane_type = &LaneType;
    lane_api_table.relay_read = lane_api_relay_read;
    write_name = PyUnicode_InternFromString("write");
    buffer_size_name = PyUnicode_InternFromString("get_write_buffer_size");
    is_closing_name = PyUnicode_InternFromString("is_closing");
    full_name = PyUnicode_InternFromString("on_client_full");
    end_name = PyUnicode_InternFromString("end_in_lane");
    first_name = PyUnicode_InternFromString("first_in_lane");
    if (write_name == NULL || buffer_size_name == NULL || is_closing_name == NULL
        || full_name == NULL || end_name == NULL || first_name == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Lane", (PyObject *)&LaneType) < 0
        || PyModule_AddIntConstant(module, "LANE_END_OK", LANE_END_OK) < 0
        || PyModule_AddIntConstant(module, "LANE_END_FINGERPRINT_KNOWN",
                                   LANE_END_FINGERPRINT_KNOWN) < 0
        || PyModule_AddIntConstant(module, "LANE_FIRST", LANE_FIRST) < 0
        || PyModule_AddIntConstant(module, "END_FINISH", END_FINISH) < 0
        || PyModule_AddIntConstant(module, "END_USAGE", END_USAGE) < 0
        || PyModule_AddIntConstant(module, "END_DONE", END_DONE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    PyObject *api = PyCapsule_New(&lane_api_table, LANE_API_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObject(module, "_lane_api", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
