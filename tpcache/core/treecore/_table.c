/* The tree's nodes by id under the native core (tree.RadixTree.nodes): a directory of fixed chunks
 * that ids index, in place of a dict keyed by int objects (_node.h says the layout and what it costs).
 *
 * The kernels find, put and take nodes by their int64 id here (table_get, table_put, table_del)
 * without hashing or making an int; Python reads it as the mapping the reference core's dict is:
 * [id], in, len, get, keys, values, items, iteration, [id] = node, del [id]. Every listing is in
 * ascending id order, which is the reference dict's insertion order: a tree puts each node in when
 * it makes it, with the next id, and never puts an id in again. A listing is a new list (a snapshot):
 * the table may change while it is read.
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

/* Move the directory's live part to its start and fit its allocation to ``room`` entries (at least
 * the live part): 0, or -1 and MemoryError (the table is unchanged then). */
static int dir_fit(NodeTable *t, Py_ssize_t room) {
    Py_ssize_t n = t->end - t->head;
    if (t->head > 0) {
        memmove(t->dir, t->dir + t->head, (size_t)n * sizeof(Chunk *));
        memset(t->dir + n, 0, (size_t)t->head * sizeof(Chunk *));
        t->first += t->head;
        t->head = 0;
        t->end = n;
    }
    if (room == t->room)
        return 0;
    Chunk **grown = PyMem_Realloc(t->dir, (size_t)room * sizeof(Chunk *));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (room > t->room)
        memset(grown + t->room, 0, (size_t)(room - t->room) * sizeof(Chunk *));
    t->dir = grown;
    t->room = room;
    return 0;
}

/* Make room for chunk number ``cn`` in the directory: its index there, or -1 and an exception. */
static Py_ssize_t dir_place(NodeTable *t, int64_t cn) {
    if (t->len == 0) { /* an empty table starts again at this chunk */
        t->first = cn;
        t->head = t->end = 0;
    }
    int64_t c = cn - t->first;
    if (c < 0) { /* below the directory (rare: ids are made in increasing order): shift it up */
        if (dir_fit(t, t->room) < 0) /* (the live part at the start: ``first`` moves) */
            return -1;
        int64_t up = t->first - cn, need = t->end + up;
        if (need > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(Chunk *)) {
            PyErr_NoMemory();
            return -1;
        }
        if (need > t->room && dir_fit(t, (Py_ssize_t)need) < 0)
            return -1;
        memmove(t->dir + up, t->dir, (size_t)t->end * sizeof(Chunk *));
        memset(t->dir, 0, (size_t)up * sizeof(Chunk *));
        t->first = cn;
        t->end = (Py_ssize_t)need;
        return 0;
    }
    if (c >= t->room) {
        if (t->head >= t->end - t->head) { /* at least half of it is empty below the live part */
            c -= t->head;
            if (dir_fit(t, t->room) < 0)
                return -1;
        }
        if (c >= t->room) {
            if (c > PY_SSIZE_T_MAX / (2 * (Py_ssize_t)sizeof(Chunk *))) {
                PyErr_NoMemory();
                return -1;
            }
            Py_ssize_t room = t->room < 8 ? 8 : t->room;
            while (room <= c)
                room *= 2;
            if (dir_fit(t, room) < 0)
                return -1;
            c = cn - t->first;
        }
    }
    if (c < t->head)
        t->head = (Py_ssize_t)c;
    if (c >= t->end)
        t->end = (Py_ssize_t)c + 1;
    return (Py_ssize_t)c;
}

int table_put(NodeTable *t, int64_t id, Node *node) {
    Py_ssize_t c = dir_place(t, id >> TABLE_BITS);
    if (c < 0)
        return -1;
    Chunk *chunk = t->dir[c];
    if (chunk == NULL && (chunk = t->dir[c] = PyMem_Calloc(1, sizeof(Chunk))) == NULL) {
        PyErr_NoMemory();
        return -1; /* (the directory may keep an empty stretch: it is trimmed at the next removal) */
    }
    Node **slot = &chunk->slot[id & (TABLE_CHUNK - 1)], *old = *slot;
    *slot = (Node *)Py_NewRef(node);
    if (old == NULL) {
        chunk->live++;
        t->len++;
    }
    Py_XDECREF(old);
    return 0;
}

