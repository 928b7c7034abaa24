/* What the kernels take from Python once, at import (tree.py calls ``bind``): tree.Run's ``pages``
 * slot (cleared when a page's device copy goes) and the one-item arrays that new arrays are copied
 * from; nothing here calls Python code. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

#include "_node.h"

/* What ``bind`` (below) was given, once: tree.Run's ``pages`` slot, and one-item arrays of int32
 * and int64 that new arrays are made from. */
static PyTypeObject *run_type;
static Py_ssize_t run_pages_offset;
static PyObject *array_i, *array_q;

/* bind(run_pages, array_i, array_q): tree.Run.__dict__["pages"] (the member descriptor of its
 * ``pages`` slot) and array("i", [0]), array("q", [0]). tree.py binds them once at import. */
static PyObject *py_bind(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "bind takes 3 arguments, not %zd", nargs);
    PyObject *slot = args[0];
    if (!Py_IS_TYPE(slot, &PyMemberDescr_Type) || ((PyMemberDescrObject *)slot)->d_member->type != T_OBJECT_EX)
        return PyErr_Format(PyExc_TypeError, "bind: Run's pages slot is a member descriptor");
    for (int i = 1; i < 3; i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(args[i], &view, PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
            return NULL;
        int ok = view.len == view.itemsize && view.format != NULL && view.format[0] == "iq"[i - 1] &&
                 view.format[1] == 0;
        PyBuffer_Release(&view);
        if (!ok)
            return PyErr_Format(PyExc_TypeError, "bind: array('%c', [0])", "iq"[i - 1]);
    }
    Py_XSETREF(run_type, (PyTypeObject *)Py_NewRef((PyObject *)PyDescr_TYPE(slot)));
    run_pages_offset = ((PyMemberDescrObject *)slot)->d_member->offset;
    Py_XSETREF(array_i, Py_NewRef(args[1]));
    Py_XSETREF(array_q, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

int kernels_bound(void) { return run_type != NULL; }

void run_untrack(PyObject *run) {
    if (run_type != NULL && Py_IS_TYPE(run, run_type))
        PyObject_GC_UnTrack(run);
}

int run_forget_pages(PyObject *run) {
    if (run_type == NULL || !Py_IS_TYPE(run, run_type)) {
        PyErr_SetString(PyExc_TypeError, "a node's pages_run is a tree.Run (bound by tree.py)");
        return -1;
    }
    PyObject **slot = (PyObject **)((char *)run + run_pages_offset);
    Py_XSETREF(*slot, Py_NewRef(Py_None));
    return 0;
}

/* array.array(typecode, raw) for typecode "i" or "q": a new array of ``raw``'s bytes (a bytes object)
 * read as that type, made by repeating the bound one-item array and filling its buffer; NULL and an
 * exception. */
PyObject *array_from_bytes(const char *typecode, PyObject *raw) {
    PyObject *one = typecode[0] == 'i' ? array_i : array_q;
    Py_ssize_t size = typecode[0] == 'i' ? 4 : 8;
    if (one == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_node: arrays are not bound (tree.py binds them)");
        return NULL;
    }
    if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) % size != 0)
        return PyErr_Format(PyExc_ValueError, "array_from_bytes: bytes of whole %zd-byte items", size);
    PyObject *out = PySequence_Repeat(one, PyBytes_GET_SIZE(raw) / size);
    if (out == NULL)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    memcpy(view.buf, PyBytes_AS_STRING(raw), (size_t)PyBytes_GET_SIZE(raw));
    PyBuffer_Release(&view);
    return out;
}

PyMethodDef bind_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))py_bind, METH_FASTCALL,
     "tree.Run's pages slot and the arrays new arrays copy (tree.py, once)."},
    {NULL, NULL, 0, NULL},
};
