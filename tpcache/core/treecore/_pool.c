/* A page pool's allocation in C: allocator.reference_take, the arithmetic of PageAllocator.try_alloc
 * (freed pages LIFO, then never-used pages in order), for the allocation a running request makes
 * every step. The Python version stays as the reference; tests hold the two equal. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_node.h"

/* take_pages(free, owned, fresh, num_pages, n) -> (pages, fresh), or None, changing nothing, when fewer
 * than ``n`` pages are available: ``free`` (a list of ints) loses the pages it gives, last freed
 * first, ``owned`` (a bytearray covering the pages below ``fresh``) marks every page given, and the
 * never-used pages from ``fresh`` on make up the rest. */
static PyObject *py_take_pages(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5)
        return PyErr_Format(PyExc_TypeError, "take_pages takes 5 arguments, not %zd", nargs);
    PyObject *free_list = args[0], *owned = args[1];
    if (!PyList_CheckExact(free_list) || !PyByteArray_CheckExact(owned))
        return PyErr_Format(PyExc_TypeError, "take_pages takes a list and a bytearray");
    Py_ssize_t counts[3]; /* fresh, num_pages, n: any int or index-like value, as the reference takes them */
    for (int i = 0; i < 3; i++)
        if ((counts[i] = PyNumber_AsSsize_t(args[2 + i], PyExc_OverflowError)) == -1 && PyErr_Occurred())
            return NULL;
    Py_ssize_t fresh = counts[0], total = counts[1], n = counts[2];
    if (n < 0 || fresh < 0 || fresh > total || PyByteArray_GET_SIZE(owned) != fresh)
        return PyErr_Format(PyExc_ValueError, "take_pages: %zd pages of a pool at %zd of %zd", n, fresh, total);
    Py_ssize_t freed = PyList_GET_SIZE(free_list), new = n - freed;
    if (new > total - fresh)
        Py_RETURN_NONE;
    Py_ssize_t reuse = new > 0 ? freed : n, unused = new > 0 ? new : 0; /* never-used pages it takes */
    PyObject *pages = PyList_New(n);
    if (pages == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < reuse; i++) { /* check every reused page before changing anything */
        PyObject *p = PyList_GET_ITEM(free_list, freed - 1 - i);
        Py_ssize_t page = PyLong_Check(p) ? PyLong_AsSsize_t(p) : -1;
        if (page < 0 || page >= fresh) {
            Py_DECREF(pages);
            return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "take_pages: free page %R out of range", p);
        }
        PyList_SET_ITEM(pages, i, Py_NewRef(p));
    }
    for (Py_ssize_t i = reuse; i < n; i++) {
        PyObject *p = PyLong_FromSsize_t(fresh + i - reuse);
        if (p == NULL) {
            Py_DECREF(pages);
            return NULL;
        }
        PyList_SET_ITEM(pages, i, p);
    }
    if (unused && PyByteArray_Resize(owned, fresh + unused) < 0) {
        Py_DECREF(pages);
        return NULL;
    }
    if (PyList_SetSlice(free_list, freed - reuse, freed, NULL) < 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (unused && PyByteArray_Resize(owned, fresh) < 0) /* the marks back as they were */
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
        Py_DECREF(pages);
        return NULL;
    }
    char *mark = PyByteArray_AS_STRING(owned); /* (after the resize, which may move it) */
    for (Py_ssize_t i = 0; i < reuse; i++)
        mark[PyLong_AsSsize_t(PyList_GET_ITEM(pages, i))] = 1;
    memset(mark + fresh, 1, (size_t)unused);
    return Py_BuildValue("(Nn)", pages, fresh + unused);
}

PyMethodDef pool_methods[] = {
    {"take_pages", (PyCFunction)(void (*)(void))py_take_pages, METH_FASTCALL,
     "PageAllocator.try_alloc's pages (allocator.reference_take; see _pool.c)."},
    {NULL, NULL, 0, NULL},
};