int table_del(NodeTable *t, int64_t id) {
    int64_t c = (id >> TABLE_BITS) - t->first;
    Chunk *chunk = c >= t->head && c < t->end ? t->dir[c] : NULL;
    Node **slot = chunk ? &chunk->slot[id & (TABLE_CHUNK - 1)] : NULL;
    if (slot == NULL || *slot == NULL) {
        PyObject *key = PyLong_FromLongLong(id);
        if (key != NULL)
            PyErr_SetObject(PyExc_KeyError, key);
        Py_XDECREF(key);
        return -1;
    }
    Node *old = *slot;
    *slot = NULL;
    t->len--;
    if (--chunk->live == 0) {
        PyMem_Free(chunk);
        t->dir[c] = NULL;
        while (t->head < t->end && t->dir[t->head] == NULL)
            t->head++;
        while (t->end > t->head && t->dir[t->end - 1] == NULL)
            t->end--;
        if (t->head == t->end)
            t->head = t->end = 0;
        Py_ssize_t span = t->end - t->head;
        if (t->room > 64 && span < t->room / 8) /* memory follows the live span: shrink to twice it */
            dir_fit(t, span * 2 > 8 ? span * 2 : 8), PyErr_Clear();
    }
    Py_DECREF(old); /* last: a node freed here may free others, never this table's */
    return 0;
}

static void table_dealloc(NodeTable *t) {
    for (Py_ssize_t c = t->head; c < t->end; c++) {
        Chunk *chunk = t->dir[c];
        for (int i = 0; chunk != NULL && i < TABLE_CHUNK; i++)
            Py_XDECREF(chunk->slot[i]);
        PyMem_Free(chunk);
    }
    PyMem_Free(t->dir);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0))
        return PyErr_Format(PyExc_TypeError, "NodeTable() takes no arguments");
    return type->tp_alloc(type, 0); /* zeroed: empty, no directory */
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

/* The id of the node in slot ``i`` of directory entry ``c`` as an int: the node's own id object
 * when it is that id (a tree's always is), else a new one. */
static PyObject *key_at(NodeTable *t, Py_ssize_t c, int i) {
    int64_t id = (t->first + c) * TABLE_CHUNK + i, own;
    PyObject *nid = t->dir[c]->slot[i]->node_id;
    if (nid != NULL && PyLong_CheckExact(nid) && field(nid, &own) == 0 && own == id)
        return Py_NewRef(nid);
    PyErr_Clear();
    return PyLong_FromLongLong(id);
}

/* A new list of the keys (0), the nodes (1) or (id, node) pairs (2), in ascending id order. */
static PyObject *listing(NodeTable *t, int what) {
    PyObject *out = PyList_New(t->len);
    Py_ssize_t k = 0;
    for (Py_ssize_t c = t->head; out != NULL && c < t->end; c++) {
        for (int i = 0; t->dir[c] != NULL && i < TABLE_CHUNK; i++) {
            PyObject *node = (PyObject *)t->dir[c]->slot[i], *item;
            if (node == NULL)
                continue;
            if (what == 1)
                item = Py_NewRef(node);
            else {
                PyObject *key = key_at(t, c, i);
                item = what == 0 || key == NULL ? key : PyTuple_Pack(2, key, node);
                if (what == 2)
                    Py_XDECREF(key);
            }
            if (item == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, k++, item); /* (making the items runs no Python code: len holds) */
        }
    }
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
    return PyUnicode_FromFormat("NodeTable(%zd nodes, %zd chunks)", t->len, t->end - t->head);
}

static PyObject *table_sizeof(NodeTable *t, PyObject *unused) {
    size_t bytes = sizeof(NodeTable) + (size_t)t->room * sizeof(Chunk *);
    for (Py_ssize_t c = t->head; c < t->end; c++)
        bytes += t->dir[c] != NULL ? sizeof(Chunk) : 0;
    return PyLong_FromSize_t(bytes);
}

static PyMethodDef table_methods[] = {
    {"get", (PyCFunction)(void (*)(void))table_get_method, METH_FASTCALL, "The node of an id, or the default (None)."},
    {"keys", (PyCFunction)table_keys, METH_NOARGS, "The ids, ascending (a new list)."},
    {"values", (PyCFunction)table_values, METH_NOARGS, "The nodes, by ascending id (a new list)."},
    {"items", (PyCFunction)table_items, METH_NOARGS, "(id, node) pairs, by ascending id (a new list)."},
    {"__sizeof__", (PyCFunction)table_sizeof, METH_NOARGS, "Bytes held: the table, its directory and its chunks."},
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
    .tp_doc = "NodeTable(): native nodes by int id, ids indexing chunked arrays (tree.RadixTree.nodes).",
    .tp_as_mapping = &table_mapping,
    .tp_as_sequence = &table_sequence,
    .tp_iter = (getiterfunc)table_iter,
    .tp_methods = table_methods,
    .tp_repr = (reprfunc)table_repr,
    .tp_new = table_new,
    .tp_dealloc = (destructor)table_dealloc,
};
