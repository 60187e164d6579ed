/* sidecar._recordtypes: the record's types where C pays (record.py says what each stands for).
 *
 * Int64s: record.PyInt64s (the specification, and the stand-in where this is not built) as a
 * C type.
 *
 * A timeline's columns are Int64s: built by the worker for every record (four per request),
 * rebuilt by the collector from the wire, and read there by the metric functions (`len`,
 * `[0]`, `[-1]` of every column of every record). In Python each of those is a method call
 * into a class with a memoryview inside (~10 bytecodes and a frame each, ~440 bytecodes per
 * request over the two processes); here they are the type's own slots. The values are kept
 * the same way, packed in one bytes object (`data`, native int64), so everything that reads
 * `data` (the record's wire form, numpy, the window's columns) is unchanged.
 *
 * What it does, as PyInt64s does: Int64s(values=b"") takes the packed bytes as they are, an
 * object exporting a buffer of C int64 ("q", such as array("q")) by one copy, anything else
 * through array("q", values); a length that is not a multiple of 8 bytes is a ValueError.
 * len, indexing (negative indexes; a slice, any step, is an Int64s), iteration, tolist(),
 * equality with an Int64s (same bytes) or with a tuple or list of the same ints, hash (that
 * of the bytes), repr, pickling (by the bytes). Immutable, no buffer of its own (numpy reads
 * `data`). record.py registers it as a collections.abc.Sequence. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD PyObject *data; /* exact bytes, a multiple of 8 long */
    Py_ssize_t size;              /* values */
} Int64s;

static PyTypeObject Int64sType;
static PyObject *array_type; /* array.array */

static inline int64_t
value_at(Int64s *self, Py_ssize_t i)
{
    int64_t value;
    memcpy(&value, PyBytes_AS_STRING(self->data) + 8 * i, 8);
    return value;
}

/* A new Int64s holding `data` (exact bytes, whose reference it steals). */
static PyObject *
wrap(PyTypeObject *type, PyObject *data)
{
    if (data == NULL) {
        return NULL;
    }
    if (PyBytes_GET_SIZE(data) % 8) {
        Py_DECREF(data);
        PyErr_SetString(PyExc_ValueError, "Int64s needs a multiple of 8 bytes");
        return NULL;
    }
    Int64s *self = (Int64s *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(data);
        return NULL;
    }
    self->data = data;
    self->size = PyBytes_GET_SIZE(data) / 8;
    return (PyObject *)self;
}

/* The packed bytes of `values` (new reference), as PyInt64s.__init__ makes them. */
static PyObject *
packed(PyObject *values)
{
    if (PyBytes_CheckExact(values)) {
        return Py_NewRef(values);
    }
    if (PyBytes_Check(values)) {
        return PyBytes_FromStringAndSize(PyBytes_AS_STRING(values), PyBytes_GET_SIZE(values));
    }
    if (PyObject_CheckBuffer(values)) {
        Py_buffer view;
        if (PyObject_GetBuffer(values, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            int int64 = view.itemsize == 8 && view.format != NULL
                        && (strcmp(view.format, "q") == 0 || strcmp(view.format, "@q") == 0);
            PyObject *data = int64 ? PyBytes_FromStringAndSize(view.buf, view.len) : NULL;
            PyBuffer_Release(&view);
            if (int64) {
                return data;
            }
        }
        else {
            PyErr_Clear(); /* not a contiguous buffer: taken value by value below */
        }
    }
    PyObject *array = PyObject_CallFunction(array_type, "sO", "q", values);
    if (array == NULL) {
        return NULL;
    }
    PyObject *data = PyObject_CallMethod(array, "tobytes", NULL);
    Py_DECREF(array);
    return data;
}

static PyObject *
int64s_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"values", NULL};
    PyObject *values = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:Int64s", names, &values)) {
        return NULL;
    }
    if (values == NULL) {
        return wrap(type, PyBytes_FromStringAndSize(NULL, 0));
    }
    return wrap(type, packed(values));
}

