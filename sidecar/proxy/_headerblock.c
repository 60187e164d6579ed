/* The end-to-end header lines of a request or a response, written in C: what
 * headers.py's `_kept_python` makes of the header pairs the parser gave, byte for byte.
 *
 * Why C: every request builds two such blocks (the upstream request's, from the client's
 * headers; the client's response head, from the upstream's), and the compiled Python (a
 * lower-cased copy and a set lookup per header, a list of parts, a join, the sets of names a
 * Connection header gives) was ~25k of a worker's ~360k instructions per 32-token request
 * (benchmarks/RESULTS.md, "Session 27"). headers.py stays the specification and the path for
 * what this hands back: anything but a list of (bytes, bytes) tuples gives None, and the
 * Python decides. tests/test_headers_native.py holds the two to the same answers on generated
 * header lists.
 *
 * first_value(pairs: list[tuple[bytes, bytes]], name: bytes) -> bytes | None | Ellipsis
 *   The value of the first pair whose name, ASCII lower-cased, is ``name`` (lower-case); None
 *   for none; ... where the pairs are not a list of (bytes, bytes) (the Python decides):
 *   upstream.py's `UpstreamExchange.header`, without a lower-cased copy per name.
 *
 * lowered_index(pairs: list[tuple[bytes, bytes]]) -> dict[bytes, bytes] | None
 *   Each name, ASCII lower-cased, to the first value given for it: what `RequestHeaders`
 *   looks names up in (its Python: a dict filled from the pairs in reverse).
 *
 * kept(pairs: list[tuple[bytes, bytes]], dropped: tuple[bytes, ...])
 *     -> tuple[bytes, list[bytes] | None, list[bytes] | None, bool] | None
 *   ``dropped``: lower-case names. Returns (the lines "Name: value\r\n" of the pairs whose
 *   name, ASCII lower-cased, is not in ``dropped``, in order, names and values as given;
 *   the values of dropped X-Forwarded-For headers, in order, or None for none; the tokens of
 *   every Connection header (split at commas, ASCII whitespace stripped, lower-cased) that
 *   are neither empty nor in ``dropped``, or None for none; whether such a token, dropped or
 *   not, is x-forwarded-for). Connection itself must be in ``dropped`` for its tokens to be
 *   read, as it is in every set headers.py passes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static const char CONNECTION[] = "connection";
static const char X_FORWARDED_FOR[] = "x-forwarded-for";

/* A (bytes, bytes) tuple: what the parsers give; anything else is left to the Python. */
static inline int
is_bytes_pair(PyObject *pair)
{
    return PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2
           && PyBytes_CheckExact(PyTuple_GET_ITEM(pair, 0))
           && PyBytes_CheckExact(PyTuple_GET_ITEM(pair, 1));
}

static inline unsigned char
ascii_lower(unsigned char c)
{
    return (c >= 'A' && c <= 'Z') ? (unsigned char)(c + ('a' - 'A')) : c;
}

/* A new bytes of ``text[0:size]`` ASCII lower-cased (bytes.lower()). */
static PyObject *
lowered_bytes(const char *text, Py_ssize_t size)
{
    PyObject *lowered = PyBytes_FromStringAndSize(NULL, size);
    if (lowered != NULL) {
        char *out = PyBytes_AS_STRING(lowered);
        for (Py_ssize_t i = 0; i < size; i++) {
            out[i] = (char)ascii_lower((unsigned char)text[i]);
        }
    }
    return lowered;
}

/* ``text[0:size]`` lower-cased equals the lower-case ``name[0:name_size]``. */
static int
equals_lowered(const char *text, Py_ssize_t size, const char *name, Py_ssize_t name_size)
{
    if (size != name_size) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        if (ascii_lower((unsigned char)text[i]) != (unsigned char)name[i]) {
            return 0;
        }
    }
    return 1;
}

