/* The tree's nodes by id under the native core (tree.RadixTree.nodes): a hash table keyed by the
 * int64 id, in place of a dict keyed by int objects (_node.h says the layout and what it costs).
 *
 * The kernels find, put and take nodes by their int64 id here (table_get, table_put, table_del)
 * without hashing an object or making an int; Python reads it as the mapping the reference core's
 * dict is: [id], in, len, get, keys, values, items, iteration, [id] = node, del [id]. Every listing
 * is in ascending id order, which is the reference dict's insertion order: a tree puts each node in
 * when it makes it, with the next id, and never puts an id in again. A listing sorts the ids (no
 * slot's place shows), and it is a new list (a snapshot): the table may change while it is read.
 * Nothing but a listing walks the slots; the code lists a tree's nodes when it rebuilds its heaps
 * (when their entries outnumber the nodes four to one) and in checks and full reads, never once an
 * operation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_node.h"

NodeTable *as_table(PyObject *o, const char *who) {
    if (is_table(o))
        return (NodeTable *)o;
    PyErr_Format(PyExc_TypeError, "%s takes the tree's NodeTable, not %.100s", who, o ? Py_TYPE(o)->tp_name : "NULL");
    return NULL;
}

/* The int64 value of an id ``key``: 1, 0 for an int out of int64 range (no exception: no node has
 * it), or -1 and a TypeError for what is not an int. */
static int id_of(PyObject *key, int64_t *out) {
    if (!PyLong_Check(key)) {
        PyErr_Format(PyExc_TypeError, "a node id is an int, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    if (field(key, out) == 0)
        return 1;
    PyErr_Clear(); /* an OverflowError: no such id */
    return 0;
}

Node *table_find(const NodeTable *t, PyObject *key) {
    int64_t id;
    int ok = id_of(key, &id);
    return ok > 0 ? table_get(t, id) : NULL;
}

/* Place ``node`` under ``id`` in a slot array of 2**(64 - shift) slots that has a free one and does
 * not hold ``id``. */
static void place(TableSlot *slot, Py_ssize_t mask, int shift, int64_t id, Node *node) {
    Py_ssize_t i = table_home(id, shift);
    while (slot[i].node != NULL)
        i = (i + 1) & mask;
    slot[i].id = id;
    slot[i].node = node;
}

/* Move the nodes into a new array of ``cap`` slots (a power of two, at least TABLE_MIN, more than
 * len): 0, or -1 and MemoryError (the table is unchanged then). */
static int resize(NodeTable *t, Py_ssize_t cap) {
    if ((size_t)cap > PY_SSIZE_T_MAX / sizeof(TableSlot)) {
        PyErr_NoMemory();
        return -1;
    }
    TableSlot *slot = PyMem_Calloc((size_t)cap, sizeof(TableSlot));
    if (slot == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int shift = 64;
    for (Py_ssize_t c = cap; c > 1; c >>= 1)
        shift--;
    for (Py_ssize_t i = 0; i < t->cap; i++)
        if (t->slot[i].node != NULL)
            place(slot, cap - 1, shift, t->slot[i].id, t->slot[i].node);
    PyMem_Free(t->slot);
    t->slot = slot;
    t->cap = cap;
    t->shift = shift;
    return 0;
}

/* The slots the table fits ``len`` nodes in after a resize: the fewest (a power of two, at least
 * TABLE_MIN) at a load of at most a half. */
static Py_ssize_t fit(Py_ssize_t len) {
    Py_ssize_t cap = TABLE_MIN;
    while (cap < 2 * len)
        cap *= 2;
    return cap;
}

/* The slot of ``id``, or -1 where the table does not hold it. */
static Py_ssize_t slot_of(const NodeTable *t, int64_t id) {
    if (t->len == 0)
        return -1; /* (there may be no slots at all) */
    Py_ssize_t mask = t->cap - 1, i = table_home(id, t->shift);
    while (t->slot[i].node != NULL && t->slot[i].id != id)
        i = (i + 1) & mask;
    return t->slot[i].node != NULL ? i : -1;
}

int table_put(NodeTable *t, int64_t id, Node *node) {
    Py_ssize_t i = slot_of(t, id);
    if (i >= 0) { /* replaced, as in a dict */
        Node *old = t->slot[i].node;
        t->slot[i].node = (Node *)Py_NewRef(node);
        Py_DECREF(old);
        return 0;
    }
    if (10 * (t->len + 1) > 7 * t->cap && resize(t, t->cap < TABLE_MIN ? TABLE_MIN : 2 * t->cap) < 0)
        return -1; /* (past a load of 0.7: doubled) */
    place(t->slot, t->cap - 1, t->shift, id, (Node *)Py_NewRef(node));
    t->len++;
    return 0;
}

int table_del(NodeTable *t, int64_t id) {
    Py_ssize_t mask = t->cap - 1, i = slot_of(t, id);
    if (i < 0) {
        PyObject *key = PyLong_FromLongLong(id);
        if (key != NULL)
            PyErr_SetObject(PyExc_KeyError, key);
        Py_XDECREF(key);
        return -1;
    }
    Node *old = t->slot[i].node;
    /* Backward shift: each entry after the hole up to the next free slot moves into the hole when
     * its home is not between the hole and it (cyclically), so every probe still reaches it. */
    for (Py_ssize_t j = (i + 1) & mask; t->slot[j].node != NULL; j = (j + 1) & mask) {
        Py_ssize_t home = table_home(t->slot[j].id, t->shift);
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t->slot[i] = t->slot[j];
            i = j;
        }
    }
    t->slot[i].node = NULL;
    t->len--;
    if (t->cap > TABLE_MIN && 20 * t->len < 3 * t->cap && resize(t, fit(t->len)) < 0)
        PyErr_Clear(); /* (below a load of 0.15: shrunk; kept as it is when memory is short) */
    Py_DECREF(old); /* last: a node freed here may free others, never this table's */
    return 0;
}

static void table_dealloc(NodeTable *t) {
    for (Py_ssize_t i = 0; i < t->cap; i++)
        Py_XDECREF(t->slot[i].node);
    PyMem_Free(t->slot);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0))
        return PyErr_Format(PyExc_TypeError, "NodeTable() takes no arguments");
    return type->tp_alloc(type, 0); /* zeroed: empty, no slots */
}