static void
int64s_dealloc(Int64s *self)
{
    Py_XDECREF(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
int64s_length(Int64s *self)
{
    return self->size;
}

static PyObject *
int64s_item(Int64s *self, Py_ssize_t i)
{
    if (i < 0 || i >= self->size) {
        PyErr_SetString(PyExc_IndexError, "Int64s index out of range");
        return NULL;
    }
    return PyLong_FromLongLong(value_at(self, i));
}

static PyObject *
int64s_subscript(Int64s *self, PyObject *key)
{
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (i < 0) {
            i += self->size;
        }
        return int64s_item(self, i);
    }
    if (!PySlice_Check(key)) {
        PyErr_Format(PyExc_TypeError, "Int64s indices must be integers or slices, not %.200s",
                     Py_TYPE(key)->tp_name);
        return NULL;
    }
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(key, &start, &stop, &step) < 0) {
        return NULL;
    }
    Py_ssize_t n = PySlice_AdjustIndices(self->size, &start, &stop, step);
    const char *from = PyBytes_AS_STRING(self->data);
    if (step == 1) {
        return wrap(&Int64sType, PyBytes_FromStringAndSize(from + 8 * start, 8 * n));
    }
    PyObject *data = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (data == NULL) {
        return NULL;
    }
    char *to = PyBytes_AS_STRING(data);
    for (Py_ssize_t k = 0, i = start; k < n; k++, i += step) {
        memcpy(to + 8 * k, from + 8 * i, 8);
    }
    return wrap(&Int64sType, data);
}

static PyObject *
int64s_tolist(Int64s *self, PyObject *unused)
{
    (void)unused;
    PyObject *list = PyList_New(self->size);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->size; i++) {
        PyObject *value = PyLong_FromLongLong(value_at(self, i));
        if (value == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, value);
    }
    return list;
}

/* The index of the first value equal to `value` from `start` (Sequence.index's comparison:
 * identity or ==), -1 with no error when there is none, -2 on an error. */
static Py_ssize_t
find(Int64s *self, PyObject *value, Py_ssize_t start, Py_ssize_t stop)
{
    for (Py_ssize_t i = start; i < stop && i < self->size; i++) {
        PyObject *item = PyLong_FromLongLong(value_at(self, i));
        if (item == NULL) {
            return -2;
        }
        int equal = PyObject_RichCompareBool(item, value, Py_EQ);
        Py_DECREF(item);
        if (equal < 0) {
            return -2;
        }
        if (equal) {
            return i;
        }
    }
    return -1;
}

static PyObject *
int64s_count(Int64s *self, PyObject *value)
{
    Py_ssize_t count = 0;
    for (Py_ssize_t at = find(self, value, 0, self->size); at != -1;
         at = find(self, value, at + 1, self->size)) {
        if (at == -2) {
            return NULL;
        }
        count++;
    }
    return PyLong_FromSsize_t(count);
}

static PyObject *
int64s_index(Int64s *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t start = 0, stop = PY_SSIZE_T_MAX;
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "index() takes (value, start=0, stop=len)");
        return NULL;
    }
    /* None: the default; an int beyond Py_ssize_t is clamped, as slice bounds are. */
    if (nargs > 1 && args[1] != Py_None
        && ((start = PyNumber_AsSsize_t(args[1], NULL)) == -1 && PyErr_Occurred())) {
        return NULL;
    }
    if (nargs > 2 && args[2] != Py_None
        && ((stop = PyNumber_AsSsize_t(args[2], NULL)) == -1 && PyErr_Occurred())) {
        return NULL;
    }
    /* Negative bounds count from the end, as Sequence.index has them. */
    if (start < 0) {
        start = start + self->size < 0 ? 0 : start + self->size;
    }
    if (stop < 0) {
        stop += self->size;
    }
    Py_ssize_t at = find(self, args[0], start, stop);
    if (at == -2) {
        return NULL;
    }
    if (at == -1) {
        PyErr_SetString(PyExc_ValueError, "value not in Int64s");
        return NULL;
    }
    return PyLong_FromSsize_t(at);
}

static PyObject *
int64s_richcompare(Int64s *self, PyObject *other, int op)
{
    if (op != Py_EQ && op != Py_NE) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (PyObject_TypeCheck(other, &Int64sType)) {
        return PyObject_RichCompare(self->data, ((Int64s *)other)->data, op);
    }
    if (!PyTuple_Check(other) && !PyList_Check(other)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *mine = int64s_tolist(self, NULL);
    if (mine == NULL) {
        return NULL;
    }
    PyObject *theirs = PySequence_List(other);
    if (theirs == NULL) {
        Py_DECREF(mine);
        return NULL;
    }
    PyObject *answer = PyObject_RichCompare(mine, theirs, op);
    Py_DECREF(mine);
    Py_DECREF(theirs);
    return answer;
}

static Py_hash_t
int64s_hash(Int64s *self)
{
    return PyObject_Hash(self->data);
}

static PyObject *
int64s_repr(Int64s *self)
{
    PyObject *list = int64s_tolist(self, NULL);
    if (list == NULL) {
        return NULL;
    }
    PyObject *text = PyUnicode_FromFormat("Int64s(%R)", list);
    Py_DECREF(list);
    return text;
}

static PyObject *
int64s_iter(Int64s *self)
{
    return PySeqIter_New((PyObject *)self);
}

static PyObject *
int64s_reduce(Int64s *self, PyObject *unused)
{
    (void)unused;
    return Py_BuildValue("(O(O))", (PyObject *)Py_TYPE(self), self->data);
}

static PyObject *
int64s_get_data(Int64s *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->data);
}

