/* A tree node as one C struct the garbage collector never tracks (tpcache/core/tree.py's Node, the
 * reference, has the same fields, methods and behaviour).
 *
 * A cache of a million pages is a million nodes; as Python objects with __slots__ each is tracked by
 * the collector, and each full collection walks all of them (a pause of the scheduler on every
 * rank). This type has no GC support, so neither its instances nor the children dicts holding them
 * (a dict holding only untracked values stays untracked) are ever walked; integer fields are stored
 * unboxed. The tree breaks its own parent/child cycles when it is dropped (tree.RadixTree.dispose),
 * which the collector, not seeing these objects, could not.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *parent;
    PyObject *children;
    PyObject *tokens;
    PyObject *comp;
    PyObject *run;
    PyObject *pages_run;
    unsigned long long hash;
    long long node_id, depth, device_page, device_state, device_pins, host_slot, host_state, host_pins;
    long long storage_state, last_access, created_at, hits, record, run_at;
} Node;


static void node_dealloc(Node *self) {
    Py_CLEAR(self->parent);
    Py_CLEAR(self->children);
    Py_CLEAR(self->tokens);
    Py_CLEAR(self->comp);
    Py_CLEAR(self->run);
    Py_CLEAR(self->pages_run);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject NodeType;

static int node_init(Node *self, PyObject *args, PyObject *kwds) {
    long long node_id, clock;
    unsigned long long hash;
    PyObject *parent, *tokens;
    static char *kwlist[] = {"node_id", "parent", "tokens", "hash_", "clock", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LOSKL", kwlist, &node_id, &parent, &tokens, &hash, &clock))
        return -1;
    if (parent != Py_None && !PyObject_TypeCheck(parent, &NodeType)) {
        PyErr_SetString(PyExc_TypeError, "a node's parent is a Node or None");
        return -1;
    }
    PyObject *children = PyDict_New();
    if (children == NULL)
        return -1;
    Py_XSETREF(self->children, children);
    Py_INCREF(tokens);
    Py_XSETREF(self->tokens, tokens);
    Py_INCREF(parent);
    Py_XSETREF(self->parent, parent);
    Py_INCREF(Py_None);
    Py_XSETREF(self->comp, Py_None);
    Py_INCREF(Py_None);
    Py_XSETREF(self->run, Py_None);
    Py_INCREF(Py_None);
    Py_XSETREF(self->pages_run, Py_None);
    self->node_id = node_id;
    self->hash = hash;
    self->depth = parent == Py_None ? 0 : ((Node *)parent)->depth + 1;
    self->device_page = self->host_slot = -1;
    self->device_state = self->host_state = self->storage_state = 0;
    self->device_pins = self->host_pins = self->hits = self->record = self->run_at = 0;
    self->last_access = self->created_at = clock;
    return 0;
}

#define OBJ(name) {#name, T_OBJECT, offsetof(Node, name), 0, NULL}
#define I64(name) {#name, T_LONGLONG, offsetof(Node, name), 0, NULL}

static PyMemberDef node_members[] = {
    OBJ(parent), OBJ(children), OBJ(tokens), OBJ(comp), OBJ(run), OBJ(pages_run),
    {"hash", T_ULONGLONG, offsetof(Node, hash), 0, NULL},
    I64(node_id), I64(depth), I64(device_page), I64(device_state), I64(device_pins), I64(host_slot),
    I64(host_state), I64(host_pins), I64(storage_state), I64(last_access), I64(created_at), I64(hits),
    I64(record), I64(run_at),
    {NULL, 0, 0, 0, NULL},
};

/* Tier states: NONE 0, then LOADING/WRITING 1, VALID/DURABLE 2 (tpcache/core/tiers.py). */
static PyObject *node_on_device(Node *self, void *c) { return PyBool_FromLong(self->device_state != 0); }
static PyObject *node_device_valid(Node *self, void *c) { return PyBool_FromLong(self->device_state == 2); }
static PyObject *node_on_host(Node *self, void *c) { return PyBool_FromLong(self->host_state != 0); }
static PyObject *node_resident(Node *self, void *c) {
    return PyBool_FromLong(self->device_state != 0 || self->host_state != 0);
}

static PyGetSetDef node_getset[] = {
    {"on_device", (getter)node_on_device, NULL, "Holds a device page (valid or loading).", NULL},
    {"device_valid", (getter)node_device_valid, NULL, "Holds a valid device page.", NULL},
    {"on_host", (getter)node_on_host, NULL, "Holds a host slot (valid or being written).", NULL},
    {"resident", (getter)node_resident, NULL, "Holds a copy on device or host.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *node_path(Node *self, PyObject *unused) {
    /* Nodes from the first page down to this one (the root excluded). */
    Py_ssize_t n = 0;
    for (Node *cur = self; (PyObject *)cur != Py_None && cur->parent != NULL && cur->parent != Py_None;
         cur = (Node *)cur->parent)
        n++;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    Node *cur = self;
    for (Py_ssize_t i = n - 1; i >= 0; i--, cur = (Node *)cur->parent) {
        Py_INCREF(cur);
        PyList_SET_ITEM(out, i, (PyObject *)cur);
    }
    return out;
}

static PyObject *node_copy(Node *self, PyObject *unused) {
    Node *other = (Node *)NodeType.tp_alloc(&NodeType, 0);
    if (other == NULL)
        return NULL;
    PyObject **src[] = {&self->parent, &self->children, &self->tokens, &self->comp, &self->run, &self->pages_run};
    PyObject **dst[] = {&other->parent, &other->children, &other->tokens, &other->comp, &other->run, &other->pages_run};
    for (int i = 0; i < 6; i++) {
        Py_XINCREF(*src[i]);
        *dst[i] = *src[i];
    }
    other->hash = self->hash;
    memcpy(&other->node_id, &self->node_id, offsetof(Node, run_at) + sizeof(long long) - offsetof(Node, node_id));
    return (PyObject *)other;
}

static PyMethodDef node_methods[] = {
    {"path", (PyCFunction)node_path, METH_NOARGS, "Nodes from the first page down to this one (the root excluded)."},
    {"__copy__", (PyCFunction)node_copy, METH_NOARGS, "A shallow copy (its fields, not its place in the tree)."},
    {NULL, NULL, 0, NULL},
};

static const char *STATES[3][3] = {{"NONE", "LOADING", "VALID"}, {"NONE", "WRITING", "VALID"}, {"NONE", "WRITING", "DURABLE"}};

static const char *state_name(int kind, long long v) { return v >= 0 && v < 3 ? STATES[kind][v] : "?"; }

static PyObject *node_repr(Node *self) {
    return PyUnicode_FromFormat("Node(id=%lld, depth=%lld, dev=%s:%lld, host=%s:%lld, storage=%s)", self->node_id,
                                self->depth, state_name(0, self->device_state), self->device_page,
                                state_name(1, self->host_state), self->host_slot, state_name(2, self->storage_state));
}

static PyTypeObject NodeType = {
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
    PyModuleDef_HEAD_INIT, "_node", "Tree nodes the garbage collector does not track.", -1, NULL,
};

PyMODINIT_FUNC PyInit__node(void) {
    if (PyType_Ready(&NodeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&NodeType);
    if (PyModule_AddObject(m, "Node", (PyObject *)&NodeType) < 0) {
        Py_DECREF(&NodeType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