/* ------------------------------------------------------------------ the mapping */

static Py_ssize_t table_len(NodeTable *t) { return t->len; }

static PyObject *table_subscript(NodeTable *t, PyObject *key) {
    Node *n = table_find(t, key);
    if (n == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, key);
    return (PyObject *)Py_XNewRef(n);
}

static int table_ass_subscript(NodeTable *t, PyObject *key, PyObject *value) {
    int64_t id;
    int ok = id_of(key, &id);
    if (ok <= 0) {
        if (ok == 0)
            PyErr_Format(PyExc_OverflowError, "node id %R is out of int64 range", key);
        return -1;
    }
    if (value == NULL)
        return table_del(t, id);
    if (!is_node(value)) {
        PyErr_Format(PyExc_TypeError, "a NodeTable holds native Nodes, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    return table_put(t, id, (Node *)value);
}

static int table_contains(NodeTable *t, PyObject *key) {
    if (!PyLong_Check(key))
        return 0; /* (no node has it, as in a dict) */
    Node *n = table_find(t, key);
    return n != NULL ? 1 : PyErr_Occurred() ? -1 : 0;
}

/* Sort ``n`` slots by ascending id: a least-significant-digit radix sort of ``id - lowest``, 11 bits
 * a pass, as many passes as the span of the ids needs (two for a span under 4 million ids), with
 * ``spare`` as room for n more: the sorted slots, ``a`` or ``spare``. */
static TableSlot *sort_by_id(TableSlot *a, TableSlot *spare, Py_ssize_t n) {
    enum { BITS = 11, RADIX = 1 << BITS };
    const uint64_t sign = UINT64_C(1) << 63; /* id ^ sign: the ids' order as unsigned values */
    uint64_t lo = UINT64_MAX, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)a[i].id ^ sign;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    for (int shift = 0; n > 1 && shift < 64 && ((hi - lo) >> shift) != 0; shift += BITS) {
        Py_ssize_t at[RADIX] = {0};
        for (Py_ssize_t i = 0; i < n; i++)
            at[((((uint64_t)a[i].id ^ sign) - lo) >> shift) & (RADIX - 1)]++;
        for (Py_ssize_t d = 0, sum = 0, c; d < RADIX; d++)
            c = at[d], at[d] = sum, sum += c; /* each digit's first place */
        for (Py_ssize_t i = 0; i < n; i++) /* (in order within a digit: each pass keeps the last's) */
            spare[at[((((uint64_t)a[i].id ^ sign) - lo) >> shift) & (RADIX - 1)]++] = a[i];
        TableSlot *done = spare;
        spare = a, a = done;
    }
    return a;
}

/* A new list of the keys (0), the nodes (1) or (id, node) pairs (2), in ascending id order. */
static PyObject *listing(NodeTable *t, int what) {
    TableSlot *live = PyMem_Malloc((size_t)(2 * t->len + 1) * sizeof(TableSlot)), *sorted = live;
    PyObject *out = live != NULL ? PyList_New(t->len) : PyErr_NoMemory();
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; out != NULL && i < t->cap; i++)
        if (t->slot[i].node != NULL)
            live[n++] = t->slot[i];
    if (out != NULL)
        sorted = sort_by_id(live, live + n, n);
    for (Py_ssize_t k = 0; out != NULL && k < n; k++) {
        PyObject *node = (PyObject *)sorted[k].node, *item;
        if (what == 1)
            item = Py_NewRef(node);
        else {
            PyObject *key = PyLong_FromLongLong(sorted[k].id);
            item = what == 0 || key == NULL ? key : PyTuple_Pack(2, key, node);
            if (what == 2)
                Py_XDECREF(key);
        }
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, item); /* (making the items runs no Python code: the slots hold) */
    }
    PyMem_Free(live);
    return out;
}

