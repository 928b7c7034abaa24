/* holdings._Holding in C: a list that keeps ``total``, the sum (mod 2**62) of holding_term over its
 * entries, updated by the entries each change adds or drops. The same methods, terms and results as
 * the reference; a running request extends its holdings a few times a step, and each change here
 * is one C call instead of a Python method with a super() call in it.
 *
 * Entries are ints: node ids (a lease's pins) or pages. Nothing here calls Python code or reads an
 * attribute by name.
 *
 * Invariant: total == recount() whenever it is read; a method that fails (an entry that is not an
 * int) changes nothing. An entry the methods add is checked at once and its term summed when the
 * total is read or an entry goes (``settle``; Holding in _node.h says which entries ``total`` covers).
 * holdings.py adds the refusals of list's other mutators, as it does for the reference. */
#include "_node.h"

#include <stdlib.h>
#include <string.h>
#include <structmember.h>

#define MASK ((UINT64_C(1) << 62) - 1)

/* The sum of the terms of ``seq``'s items (a list or tuple): 0, or -1 and an exception. */
static int sum_terms(Holding *self, PyObject *seq, uint64_t *out) {
    uint64_t total = 0, term;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (holding_term(self->lease_id, self->kind, items[i], &term) < 0)
            return -1;
        total += term;
    }
    *out = total;
    return 0;
}

/* Whether ``item`` can be an entry (what holding_term takes): 0, or -1 and its exception. */
static int check_entry(PyObject *item) {
    int64_t key;
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "a holding's entry is a node id or a page (an int), not %.100s",
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    return field(item, &key);
}

/* The terms of the entries added since the last settle into ``total``: 0, or -1 and an exception
 * (none: every entry was checked when it was added). */
static int settle(Holding *self) {
    Py_ssize_t end = self->added < PyList_GET_SIZE(self) ? self->added : PyList_GET_SIZE(self);
    if (self->hashed >= end)
        return 0;
    uint64_t total = self->total, term;
    PyObject **items = ((PyListObject *)self)->ob_item;
    for (Py_ssize_t i = self->hashed; i < end; i++) {
        if (holding_term(self->lease_id, self->kind, items[i], &term) < 0)
            return -1;
        total += term;
    }
    self->total = total & MASK;
    self->hashed = self->added = end;
    return 0;
}

/* After a change that settled first and then adjusted ``total`` for the entries it dropped. */
static void settled(Holding *self) { self->hashed = self->added = PyList_GET_SIZE(self); }

