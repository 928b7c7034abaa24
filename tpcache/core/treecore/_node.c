/* A tree node as one C struct the garbage collector never tracks (tpcache/core/treecore/tree.py's Node, the
 * reference, has the same fields, methods and behaviour).
 *
 * A cache of a million pages is a million nodes; as Python objects with __slots__ each is tracked by
 * the collector, and each full collection walks all of them (a pause of the scheduler on every
 * rank). This type has no GC support, so neither its instances nor the children dicts holding them
 * (a dict holding only untracked values stays untracked) are ever walked. The tree breaks its own
 * parent/child cycles when it is dropped (tree.RadixTree.dispose), which the collector, not seeing
 * these objects, could not.
 *
 * It is also one allocation per page where it can be: the page's tokens are held inline, a single
 * child without a dict, and every number as a C integer (208 bytes for a page of 16 tokens, where
 * fields of objects cost about 660).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

#include "_node.h"

/* Freed nodes of one token size, kept for the next allocations (linked through ``kids``). An
 * eviction frees about as many pages as the insert after it makes, and a page of 512 tokens is a
 * node past pymalloc's 512 bytes, so each would otherwise cost a malloc and a free of the C
 * library (a tenth of a replay). At most FREE_BYTES of nodes wait (about a request's new pages of 16
 * tokens on the conversation trace; more keeps colder memory and costs a replay with a host tier):
 * what they hold is bounded. */
enum { FREE_BYTES = 256 << 10 };
static Node *free_nodes = NULL;
static Py_ssize_t free_len = -1, free_count = 0;

static void node_dealloc(Node *self) {
#define CLEAR(name) Py_CLEAR(self->name);
    FIELDS(CLEAR)
    Py_CLEAR(self->kids);
    Py_ssize_t len = Py_SIZE(self);
    if (free_count == 0)
        free_len = len;
    if (len == free_len && (size_t)(free_count + 1) * (offsetof(Node, tok) + (size_t)len) <= FREE_BYTES) {
        self->kids = (PyObject *)free_nodes;
        free_nodes = self;
        free_count++;
        return;
    }
    PyObject_Free(self);
}

int node_fill(Node *self, int64_t node_id, PyObject *parent, uint64_t hash, int64_t clock) {
    if (parent != Py_None && !PyObject_TypeCheck(parent, &NodeType)) {
        memset(&self->parent, 0, offsetof(Node, tok) - offsetof(Node, parent)); /* nothing for dealloc to clear */
        PyErr_SetString(PyExc_TypeError, "a node's parent is a Node or None");
        return -1;
    }
#define SET(name, value) self->name = Py_NewRef(value)
    self->node_id = node_id;
    SET(parent, parent);
    self->kids = NULL;
    self->hash = hash;
    self->depth = parent == Py_None ? 0 : ((Node *)parent)->depth + 1;
    self->device_page = self->host_slot = -1;
    self->device_state = self->host_state = self->storage_state = 0;
    self->device_pins = self->host_pins = 0;
    self->last_access = self->created_at = clock;
    self->hits = 0;
    SET(comp, Py_None);
    self->record = 0;
    SET(run, Py_None);
    self->run_at = 0;
    SET(pages_run, Py_None);
    return 0;
}