static PySequenceMethods int64s_as_sequence = {
    .sq_length = (lenfunc)int64s_length,
    .sq_item = (ssizeargfunc)int64s_item,
};

static PyMappingMethods int64s_as_mapping = {
    .mp_length = (lenfunc)int64s_length,
    .mp_subscript = (binaryfunc)int64s_subscript,
};

static PyMethodDef int64s_methods[] = {
    {"tolist", (PyCFunction)int64s_tolist, METH_NOARGS, "The values as a list of ints."},
    {"count", (PyCFunction)int64s_count, METH_O, "count(value): values equal to it."},
    {"index", (PyCFunction)(void (*)(void))int64s_index, METH_FASTCALL,
     "index(value, start=0, stop=len): the first index of a value equal to it."},
    {"__reduce__", (PyCFunction)int64s_reduce, METH_NOARGS, "Pickled by its packed bytes."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef int64s_getset[] = {
    {"data", (getter)int64s_get_data, NULL, "The packed values (native byte order).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject Int64sType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar._recordtypes.Int64s",
    .tp_basicsize = sizeof(Int64s),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_SEQUENCE,
    .tp_doc = "An immutable sequence of 64-bit ints, stored packed (see record.PyInt64s).",
    .tp_new = int64s_new,
    .tp_dealloc = (destructor)int64s_dealloc,
    .tp_repr = (reprfunc)int64s_repr,
    .tp_hash = (hashfunc)int64s_hash,
    .tp_richcompare = (richcmpfunc)int64s_richcompare,
    .tp_iter = (getiterfunc)int64s_iter,
    .tp_as_sequence = &int64s_as_sequence,
    .tp_as_mapping = &int64s_as_mapping,
    .tp_methods = int64s_methods,
    .tp_getset = int64s_getset,
};

/* from_bytes(data) -> Int64s: `data` (exact bytes) as it is, without the constructor's
 * argument parsing (the record's wire decoder makes three per record). */
static PyObject *
from_bytes(PyObject *module, PyObject *arg)
{
    (void)module;
    if (!PyBytes_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "from_bytes() takes bytes");
        return NULL;
    }
    return wrap(&Int64sType, Py_NewRef(arg));
}

/* SlotsConstructor(cls, names, defaults, factories, missing[, columns, optional_columns]):
 * calling it builds a `cls` (a dataclass with slots) as the dataclass's own __init__ would,
 * then runs its __post_init__:
 * the same arguments (positional in field order, or by name), the same defaults and default
 * factories, the same TypeError for an argument missing, unknown or given twice. What it
 * skips is the generated __init__'s one `object.__setattr__` call per field, which made
 * building a RequestRecord and its two Timelines ~190 bytecodes of every request in the
 * worker and as many in the collector; here each field is stored in its slot directly.
 * record.slots_constructor gives the arguments from dataclasses.fields(cls).
 *
 * `columns` (field names) are packed columns whose __post_init__ only packs what is not an
 * Int64s yet and refuses columns of different lengths (Timeline's); `optional_columns` may
 * also be None. When every one already is an exact Int64s (or None, where allowed) and they
 * agree in length, that __post_init__ would change nothing and is not called: a Timeline
 * built by the proxy's RecordBuilder or the collector's decoder runs no Python (two per
 * record, ~33 bytecodes each, on each side). Otherwise it is called, and packs or raises. */

#define MAX_FIELDS 64

typedef struct {
    PyObject_HEAD vectorcallfunc vectorcall;
    PyTypeObject *cls;
    PyObject *names;     /* tuple of interned str, in field order */
    PyObject *defaults;  /* tuple: the default, or `missing` */
    PyObject *factories; /* tuple: the default factory, or None */
    PyObject *missing;   /* dataclasses.MISSING */
    PyObject *post_init; /* cls.__post_init__, or NULL */
    Py_ssize_t n;
    Py_ssize_t offsets[MAX_FIELDS];
    Py_ssize_t n_columns;
    Py_ssize_t columns[MAX_FIELDS];   /* field indices of the packed columns */
    char column_optional[MAX_FIELDS]; /* 1: that column may be None */
} SlotsConstructor;

/* 1 when every packed column of `made` is an exact Int64s (or an allowed None) and they
 * all have the same length: __post_init__ would leave the object as it is. */
static int
columns_are_packed(SlotsConstructor *self, PyObject *made)
{
    Py_ssize_t length = -1;
    for (Py_ssize_t c = 0; c < self->n_columns; c++) {
        PyObject *value = *(PyObject **)((char *)made + self->offsets[self->columns[c]]);
        if (value == Py_None && self->column_optional[c]) {
            continue;
        }
        if (!Py_IS_TYPE(value, &Int64sType)) {
            return 0;
        }
        Py_ssize_t size = ((Int64s *)value)->size;
        if (length >= 0 && size != length) {
            return 0;
        }
        length = size;
    }
    return 1;
}

static PyObject *
constructor_vectorcall(SlotsConstructor *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), n = self->n;
    const char *name = self->cls->tp_name;
    PyObject *values[MAX_FIELDS] = {NULL}; /* borrowed */
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd positional arguments", name, n);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        values[i] = args[i];
    }
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t at = -1;
        /* Call sites name the fields in their order, interned: the guess is the usual hit. */
        Py_ssize_t guess = nargs + k;
        if (guess < n && PyTuple_GET_ITEM(self->names, guess) == key) {
            at = guess;
        }
        for (Py_ssize_t j = 0; at < 0 && j < n; j++) {
            if (PyTuple_GET_ITEM(self->names, j) == key) {
                at = j;
            }
        }
        for (Py_ssize_t j = 0; at < 0 && j < n; j++) {
            int equal = PyObject_RichCompareBool(PyTuple_GET_ITEM(self->names, j), key, Py_EQ);
            if (equal < 0) {
                return NULL;
            }
            if (equal) {
                at = j;
            }
        }
        if (at < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%S'", name,
                         key);
            return NULL;
        }
        if (values[at] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%S'", name,
                         key);
            return NULL;
        }
        values[at] = args[nargs + k];
    }
    PyObject *made = self->cls->tp_alloc(self->cls, 0);
    if (made == NULL) {
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *value = values[j];
        if (value != NULL) {
            Py_INCREF(value);
        }
        else if (PyTuple_GET_ITEM(self->factories, j) != Py_None) {
            value = PyObject_CallNoArgs(PyTuple_GET_ITEM(self->factories, j));
            if (value == NULL) {
                Py_DECREF(made);
                return NULL;
            }
        }
        else if (PyTuple_GET_ITEM(self->defaults, j) != self->missing) {
            value = Py_NewRef(PyTuple_GET_ITEM(self->defaults, j));
        }
        else {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument: '%S'", name,
                         PyTuple_GET_ITEM(self->names, j));
            Py_DECREF(made); /* the slots set so far are released with it */
            return NULL;
        }
        *(PyObject **)((char *)made + self->offsets[j]) = value;
    }
    if (self->post_init != NULL && !(self->n_columns > 0 && columns_are_packed(self, made))) {
        PyObject *done = PyObject_CallOneArg(self->post_init, made);
        if (done == NULL) {
            Py_DECREF(made);
            return NULL;
        }
        Py_DECREF(done);
    }
    return made;
}