PyObject *holding_extend(Holding *self, PyObject *items) {
    PyObject *seq = PySequence_Fast(items, "a holding extends with an iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t end = PyList_GET_SIZE(self), count = PySequence_Fast_GET_SIZE(seq);
    int bad = 0;
    for (Py_ssize_t i = 0; !bad && i < count; i++)
        bad = check_entry(PySequence_Fast_GET_ITEM(seq, i)) < 0;
    bad = bad || PyList_SetSlice((PyObject *)self, end, end, seq) < 0;
    Py_DECREF(seq);
    if (bad)
        return NULL;
    self->added += count;
    Py_RETURN_NONE;
}

int holding_clear(Holding *self) {
    if (PyList_SetSlice((PyObject *)self, 0, PyList_GET_SIZE(self), NULL) < 0)
        return -1;
    self->total = 0;
    self->hashed = self->added = 0;
    return 0;
}

static int holding_init(Holding *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"lease_id", "kind", "items", NULL};
    long long lease_id, kind;
    PyObject *items = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LL|O:Holding", names, &lease_id, &kind, &items))
        return -1;
    if (holding_clear(self) < 0)
        return -1;
    self->lease_id = lease_id;
    self->kind = kind;
    if (items != NULL) {
        PyObject *done = holding_extend(self, items);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return 0;
}

static PyObject *holding_append(Holding *self, PyObject *item) {
    if (check_entry(item) < 0 || PyList_Append((PyObject *)self, item) < 0)
        return NULL;
    self->added++;
    Py_RETURN_NONE;
}

static PyObject *holding_empty(Holding *self, PyObject *unused) {
    return holding_clear(self) < 0 ? NULL : Py_NewRef(Py_None);
}

/* An int entry's value: 1 with ``*out`` set, 0 for an int past int64 (equal to no page or id the
 * kernels hold), -1 and an exception for anything that is not an int. */
static int int_value(PyObject *item, int64_t *out) {
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "a holding's entry is a node id or a page (an int), not %.100s",
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return !overflow;
}

static PyObject *holding_remove(Holding *self, PyObject *item) {
    int64_t want, have;
    int fits = int_value(item, &want);
    if (fits < 0 || settle(self) < 0)
        return NULL;
    for (Py_ssize_t i = 0; fits && i < PyList_GET_SIZE(self); i++) {
        PyObject *entry = PyList_GET_ITEM(self, i); /* an int: nothing below runs Python code */
        uint64_t term;
        if (int_value(entry, &have) <= 0 || have != want)
            continue;
        if (holding_term(self->lease_id, self->kind, entry, &term) < 0 ||
            PyList_SetSlice((PyObject *)self, i, i + 1, NULL) < 0)
            return NULL;
        self->total = (self->total - term) & MASK;
        settled(self);
        Py_RETURN_NONE;
    }
    PyErr_Clear();
    return PyErr_Format(PyExc_ValueError, "list.remove(x): x not in list");
}

/* Replace the whole list by ``kept``, dropping the terms of ``gone``. */
static PyObject *keep_only(Holding *self, PyObject *kept, PyObject *gone) {
    uint64_t terms;
    if (PyList_GET_SIZE(gone) == 0)
        Py_RETURN_NONE;
    if (settle(self) < 0 || sum_terms(self, gone, &terms) < 0 ||
        PyList_SetSlice((PyObject *)self, 0, PyList_GET_SIZE(self), kept) < 0)
        return NULL;
    self->total = (self->total - terms) & MASK;
    settled(self);
    Py_RETURN_NONE;
}

/* discard(items): drop every entry equal to one of ``items`` (ints: node ids or pages), keeping the
 * others in order. */
static PyObject *holding_discard(Holding *self, PyObject *items) {
    PyObject *seq = PySequence_Fast(items, "a holding discards an iterable of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), used = 0;
    int64_t local[64], *drop = count <= 64 ? local : PyMem_Malloc((size_t)count * sizeof(int64_t));
    int rc = drop == NULL ? -1 : 0;
    if (drop == NULL)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; rc == 0 && i < count; i++) {
        int fits = int_value(PySequence_Fast_GET_ITEM(seq, i), &drop[used]);
        if (fits < 0)
            rc = -1;
        used += fits > 0; /* an int past int64 is no entry's value */
    }
    if (rc == 0)
        rc = holding_drop_ints(self, drop, used);
    if (drop != local)
        PyMem_Free(drop);
    Py_DECREF(seq);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int compare_int64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Whether ``v`` is one of the ``count`` values at ``drop`` (sorted ascending when ``sorted``). */
static int among(const int64_t *drop, Py_ssize_t count, int sorted, int64_t v) {
    if (sorted)
        return bsearch(&v, drop, (size_t)count, sizeof *drop, compare_int64) != NULL;
    for (Py_ssize_t k = 0; k < count; k++)
        if (drop[k] == v)
            return 1;
    return 0;
}

int holding_drop_ints(Holding *self, const int64_t *drop, Py_ssize_t count) {
    PyObject *kept = PyList_New(0), *gone = PyList_New(0), *done = NULL;
    int64_t *order = NULL; /* a sorted copy when there are many to look up */
    if (count > 16 && (order = PyMem_Malloc((size_t)count * sizeof *order)) != NULL) {
        memcpy(order, drop, (size_t)count * sizeof *order);
        qsort(order, (size_t)count, sizeof *order, compare_int64);
        drop = order;
    } else if (count > 16) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; kept != NULL && gone != NULL && i < PyList_GET_SIZE(self); i++) {
        PyObject *item = PyList_GET_ITEM(self, i);
        int overflow = 0;
        long long v = PyLong_Check(item) ? PyLong_AsLongLongAndOverflow(item, &overflow) : 0;
        if (v == -1 && PyErr_Occurred())
            goto out;
        int in = PyLong_Check(item) && !overflow && among(drop, count, order != NULL, v); /* (past int64: none) */
        if (PyList_Append(in ? gone : kept, item) < 0)
            goto out;
    }
    if (kept != NULL && gone != NULL)
        done = keep_only(self, kept, gone);
out:
    PyMem_Free(order);
    Py_XDECREF(kept);
    Py_XDECREF(gone);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

static PyObject *holding_truncate(Holding *self, PyObject *arg) {
    Py_ssize_t length = PyNumber_AsSsize_t(arg, PyExc_OverflowError), size = PyList_GET_SIZE(self);
    if (length == -1 && PyErr_Occurred())
        return NULL;
    if (length < 0) /* as self[length:] reads it */
        length = length + size < 0 ? 0 : length + size;
    if (length >= size)
        Py_RETURN_NONE;
    if (settle(self) < 0)
        return NULL;
    PyObject *tail = PyList_GetSlice((PyObject *)self, length, size);
    uint64_t terms;
    int bad = tail == NULL || sum_terms(self, tail, &terms) < 0 || PyList_SetSlice((PyObject *)self, length, size, NULL) < 0;
    Py_XDECREF(tail);
    if (bad)
        return NULL;
    self->total = (self->total - terms) & MASK;
    settled(self);
    Py_RETURN_NONE;
}

static PyObject *holding_recount(Holding *self, PyObject *unused) {
    uint64_t terms;
    if (sum_terms(self, (PyObject *)self, &terms) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(terms & MASK);
}

static PyMethodDef holding_methods[] = {
    {"append", (PyCFunction)holding_append, METH_O, "Add one entry."},
    {"extend", (PyCFunction)holding_extend, METH_O, "Add the entries of an iterable."},
    {"empty", (PyCFunction)holding_empty, METH_NOARGS, "Drop every entry (the sum of none is 0)."},
    {"remove", (PyCFunction)holding_remove, METH_O, "Drop the first entry equal to this one (ValueError if none)."},
    {"discard", (PyCFunction)holding_discard, METH_O, "Drop every entry equal to one of these ints, keeping the others in order."},
    {"truncate", (PyCFunction)holding_truncate, METH_O, "Drop every entry from this position on."},
    {"recount", (PyCFunction)holding_recount, METH_NOARGS, "The total computed from scratch (the invariant's check)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef holding_members[] = {
    {"lease_id", T_LONGLONG, offsetof(Holding, lease_id), READONLY, "The lease that holds these."},
    {"kind", T_LONGLONG, offsetof(Holding, kind), READONLY, "DEVICE_PINS, HOST_PINS or PAGES."},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *holding_total(Holding *self, void *unused) {
    return settle(self) < 0 ? NULL : PyLong_FromUnsignedLongLong(self->total);
}

static PyGetSetDef holding_getset[] = {
    {"total", (getter)holding_total, NULL, "The sum of the entries' terms, mod 2**62.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject HoldingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpcache.core.treecore._node.Holding",
    .tp_base = &PyList_Type,
    .tp_basicsize = sizeof(Holding),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "holdings._Holding in C: a list that keeps the sum of its entries' digest terms.",
    .tp_methods = holding_methods,
    .tp_members = holding_members,
    .tp_getset = holding_getset,
    .tp_init = (initproc)holding_init,
};
