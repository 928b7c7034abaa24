/* The eviction candidates' heaps: lists of ints laid out as heapq lays them (the same sifts, so a
 * pop from Python's heapq and one from here agree), and the ``Heaps`` object that holds a tree's two
 * heaps, its nodes and its policy's key kind for the kernels of _candidates.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>

#include "_node.h"

/* ``a < b`` for two heap entries: 1, 0, or -1 and an exception. */
static inline int less(PyObject *a, PyObject *b) {
    Py_INCREF(a);
    Py_INCREF(b);
    int lt = PyObject_RichCompareBool(a, b, Py_LT);
    Py_DECREF(a);
    Py_DECREF(b);
    return lt;
}

/* Move the entry at ``pos`` up towards ``top`` past every parent it is less than (heapq's
 * _siftdown): 0, or -1 and an exception. */
static int sift_toward_top(PyObject *heap, Py_ssize_t top, Py_ssize_t pos) {
    Py_ssize_t size = PyList_GET_SIZE(heap);
    while (pos > top) {
        Py_ssize_t up = (pos - 1) >> 1;
        int lt = less(PyList_GET_ITEM(heap, pos), PyList_GET_ITEM(heap, up));
        if (lt < 0)
            return -1;
        if (PyList_GET_SIZE(heap) != size) {
            PyErr_SetString(PyExc_RuntimeError, "a heap changed size during a sift");
            return -1;
        }
        if (!lt)
            break;
        PyObject **items = ((PyListObject *)heap)->ob_item, *moved = items[pos];
        items[pos] = items[up];
        items[up] = moved;
        pos = up;
    }
    return 0;
}

/* Move the entry at ``pos`` down to a leaf along its lesser children (the right one only when it is
 * strictly less), then back up to where it belongs (heapq's _siftup): 0, or -1 and an exception. */
static int sift_to_leaf(PyObject *heap, Py_ssize_t pos) {
    Py_ssize_t size = PyList_GET_SIZE(heap), start = pos, leaves = size >> 1;
    while (pos < leaves) {
        Py_ssize_t child = 2 * pos + 1;
        if (child + 1 < size) {
            int lt = less(PyList_GET_ITEM(heap, child), PyList_GET_ITEM(heap, child + 1));
            if (lt < 0)
                return -1;
            if (PyList_GET_SIZE(heap) != size) {
                PyErr_SetString(PyExc_RuntimeError, "a heap changed size during a sift");
                return -1;
            }
            child += !lt;
        }
        PyObject **items = ((PyListObject *)heap)->ob_item, *moved = items[pos];
        items[pos] = items[child];
        items[child] = moved;
        pos = child;
    }
    return sift_toward_top(heap, start, pos);
}

/* heapq.heappush(heap, entry), stealing ``entry``: 0, or -1 and an exception. */
int heap_push(PyObject *heap, PyObject *entry) {
    int rc = PyList_Append(heap, entry);
    Py_DECREF(entry);
    return rc < 0 ? -1 : sift_toward_top(heap, 0, PyList_GET_SIZE(heap) - 1);
}

/* heapq.heappop(heap) of a non-empty heap: the least entry (a new reference), or NULL and an exception. */
PyObject *heap_pop(PyObject *heap) {
    Py_ssize_t last = PyList_GET_SIZE(heap) - 1;
    PyObject *tail = Py_NewRef(PyList_GET_ITEM(heap, last));
    if (PyList_SetSlice(heap, last, last + 1, NULL) < 0) {
        Py_DECREF(tail);
        return NULL;
    }
    if (last == 0)
        return tail;
    PyObject *least = PyList_GET_ITEM(heap, 0); /* the list's reference, now the caller's */
    PyList_SET_ITEM(heap, 0, tail);
    if (sift_to_leaf(heap, 0) < 0) {
        Py_DECREF(least);
        return NULL;
    }
    return least;
}

/* heapq.heapify(heap): 0, or -1 and an exception. */
int heap_order(PyObject *heap) {
    for (Py_ssize_t i = (PyList_GET_SIZE(heap) >> 1) - 1; i >= 0; i--)
        if (sift_to_leaf(heap, i) < 0)
            return -1;
    return 0;
}

/* ------------------------------------------------------------------ the Heaps object */

static PyObject *heaps_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *nodes;
    long kind;
    static char *names[] = {"nodes", "kind", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!l:Heaps", names, &NodeTableType, &nodes, &kind))
        return NULL;
    if (kind < 0 || kind > 2)
        return PyErr_Format(PyExc_ValueError, "Heaps: key kind %ld; 0 (lru), 1 (lfu) or 2 (fifo)", kind);
    Heaps *h = (Heaps *)type->tp_alloc(type, 0);
    if (h == NULL)
        return NULL;
    h->nodes = (NodeTable *)Py_NewRef(nodes);
    h->kind = kind;
    h->dev = PyList_New(0);
    h->host = PyList_New(0);
    if (h->dev == NULL || h->host == NULL) {
        Py_DECREF(h);
        return NULL;
    }
    /* The heaps hold ints only (their entries), which can be in no reference cycle: the collector
     * need not walk them. Tracked, a full collection would visit each entry, stale ones included
     * (up to four per node before a rebuild): tens of milliseconds at a few hundred thousand. */
    PyObject_GC_UnTrack(h->dev);
    PyObject_GC_UnTrack(h->host);
    return (PyObject *)h;
}

static void heaps_dealloc(Heaps *h) {
    Py_XDECREF(h->dev);
    Py_XDECREF(h->host);
    Py_XDECREF(h->nodes);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMemberDef heaps_members[] = {
    {"device", T_OBJECT_EX, offsetof(Heaps, dev), READONLY, "The device heap (a list, changed in place)."},
    {"host", T_OBJECT_EX, offsetof(Heaps, host), READONLY, "The host heap (a list, changed in place)."},
    {"nodes", T_OBJECT_EX, offsetof(Heaps, nodes), READONLY, "The tree's nodes by id (its NodeTable)."},
    {"kind", T_LONG, offsetof(Heaps, kind), READONLY, "The policy's key kind: 0 LRU, 1 LFU, 2 FIFO."},
    {NULL},
};

PyTypeObject HeapsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpcache.core.treecore._node.Heaps",
    .tp_basicsize = sizeof(Heaps),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Heaps(nodes, kind): the device and host candidate heaps of one tree (candidates.Candidates).",
    .tp_members = heaps_members,
    .tp_new = heaps_new,
    .tp_dealloc = (destructor)heaps_dealloc,
};

Heaps *as_heaps(PyObject *o) {
    if (o != NULL && Py_IS_TYPE(o, &HeapsType))
        return (Heaps *)o;
    PyErr_Format(PyExc_TypeError, "eviction candidates: a native Heaps, not %.100s", o ? Py_TYPE(o)->tp_name : "NULL");
    return NULL;
}

