/* A tree node as one C struct the garbage collector never tracks (tpcache/core/tree.py's Node, the
 * reference, has the same fields, methods and behaviour).
 *
 * A cache of a million pages is a million nodes; as Python objects with __slots__ each is tracked by
 * the collector, and each full collection walks all of them (a pause of the scheduler on every
 * rank). This type has no GC support, so neither its instances nor the children dicts holding them
 * (a dict holding only untracked values stays untracked) are ever walked. The tree breaks its own parent/child cycles when it is dropped (tree.RadixTree.dispose),
 * which the collector, not seeing these objects, could not.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>


#include "_node.h"

static void node_dealloc(Node *self) {
#define CLEAR(name) Py_CLEAR(self->name);
    FIELDS(CLEAR)
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Node.__init__'s fields, on a node whose fields are all NULL or set. */
static int node_fill(Node *self, PyObject *node_id, PyObject *parent, PyObject *tokens, PyObject *hash, PyObject *clock) {
    if (parent != Py_None && !PyObject_TypeCheck(parent, &NodeType)) {
        PyErr_SetString(PyExc_TypeError, "a node's parent is a Node or None");
        return -1;
    }
    PyObject *children = PyDict_New();
    if (children == NULL)
        return -1;
    long long up = parent == Py_None ? -1 : PyLong_AsLongLong(((Node *)parent)->depth);
    PyObject *depth = up == -1 && PyErr_Occurred() ? NULL : PyLong_FromLongLong(up + 1);
    if (depth == NULL) {
        Py_DECREF(children);
        return -1;
    }
    PyObject *zero = PyLong_FromLong(0), *minus_one = PyLong_FromLong(-1);  /* cached small ints */
#define SET(name, value)                                                                            \
    do {                                                                                            \
        PyObject *v_ = (value);                                                                     \
        Py_INCREF(v_);                                                                              \
        Py_XSETREF(self->name, v_);                                                                 \
    } while (0)
    SET(node_id, node_id);
    SET(parent, parent);
    Py_XSETREF(self->children, children);
    SET(tokens, tokens);
    SET(hash, hash);
    Py_XSETREF(self->depth, depth);
    SET(device_page, minus_one);
    SET(device_state, zero);
    SET(device_pins, zero);
    SET(host_slot, minus_one);
    SET(host_state, zero);
    SET(host_pins, zero);
    SET(storage_state, zero);
    SET(last_access, clock);
    SET(created_at, clock);
    SET(hits, zero);
    SET(comp, Py_None);
    SET(record, zero);
    SET(run, Py_None);
    SET(run_at, zero);
    SET(pages_run, Py_None);
    Py_DECREF(zero);
    Py_DECREF(minus_one);
    return 0;
}