Node *node_alloc(Py_ssize_t len) {
    Node *n;
    if (free_count > 0 && len == free_len) {
        n = free_nodes;
        free_nodes = (Node *)n->kids;
        free_count--;
    } else if ((n = (Node *)PyObject_Malloc(offsetof(Node, tok) + (size_t)len)) == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    PyObject_InitVar((PyVarObject *)n, &NodeType, len);
    return n;
}

void node_warm(Py_ssize_t len) {
    if (free_count > 0 && len == free_len)
        for (Py_ssize_t at = 0; at < len; at += 64)
            __builtin_prefetch(free_nodes->tok + at, 1);
}

static PyObject *node_tp_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    long long node_id, clock;
    PyObject *parent, *hash;
    Py_buffer tokens;
    static char *kwlist[] = {"node_id", "parent", "tokens", "hash_", "clock", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LOy*OL", kwlist, &node_id, &parent, &tokens, &hash, &clock))
        return NULL;
    uint64_t h = PyLong_AsUnsignedLongLong(hash);
    Node *n = h == (uint64_t)-1 && PyErr_Occurred() ? NULL : node_alloc(tokens.len);
    if (n != NULL)
        memcpy(n->tok, tokens.buf, (size_t)tokens.len);
    if (n != NULL && node_fill(n, node_id, parent, h, clock) < 0)
        Py_CLEAR(n);
    PyBuffer_Release(&tokens);
    return (PyObject *)n;
}

/* ------------------------------------------------------------------ children (_kids.c) */

static PyObject *node_children(Node *self, void *c) { return kids_view(self); }

static PyObject *node_child_nodes(Node *self, PyObject *unused) { return kids_list(self); }

static PyObject *node_get_tokens(Node *self, void *c) { return node_tokens(self); }

static PyObject *node_num_children(Node *self, void *c) { return PyLong_FromSsize_t(kids_count(self)); }

static PyObject *node_only_child(Node *self, void *c) {
    return Py_NewRef(self->kids != NULL && Py_IS_TYPE(self->kids, &NodeType) ? self->kids : Py_None);
}

static PyObject *node_child(Node *self, PyObject *key) {
    PyObject *child = kids_get(self, key);
    if (child == NULL && PyErr_Occurred())
        return NULL;
    return Py_NewRef(child ? child : Py_None);
}

/* child_at(data, pos, step): child(data[pos:pos + step]) for bytes ``data`` and pos >= 0, without
 * the slice: a page's tokens compared where they lie (and, among a few children, no hash of them). */
static PyObject *node_child_at(Node *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "child_at takes 3 arguments, not %zd", nargs);
    PyObject *data = args[0];
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]), step = PyLong_AsSsize_t(args[2]);
    if ((pos == -1 || step == -1) && PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(data) || pos < 0 || step < 0)
        return PyErr_Format(PyExc_ValueError, "child_at takes bytes and a position and a length of at least 0");
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    Py_ssize_t len = pos >= size ? 0 : step < size - pos ? step : size - pos; /* as the slice clips */
    PyObject *found = kids_at(self, PyBytes_AS_STRING(data) + (pos < size ? pos : size), len);
    if (found == NULL && PyErr_Occurred())
        return NULL;
    return Py_NewRef(found ? found : Py_None);
}

static PyObject *node_link(Node *self, PyObject *child) {
    if (!is_node(child))
        return PyErr_Format(PyExc_TypeError, "a node's child is a Node");
    int rc = kids_add(self, (Node *)child);
    if (rc > 0)
        PyErr_Format(PyExc_ValueError, "node %lld already has a child for this page", (long long)self->node_id);
    return rc == 0 ? Py_NewRef(Py_None) : NULL;
}

static PyObject *node_unlink(Node *self, PyObject *child) {
    if (!is_node(child))
        return PyErr_Format(PyExc_TypeError, "a node's child is a Node");
    return kids_del(self, (Node *)child) == 0 ? Py_NewRef(Py_None) : NULL;
}

#define MEMBER(name) {#name, T_OBJECT_EX, offsetof(Node, name), 0, NULL},
static PyMemberDef node_members[] = {
    FIELDS(MEMBER)
    {"node_id", T_LONGLONG, offsetof(Node, node_id), READONLY, "The node's id (the root's is 0)."},
    {"hash", T_ULONGLONG, offsetof(Node, hash), 0, "The page's chain hash."},
    {"record", T_ULONGLONG, offsetof(Node, record), 0, "The node's current contribution to the state digest."},
    {"depth", T_INT, offsetof(Node, depth), READONLY, "Pages above it to the root (the root's is 0)."},
    {NULL, 0, 0, 0, NULL},
};

/* The narrow integer fields as Python attributes: read as ints; written as ints (an IntEnum state
 * is one) in the field's range, else an OverflowError naming the field, never a value cut short. */
