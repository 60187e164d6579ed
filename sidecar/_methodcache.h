/* A method of one type, found once and called unbound: what `obj.name(...)` does from C through
 * PyObject_VectorcallMethod (_PyObject_GetMethod: the type's method cache, then the
 * instance's dict), without the lookup on every call. The C relay calls three methods of the
 * client's transport per relayed event; these lookups, with the objects the read path made per
 * read, were ~1.5k of the ~6.5k instructions an event cost (benchmarks/RESULTS.md, "Per event
 * without objects"; request_instructions.py, 32 against 96 tokens).
 *
 * The cache holds one type at a time, and is used only when a call by name would surely find
 * the same object: the attribute is a method descriptor (a C method, a Cython one, a Python
 * function) as the type's MRO holds it (not unwrapped from a staticmethod), the instances
 * have no dict to shadow it, and the type's version tag, which CPython resets whenever the
 * type or a base changes, is the one seen at the lookup. Anything else is called by name, as
 * before. Included by more than one extension: each keeps its own
 * caches (static). The GIL guards them. */
#ifndef SIDECAR_METHODCACHE_H
#define SIDECAR_METHODCACHE_H

#include <Python.h>

typedef struct {
    PyTypeObject *type; /* strong: its address cannot be reused while cached */
    unsigned int version;
    PyObject *method; /* strong: the unbound method, called with the instance first */
} method_cache;

/* Whether ``found`` (what getattr on the type gave) is the attribute itself, as the type's
 * MRO holds it: not what a wrapper's __get__ made of it (a staticmethod's function, which a
 * call by name calls without the instance). */
static inline int
method_cache_is_own(PyTypeObject *type, PyObject *name, PyObject *found)
{
    PyObject *mro = type->tp_mro;
    if (mro == NULL || !PyTuple_Check(mro)) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyObject *dict = ((PyTypeObject *)PyTuple_GET_ITEM(mro, i))->tp_dict;
        if (dict == NULL) {
            return 0; /* cannot tell: called by name */
        }
        PyObject *entry = PyDict_GetItemWithError(dict, name); /* borrowed */
        if (entry != NULL) {
            return entry == found;
        }
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    }
    return 0;
}

/* args[0] is the instance (PY_VECTORCALL_ARGUMENTS_OFFSET is not used: args[-1] may not be
 * written); nargs counts it. A new reference, or NULL with an exception set. */
static inline PyObject *
call_method_cached(method_cache *cache, PyObject *name, PyObject *const *args, size_t nargs)
{
    PyTypeObject *type = Py_TYPE(args[0]);
    /* A cached version is never 0, the tag of a type changed since its last lookup. */
    if (cache->type != type || cache->version != type->tp_version_tag) {
        Py_CLEAR(cache->method);
        Py_CLEAR(cache->type);
        if (type->tp_dictoffset == 0) {
            /* The lookup a call by name makes first; it also gives the type a version tag. */
            PyObject *found = PyObject_GetAttr((PyObject *)type, name);
            if (found == NULL) {
                PyErr_Clear(); /* the call by name below raises what it should */
            }
            else if ((Py_TYPE(found)->tp_flags & Py_TPFLAGS_METHOD_DESCRIPTOR)
                     && method_cache_is_own(type, name, found) && type->tp_version_tag != 0) {
                cache->type = (PyTypeObject *)Py_NewRef((PyObject *)type);
                cache->version = type->tp_version_tag;
                cache->method = found;
                found = NULL;
            }
            Py_XDECREF(found);
        }
        if (cache->method == NULL) {
            return PyObject_VectorcallMethod(name, (PyObject **)args, nargs, NULL);
        }
    }
    return PyObject_Vectorcall(cache->method, args, nargs, NULL);
}

#endif