/* Whether ``text[0:size]`` lower-cased is one of ``dropped``'s names (all exact bytes). */
static int
in_dropped(const char *text, Py_ssize_t size, PyObject *dropped)
{
    Py_ssize_t n = PyTuple_GET_SIZE(dropped);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(dropped, i);
        if (equals_lowered(text, size, PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name))) {
            return 1;
        }
    }
    return 0;
}

/* bytes.strip()'s whitespace. */
static inline int
is_space(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\x0b' || c == '\x0c';
}

/* A Connection header's tokens: those neither empty nor dropped appended to *extra (made on
 * the first), *xff_named set for x-forwarded-for. -1 on a memory error. */
static int
read_connection(const char *value, Py_ssize_t size, PyObject *dropped, PyObject **extra,
                int *xff_named)
{
    Py_ssize_t start = 0;
    while (start <= size) {
        Py_ssize_t end = start;
        while (end < size && value[end] != ',') {
            end++;
        }
        Py_ssize_t a = start, b = end;
        while (a < b && is_space((unsigned char)value[a])) {
            a++;
        }
        while (b > a && is_space((unsigned char)value[b - 1])) {
            b--;
        }
        const char *token = value + a;
        Py_ssize_t token_size = b - a;
        if (equals_lowered(token, token_size, X_FORWARDED_FOR, sizeof(X_FORWARDED_FOR) - 1)) {
            *xff_named = 1;
        }
        if (token_size > 0 && !in_dropped(token, token_size, dropped)) {
            PyObject *lowered = lowered_bytes(token, token_size);
            if (lowered == NULL) {
                return -1;
            }
            if (*extra == NULL && (*extra = PyList_New(0)) == NULL) {
                Py_DECREF(lowered);
                return -1;
            }
            int failed = PyList_Append(*extra, lowered);
            Py_DECREF(lowered);
            if (failed) {
                return -1;
            }
        }
        start = end + 1;
    }
    return 0;
}

static PyObject *
kept(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "kept(pairs, dropped) takes two arguments");
        return NULL;
    }
    PyObject *pairs = args[0], *dropped = args[1];
    if (!PyTuple_CheckExact(dropped)) {
        PyErr_SetString(PyExc_TypeError, "kept: dropped must be a tuple of bytes");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(dropped); i++) {
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(dropped, i))) {
            PyErr_SetString(PyExc_TypeError, "kept: dropped must be a tuple of bytes");
            return NULL;
        }
    }
    if (!PyList_CheckExact(pairs)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    /* Pass 1: check the types, decide each pair, size the block. The pairs are read through
     * the list each time: nothing here runs Python code that could change it. */
    char small[128];
    char *keep = small;
    if (n > (Py_ssize_t)sizeof(small)) {
        keep = PyMem_Malloc((size_t)n);
        if (keep == NULL) {
            return PyErr_NoMemory();
        }
    }
    PyObject *forwarded = NULL, *extra = NULL, *block = NULL;
    int xff_named = 0;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        if (!is_bytes_pair(pair)) {
            goto python_decides;
        }
        PyObject *name = PyTuple_GET_ITEM(pair, 0), *value = PyTuple_GET_ITEM(pair, 1);
        const char *name_text = PyBytes_AS_STRING(name);
        Py_ssize_t name_size = PyBytes_GET_SIZE(name);
        keep[i] = !in_dropped(name_text, name_size, dropped);
        if (keep[i]) {
            total += name_size + 2 + PyBytes_GET_SIZE(value) + 2;
            continue;
        }
        if (equals_lowered(name_text, name_size, CONNECTION, sizeof(CONNECTION) - 1)) {
            if (read_connection(PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value), dropped,
                                &extra, &xff_named) < 0) {
                goto error;
            }
        }
        else if (equals_lowered(name_text, name_size, X_FORWARDED_FOR,
                                sizeof(X_FORWARDED_FOR) - 1)) {
            if (forwarded == NULL && (forwarded = PyList_New(0)) == NULL) {
                goto error;
            }
            if (PyList_Append(forwarded, value) < 0) {
                goto error;
            }
        }
    }
    /* Pass 2: the lines. */
    block = PyBytes_FromStringAndSize(NULL, total);
    if (block == NULL) {
        goto error;
    }
    char *out = PyBytes_AS_STRING(block);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!keep[i]) {
            continue;
        }
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        PyObject *name = PyTuple_GET_ITEM(pair, 0), *value = PyTuple_GET_ITEM(pair, 1);
        Py_ssize_t name_size = PyBytes_GET_SIZE(name), value_size = PyBytes_GET_SIZE(value);
        memcpy(out, PyBytes_AS_STRING(name), (size_t)name_size);
        out += name_size;
        *out++ = ':';
        *out++ = ' ';
        memcpy(out, PyBytes_AS_STRING(value), (size_t)value_size);
        out += value_size;
        *out++ = '\r';
        *out++ = '\n';
    }
    if (keep != small) {
        PyMem_Free(keep);
    }
    return Py_BuildValue("(NNNO)", block, forwarded ? forwarded : Py_NewRef(Py_None),
                         extra ? extra : Py_NewRef(Py_None), xff_named ? Py_True : Py_False);