typedef struct {
    const char *name;
    Py_ssize_t offset;
    int bits; /* 8, 32 or 64, signed */
} IntField;
#define INT_FIELD(name, bits) static const IntField F_##name = {#name, offsetof(Node, name), bits};
INT_FIELD(device_state, 8) INT_FIELD(host_state, 8) INT_FIELD(storage_state, 8) INT_FIELD(device_pins, 32)
INT_FIELD(host_pins, 32) INT_FIELD(device_page, 32) INT_FIELD(host_slot, 32) INT_FIELD(run_at, 32)
INT_FIELD(last_access, 64) INT_FIELD(created_at, 64) INT_FIELD(hits, 64)

static PyObject *int_get(Node *self, const IntField *f) {
    const char *at = (const char *)self + f->offset;
    return f->bits == 8 ? PyLong_FromLong(*(const int8_t *)at)
           : f->bits == 32 ? PyLong_FromLong(*(const int32_t *)at)
                           : PyLong_FromLongLong(*(const int64_t *)at);
}

static int int_set(Node *self, PyObject *value, const IntField *f) {
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "a node's %s cannot be deleted", f->name);
        return -1;
    }
    int past = 0;
    PyObject *num = PyNumber_Index(value);
    if (num == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "a node's %s takes an int, not %.100s", f->name, Py_TYPE(value)->tp_name);
        }
        return -1;
    }
    long long v = PyLong_AsLongLongAndOverflow(num, &past);
    Py_DECREF(num);
    if (v == -1 && PyErr_Occurred())
        return -1;
    long long lim = f->bits == 64 ? 0 : 1LL << (f->bits - 1);
    if (past || (lim && (v < -lim || v >= lim))) {
        PyErr_Format(PyExc_OverflowError, "a node's %s takes a %d-bit int, not %S", f->name, f->bits, value);
        return -1;
    }
    char *at = (char *)self + f->offset;
    if (f->bits == 8)
        *(int8_t *)at = (int8_t)v;
    else if (f->bits == 32)
        *(int32_t *)at = (int32_t)v;
    else
        *(int64_t *)at = (int64_t)v;
    return 0;
}

static PyObject *node_on_device(Node *self, void *c) { return PyBool_FromLong(self->device_state != 0); }
static PyObject *node_device_valid(Node *self, void *c) { return PyBool_FromLong(self->device_state == 2); }
static PyObject *node_on_host(Node *self, void *c) { return PyBool_FromLong(self->host_state != 0); }
static PyObject *node_resident(Node *self, void *c) {
    return PyBool_FromLong(self->device_state != 0 || self->host_state != 0);
}

#define INT_GETSET(name, doc) {#name, (getter)int_get, (setter)int_set, doc, (void *)&F_##name},
static PyGetSetDef node_getset[] = {
    INT_GETSET(device_state, "Its device tier state (tiers.DeviceState).")
    INT_GETSET(host_state, "Its host tier state (tiers.HostState).")
    INT_GETSET(storage_state, "Its storage tier state (tiers.StorageState).")
    INT_GETSET(device_pins, "Pins of its device page.")
    INT_GETSET(host_pins, "Pins of its host slot.")
    INT_GETSET(device_page, "The device page, -1 with none.")
    INT_GETSET(host_slot, "The host slot, -1 with none.")
    INT_GETSET(run_at, "Its place in its run cache (tree.py's walk).")
    INT_GETSET(last_access, "The clock of its last use.")
    INT_GETSET(created_at, "The clock it was made at.")
    INT_GETSET(hits, "How often a lookup hit it.")
    {"on_device", (getter)node_on_device, NULL, "Holds a device page (valid or loading).", NULL},
    {"device_valid", (getter)node_device_valid, NULL, "Holds a valid device page.", NULL},
    {"on_host", (getter)node_on_host, NULL, "Holds a host slot (valid or being written).", NULL},
    {"resident", (getter)node_resident, NULL, "Holds a copy on device or host.", NULL},
    {"tokens", (getter)node_get_tokens, NULL, "The page's token ids, int32 bytes (held inline).", NULL},
    {"children", (getter)node_children, NULL, "The children by their tokens (a read-only mapping made when read: a snapshot).", NULL},
    {"num_children", (getter)node_num_children, NULL, "How many children.", NULL},
    {"only_child", (getter)node_only_child, NULL, "The child when there is exactly one, else None.", NULL},
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
    Node *other = node_alloc(Py_SIZE(self));
    if (other == NULL)
        return NULL;
    /* Every field after the object header and the tokens, as they are; then the object fields'
     * references (a field added to Node is copied without a line here). */
    memcpy(&other->parent, &self->parent, offsetof(Node, tok) - offsetof(Node, parent) + (size_t)Py_SIZE(self));
#define INCREF(name) Py_XINCREF(other->name);
    FIELDS(INCREF)
    Py_XINCREF(other->kids);
    return (PyObject *)other;
}