static int node_init(Node *self, PyObject *args, PyObject *kwds) {
    PyObject *node_id, *parent, *tokens, *hash, *clock;
    static char *kwlist[] = {"node_id", "parent", "tokens", "hash_", "clock", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO", kwlist, &node_id, &parent, &tokens, &hash, &clock))
        return -1;
    return node_fill(self, node_id, parent, tokens, hash, clock);
}

Node *node_new(PyObject *node_id, PyObject *parent, PyObject *tokens, PyObject *hash, PyObject *clock) {
    Node *n = (Node *)NodeType.tp_alloc(&NodeType, 0);
    if (n != NULL && node_fill(n, node_id, parent, tokens, hash, clock) < 0)
        Py_CLEAR(n);
    return n;
}

#define MEMBER(name) {#name, T_OBJECT_EX, offsetof(Node, name), 0, NULL},
static PyMemberDef node_members[] = {FIELDS(MEMBER){NULL, 0, 0, 0, NULL}};

/* Tier states: NONE 0, then LOADING/WRITING 1, VALID/DURABLE 2 (tpcache/core/tiers.py). */
static int state_of(PyObject *v) {
    long s = v == NULL ? -1 : PyLong_AsLong(v);
    if (s == -1 && PyErr_Occurred())
        PyErr_Clear();
    return (int)s;
}

static PyObject *node_on_device(Node *self, void *c) { return PyBool_FromLong(state_of(self->device_state) != 0); }
static PyObject *node_device_valid(Node *self, void *c) { return PyBool_FromLong(state_of(self->device_state) == 2); }
static PyObject *node_on_host(Node *self, void *c) { return PyBool_FromLong(state_of(self->host_state) != 0); }
static PyObject *node_resident(Node *self, void *c) {
    return PyBool_FromLong(state_of(self->device_state) != 0 || state_of(self->host_state) != 0);
}

static PyGetSetDef node_getset[] = {
    {"on_device", (getter)node_on_device, NULL, "Holds a device page (valid or loading).", NULL},
    {"device_valid", (getter)node_device_valid, NULL, "Holds a valid device page.", NULL},
    {"on_host", (getter)node_on_host, NULL, "Holds a host slot (valid or being written).", NULL},
    {"resident", (getter)node_resident, NULL, "Holds a copy on device or host.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *node_path(Node *self, PyObject *unused) {
    /* Nodes from the first page down to this one (the root excluded). One checked walk: appending
     * may run a collection, and a collection may dispose of a dropped tree (parents set to None). */
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (PyObject *cur = (PyObject *)self; is_node(cur) && is_node(((Node *)cur)->parent); cur = ((Node *)cur)->parent) {
        if (PyList_Append(out, cur) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    if (PyList_Reverse(out) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *node_copy(Node *self, PyObject *unused) {
    Node *other = (Node *)NodeType.tp_alloc(&NodeType, 0);
    if (other == NULL)
        return NULL;
#define COPY(name)                                                                                  \
    Py_XINCREF(self->name);                                                                         \
    other->name = self->name;
    FIELDS(COPY)
    return (PyObject *)other;
}

static PyMethodDef node_methods[] = {
    {"path", (PyCFunction)node_path, METH_NOARGS, "Nodes from the first page down to this one (the root excluded)."},
    {"__copy__", (PyCFunction)node_copy, METH_NOARGS, "A shallow copy (its fields, not its place in the tree)."},
    {NULL, NULL, 0, NULL},
};

static const char *STATES[3][3] = {{"NONE", "LOADING", "VALID"}, {"NONE", "WRITING", "VALID"}, {"NONE", "WRITING", "DURABLE"}};

static const char *state_name(int kind, PyObject *v) {
    int s = state_of(v);
    return s >= 0 && s < 3 ? STATES[kind][s] : "?";
}

static PyObject *node_repr(Node *self) {
    return PyUnicode_FromFormat("Node(id=%S, depth=%S, dev=%s:%S, host=%s:%S, storage=%s)", self->node_id, self->depth,
                                state_name(0, self->device_state), self->device_page, state_name(1, self->host_state),
                                self->host_slot, state_name(2, self->storage_state));
}

PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpcache.core._node.Node",
    .tp_basicsize = sizeof(Node),
    .tp_dealloc = (destructor)node_dealloc,
    .tp_repr = (reprfunc)node_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One page of the tree (tpcache/core/tree.py), untracked by the garbage collector.",
    .tp_members = node_members,
    .tp_getset = node_getset,
    .tp_methods = node_methods,
    .tp_init = (initproc)node_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_node", "Tree nodes the garbage collector does not track, and the ledger's per-node kernels.", -1,
    account_methods,
};

PyMODINIT_FUNC PyInit__node(void) {
    if (PyType_Ready(&NodeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    if (PyModule_AddFunctions(m, candidate_methods) < 0 || PyModule_AddFunctions(m, evict_methods) < 0 ||
        PyModule_AddFunctions(m, chain_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&NodeType);
    if (PyModule_AddObject(m, "Node", (PyObject *)&NodeType) < 0) {
        Py_DECREF(&NodeType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