python_decides:
    if (keep != small) {
        PyMem_Free(keep);
    }
    Py_XDECREF(forwarded);
    Py_XDECREF(extra);
    Py_RETURN_NONE;

error:
    if (keep != small) {
        PyMem_Free(keep);
    }
    Py_XDECREF(forwarded);
    Py_XDECREF(extra);
    Py_XDECREF(block);
    return NULL;
}

static PyObject *
lowered_index(PyObject *Py_UNUSED(module), PyObject *pairs)
{
    if (!PyList_CheckExact(pairs)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        if (!is_bytes_pair(pair)) {
            Py_RETURN_NONE;
        }
    }
    PyObject *index = PyDict_New();
    if (index == NULL) {
        return NULL;
    }
    /* Checked above, and nothing below runs Python code that could change the list (the
     * keys are exact bytes: their hash and equality are C). */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        PyObject *name = PyTuple_GET_ITEM(pair, 0);
        PyObject *lowered = lowered_bytes(PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name));
        if (lowered == NULL) {
            Py_DECREF(index);
            return NULL;
        }
        /* The first value of a name is kept (a later one finds the key there). */
        PyObject *kept = PyDict_SetDefault(index, lowered, PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(lowered);
        if (kept == NULL) {
            Py_DECREF(index);
            return NULL;
        }
    }
    return index;
}

static PyObject *
first_value(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "first_value(pairs, name: bytes) takes two arguments");
        return NULL;
    }
    PyObject *pairs = args[0], *name = args[1];
    if (!PyList_CheckExact(pairs)) {
        return Py_NewRef(Py_Ellipsis);
    }
    const char *wanted = PyBytes_AS_STRING(name);
    Py_ssize_t wanted_size = PyBytes_GET_SIZE(name);
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        if (!is_bytes_pair(pair)) {
            return Py_NewRef(Py_Ellipsis);
        }
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        if (equals_lowered(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), wanted, wanted_size)) {
            return Py_NewRef(PyTuple_GET_ITEM(pair, 1));
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"first_value", (PyCFunction)(void (*)(void))first_value, METH_FASTCALL,
     "first_value(pairs, name) -> bytes | None | ...: the value of the first pair whose name, "
     "ASCII lower-cased, is ``name`` (lower-case); ... (Ellipsis) for anything but a list of "
     "(bytes, bytes)."},
    {"lowered_index", lowered_index, METH_O,
     "lowered_index(pairs) -> dict | None: each name ASCII lower-cased -> its first value "
     "(headers.RequestHeaders' index); None for anything but a list of (bytes, bytes)."},
    {"kept", (PyCFunction)(void (*)(void))kept, METH_FASTCALL,
     "kept(pairs, dropped) -> (block, forwarded, extra, xff_named) | None: headers.py's "
     "end-to-end header lines of one pass (see the module's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "sidecar.proxy._headerblock",
    "A request's or a response's end-to-end header lines written in C (see headers.py).",
    0,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__headerblock(void)
{
    return PyModule_Create(&module_def);
}