static PyMethodDef node_methods[] = {
    {"path", (PyCFunction)node_path, METH_NOARGS, "Nodes from the first page down to this one (the root excluded)."},
    {"__copy__", (PyCFunction)node_copy, METH_NOARGS, "A shallow copy (its fields, not its place in the tree)."},
    {"child", (PyCFunction)node_child, METH_O, "The child for these page tokens, or None."},
    {"child_nodes", (PyCFunction)node_child_nodes, METH_NOARGS, "The children, in the order they were added (a new list)."},
    {"child_at", (PyCFunction)(void (*)(void))node_child_at, METH_FASTCALL,
     "child(data[pos:pos + step]) for bytes data and pos >= 0, without the slice."},
    {"link", (PyCFunction)node_link, METH_O, "Add a child under its tokens (ValueError if that page has one)."},
    {"unlink", (PyCFunction)node_unlink, METH_O, "Remove a child (KeyError if it is not one)."},
    {NULL, NULL, 0, NULL},
};

static const char *STATES[3][3] = {{"NONE", "LOADING", "VALID"}, {"NONE", "WRITING", "VALID"}, {"NONE", "WRITING", "DURABLE"}};

static const char *state_name(int kind, int s) { return s >= 0 && s < 3 ? STATES[kind][s] : "?"; }

static PyObject *node_repr(Node *self) {
    return PyUnicode_FromFormat("Node(id=%lld, depth=%lld, dev=%s:%lld, host=%s:%lld, storage=%s)", (long long)self->node_id,
                                (long long)self->depth, state_name(0, self->device_state), (long long)self->device_page,
                                state_name(1, self->host_state), (long long)self->host_slot,
                                state_name(2, self->storage_state));
}

PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpcache.core.treecore._node.Node",
    .tp_basicsize = offsetof(Node, tok),
    .tp_itemsize = 1,
    .tp_dealloc = (destructor)node_dealloc,
    .tp_repr = (reprfunc)node_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One page of the tree (tpcache/core/treecore/tree.py), untracked by the garbage collector.",
    .tp_members = node_members,
    .tp_getset = node_getset,
    .tp_methods = node_methods,
    .tp_new = node_tp_new,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_node", "Tree nodes the garbage collector does not track, and the ledger's per-node kernels.", -1,
    account_methods,
};

PyMODINIT_FUNC PyInit__node(void) {
    if (PyType_Ready(&NodeType) < 0 || PyType_Ready(&TokKeyType) < 0 || PyType_Ready(&HoldingType) < 0 || PyType_Ready(&HeapsType) < 0 ||
        PyType_Ready(&NodeTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    if (PyModule_AddFunctions(m, candidate_methods) < 0 || PyModule_AddFunctions(m, bind_methods) < 0 || PyModule_AddFunctions(m, evict_methods) < 0 ||
        PyModule_AddFunctions(m, chain_methods) < 0 || PyModule_AddFunctions(m, settle_methods) < 0 ||
        PyModule_AddFunctions(m, round_methods) < 0 ||
        PyModule_AddFunctions(m, pool_methods) < 0 || PyModule_AddFunctions(m, lookup_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Node", (PyObject *)&NodeType) < 0 ||
        PyModule_AddObjectRef(m, "Holding", (PyObject *)&HoldingType) < 0 ||
        PyModule_AddObjectRef(m, "Heaps", (PyObject *)&HeapsType) < 0 ||
        PyModule_AddObjectRef(m, "NodeTable", (PyObject *)&NodeTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
