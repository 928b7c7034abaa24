/* A plain lookup in C: CacheCore.match's counts and device pages for a tree of native nodes without
 * components, read node by node from the root with each page's tokens compared where they lie; no
 * walk, no list of the nodes found. tpcache.core.treecore.lookup falls back to match for anything else; tests
 * hold the two equal. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_node.h"

/* lookup(root, data, step, host_hits) -> (device pages, host pages, array('i') of the device pages):
 * the longest prefix of ``data``'s full pages (``step`` bytes each) whose nodes are device VALID,
 * then (with ``host_hits``) the nodes after it that are host VALID and on no device page, as
 * CacheCore.match counts them; the array holds the device prefix's pages. None when ``root`` is not a
 * native node. Pure. */
static PyObject *py_lookup(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError, "lookup takes 4 arguments, not %zd", nargs);
    PyObject *data = args[1];
    Py_ssize_t step = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    int host_hits = step == -1 && PyErr_Occurred() ? -1 : PyObject_IsTrue(args[3]);
    if (host_hits < 0)
        return NULL;
    if (!is_node(args[0]))
        Py_RETURN_NONE;
    if (!PyBytes_Check(data) || step <= 0)
        return PyErr_Format(PyExc_ValueError, "lookup takes token bytes and a page of at least one byte");
    Py_ssize_t pages = PyBytes_GET_SIZE(data) / step, dev = 0, host = 0;
    PyObject *ids = PyBytes_FromStringAndSize(NULL, pages * 4); /* int32 per page, as array('i') holds them */
    if (ids == NULL)
        return NULL;
    int32_t *out = (int32_t *)PyBytes_AS_STRING(ids);
    const char *at = PyBytes_AS_STRING(data);
    Node *node = (Node *)args[0];
    for (Py_ssize_t i = 0; i < pages; i++) {
        PyObject *child = kids_at(node, at + i * step, step);
        if (child == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        node = (Node *)child; /* children are nodes: kids_add is the only way in */
        int ds = node->device_state, hs = host_hits ? node->host_state : STATE_NONE;
        if (host == 0 && ds == STATE_VALID) { /* still in the device prefix */
            out[dev++] = node->device_page;
            continue;
        }
        if (hs != STATE_VALID || ds != STATE_NONE)
            break;
        host++;
    }
    if (_PyBytes_Resize(&ids, dev * 4) < 0)
        return NULL;
    PyObject *array = array_from_bytes("i", ids);
    Py_DECREF(ids);
    return array == NULL ? NULL : Py_BuildValue("(nnN)", dev, host, array);
fail:
    Py_DECREF(ids);
    return NULL;
}

PyMethodDef lookup_methods[] = {
    {"lookup", (PyCFunction)(void (*)(void))py_lookup, METH_FASTCALL,
     "CacheCore.match's device and host hit and device pages (tpcache.core.treecore.lookup; see _lookup.c)."},
    {NULL, NULL, 0, NULL},
};