static void
constructor_dealloc(SlotsConstructor *self)
{
    Py_XDECREF(self->cls);
    Py_XDECREF(self->names);
    Py_XDECREF(self->defaults);
    Py_XDECREF(self->factories);
    Py_XDECREF(self->missing);
    Py_XDECREF(self->post_init);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
constructor_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *cls, *names, *defaults, *factories, *missing;
    PyObject *columns = NULL, *optional_columns = NULL;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "SlotsConstructor() takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O!O!O!O|O!O!:SlotsConstructor", &PyType_Type, &cls,
                          &PyTuple_Type, &names, &PyTuple_Type, &defaults, &PyTuple_Type,
                          &factories, &missing, &PyTuple_Type, &columns, &PyTuple_Type,
                          &optional_columns)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (n > MAX_FIELDS || PyTuple_GET_SIZE(defaults) != n || PyTuple_GET_SIZE(factories) != n) {
        PyErr_SetString(PyExc_ValueError,
                        "SlotsConstructor() takes one name, default and factory per field "
                        "(at most 64 fields)");
        return NULL;
    }
    SlotsConstructor *self = (SlotsConstructor *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = (vectorcallfunc)constructor_vectorcall;
    self->cls = (PyTypeObject *)Py_NewRef(cls);
    self->defaults = Py_NewRef(defaults);
    self->factories = Py_NewRef(factories);
    self->missing = Py_NewRef(missing);
    self->n = n;
    self->names = PyTuple_New(n);
    if (self->names == NULL) {
        goto fail;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *field = PyTuple_GET_ITEM(names, j);
        if (!PyUnicode_CheckExact(field)) {
            PyErr_SetString(PyExc_TypeError, "SlotsConstructor() field names must be str");
            goto fail;
        }
        Py_INCREF(field);
        PyUnicode_InternInPlace(&field);
        PyTuple_SET_ITEM(self->names, j, field);
        /* The slot's member descriptor, in the class's own namespace: an object slot. */
        PyObject *descriptor = PyDict_GetItemWithError(((PyTypeObject *)cls)->tp_dict, field);
        if (descriptor == NULL || !Py_IS_TYPE(descriptor, &PyMemberDescr_Type)
            || ((PyMemberDescrObject *)descriptor)->d_member->type != T_OBJECT_EX) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "%s.%S is not a slot of the class's own",
                             ((PyTypeObject *)cls)->tp_name, field);
            }
            goto fail;
        }
        self->offsets[j] = ((PyMemberDescrObject *)descriptor)->d_member->offset;
    }
    for (int optional = 0; optional < 2; optional++) {
        PyObject *named = optional ? optional_columns : columns;
        Py_ssize_t count = named == NULL ? 0 : PyTuple_GET_SIZE(named);
        for (Py_ssize_t c = 0; c < count; c++) {
            PyObject *column = PyTuple_GET_ITEM(named, c);
            Py_ssize_t at = -1;
            for (Py_ssize_t j = 0; j < n && at < 0; j++) {
                int equal = PyObject_RichCompareBool(PyTuple_GET_ITEM(self->names, j), column,
                                                     Py_EQ);
                if (equal < 0) {
                    goto fail;
                }
                if (equal) {
                    at = j;
                }
            }
            if (at < 0) {
                PyErr_Format(PyExc_ValueError, "SlotsConstructor() column %R is not a field",
                             column);
                goto fail;
            }
            for (Py_ssize_t d = 0; d < self->n_columns; d++) {
                if (self->columns[d] == at) {
                    PyErr_Format(PyExc_ValueError, "SlotsConstructor() names column %R twice",
                                 column);
                    goto fail;
                }
            }
            self->columns[self->n_columns] = at;
            self->column_optional[self->n_columns] = (char)optional;
            self->n_columns++;
        }
    }
    self->post_init = PyObject_GetAttrString(cls, "__post_init__");
    if (self->post_init == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            goto fail;
        }
        PyErr_Clear();
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static PyTypeObject SlotsConstructorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sidecar._recordtypes.SlotsConstructor",
    .tp_basicsize = sizeof(SlotsConstructor),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Builds a slots dataclass as its __init__ would (see _recordtypes.c).",
    .tp_new = constructor_new,
    .tp_dealloc = (destructor)constructor_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(SlotsConstructor, vectorcall),
};

/* untrack(obj): leave obj out of the cycle collector's scans (PyObject_GC_UnTrack). Nothing is
 * checked here: the caller vouches that obj can be in no reference cycle, now or later
 * (record.untrack_finished does, for a finished record and its parts). */
static PyObject *
untrack(PyObject *module, PyObject *obj)
{
    (void)module;
    if (PyObject_IS_GC(obj)) {
        PyObject_GC_UnTrack(obj);
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"from_bytes", from_bytes, METH_O, "from_bytes(data) -> Int64s of these packed bytes."},
    {"untrack", untrack, METH_O,
     "untrack(obj): out of the cycle collector's reach; the caller vouches it is in no cycle."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "sidecar._recordtypes",
    "The record's types where C pays (see _recordtypes.c).",
    0,
    module_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__recordtypes(void)
{
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) {
        return NULL;
    }
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (array_type == NULL || PyType_Ready(&Int64sType) < 0
        || PyType_Ready(&SlotsConstructorType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Int64s", (PyObject *)&Int64sType) < 0
        || PyModule_AddObjectRef(module, "SlotsConstructor", (PyObject *)&SlotsConstructorType)
               < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