static PyObject *table_iter(NodeTable *t) {
    PyObject *keys = listing(t, 0);
    PyObject *it = keys ? PyObject_GetIter(keys) : NULL;
    Py_XDECREF(keys);
    return it;
}

PyObject *table_nodes(NodeTable *t) { return listing(t, 1); }

static PyObject *table_keys(NodeTable *t, PyObject *unused) { return listing(t, 0); }
static PyObject *table_values(NodeTable *t, PyObject *unused) { return listing(t, 1); }
static PyObject *table_items(NodeTable *t, PyObject *unused) { return listing(t, 2); }

static PyObject *table_get_method(NodeTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2)
        return PyErr_Format(PyExc_TypeError, "get takes an id and an optional default, not %zd arguments", nargs);
    if (!PyLong_Check(args[0])) /* (no node has it, as in a dict) */
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    Node *n = table_find(t, args[0]);
    if (n == NULL && PyErr_Occurred())
        return NULL;
    return Py_NewRef(n != NULL ? (PyObject *)n : nargs == 2 ? args[1] : Py_None);
}

static PyObject *table_repr(NodeTable *t) {
    return PyUnicode_FromFormat("NodeTable(%zd nodes, %zd slots)", t->len, t->cap);
}

static PyObject *table_sizeof(NodeTable *t, PyObject *unused) {
    return PyLong_FromSize_t(sizeof(NodeTable) + (size_t)t->cap * sizeof(TableSlot));
}

static PyMethodDef table_methods[] = {
    {"get", (PyCFunction)(void (*)(void))table_get_method, METH_FASTCALL, "The node of an id, or the default (None)."},
    {"keys", (PyCFunction)table_keys, METH_NOARGS, "The ids, ascending (a new list)."},
    {"values", (PyCFunction)table_values, METH_NOARGS, "The nodes, by ascending id (a new list)."},
    {"items", (PyCFunction)table_items, METH_NOARGS, "(id, node) pairs, by ascending id (a new list)."},
    {"__sizeof__", (PyCFunction)table_sizeof, METH_NOARGS, "Bytes held: the table and its slots (not the nodes)."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods table_mapping = {
    .mp_length = (lenfunc)table_len,
    .mp_subscript = (binaryfunc)table_subscript,
    .mp_ass_subscript = (objobjargproc)table_ass_subscript,
};

static PySequenceMethods table_sequence = {.sq_contains = (objobjproc)table_contains};

PyTypeObject NodeTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpcache.core.treecore._node.NodeTable",
    .tp_basicsize = sizeof(NodeTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NodeTable(): native nodes by int id, a hash table keyed by the int64 id (tree.RadixTree.nodes).",
    .tp_as_mapping = &table_mapping,
    .tp_as_sequence = &table_sequence,
    .tp_iter = (getiterfunc)table_iter,
    .tp_methods = table_methods,
    .tp_repr = (reprfunc)table_repr,
    .tp_new = table_new,
    .tp_dealloc = (destructor)table_dealloc,
};
