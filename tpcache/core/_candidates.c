/* The eviction candidates' kernels in C: which heap a node is a candidate of, its offer (with the
 * policy's key and heapq's push), offers around a change, and pops that skip stale entries.
 * eviction.py keeps the Python versions as the reference; tests hold the two equal (same heaps
 * entry for entry, same pops).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_node.h"

/* eviction.py's is_device_candidate, is_host_candidate and host_subtree_droppable, for what the
 * kernel leaves to the reference: a page whose children live only on host, a node with components,
 * a reference node. Set once by eviction.py. */
static PyObject *is_device_candidate = NULL, *is_host_candidate = NULL, *subtree_droppable = NULL;

static PyObject *py_set_candidacy(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "set_candidacy takes 3 functions, not %zd", nargs);
    Py_INCREF(args[0]);
    Py_XSETREF(is_device_candidate, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(is_host_candidate, args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(subtree_droppable, args[2]);
    Py_RETURN_NONE;
}

static int call_bool(PyObject *fn, PyObject *node) {
    if (fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_node: eviction's candidacy functions are not set");
        return -1;
    }
    PyObject *r = PyObject_CallOneArg(fn, node);
    if (r == NULL)
        return -1;
    int v = PyObject_IsTrue(r);
    Py_DECREF(r);
    return v;
}

/* Which heaps a node is a candidate of: 1 device, 2 host, 0 neither, -1 an error
 * (eviction.Candidates.offer's test). */
int candidacy(PyObject *obj) {
    if (!is_node(obj)) {
        int d = call_bool(is_device_candidate, obj), h = d < 0 ? -1 : call_bool(is_host_candidate, obj);
        return d < 0 || h < 0 ? -1 : d | h << 1;
    }
    Node *n = (Node *)obj;
    int64_t state, pins, hs, hp;
    if (field(n->device_state, &state) || field(n->device_pins, &pins) || field(n->host_state, &hs) ||
        field(n->host_pins, &hp))
        return -1;
    if (n->parent == Py_None)
        return 0;
    PyObject *child;
    Py_ssize_t pos = 0;
    if (state == 2 && pins == 0) {
        int host_children = 0;
        while (PyDict_Next(n->children, &pos, NULL, &child)) {
            int64_t cd, ch;
            if (!is_node(child))
                return call_bool(is_device_candidate, obj);
            if (field(((Node *)child)->device_state, &cd) || field(((Node *)child)->host_state, &ch))
                return -1;
            if (cd != 0)
                return 0;
            host_children |= ch != 0;
        }
        if (!host_children || hs != 0)
            return 1;
        return call_bool(subtree_droppable, obj);
    }
    if (state != 0 || hs != 2 || hp != 0)
        return 0;
    if (n->comp != Py_None) {
        int h = call_bool(is_host_candidate, obj);
        return h < 0 ? -1 : h << 1;
    }
    while (PyDict_Next(n->children, &pos, NULL, &child)) {
        int64_t ch;
        if (!is_node(child)) {
            int h = call_bool(is_host_candidate, obj);
            return h < 0 ? -1 : h << 1;
        }
        if (field(((Node *)child)->host_state, &ch))
            return -1;
        if (ch != 0)
            return 0;
    }
    return 2;
}

/* A policy's key (eviction.LRU/LFU/FIFO.key): kind 0 LRU, 1 LFU, 2 FIFO. */
static PyObject *policy_key(Node *n, long kind) {
    PyObject *depth = PyNumber_Negative(n->depth);
    if (depth == NULL)
        return NULL;
    PyObject *key;
    if (kind == 0)
        key = PyTuple_Pack(3, n->last_access, depth, n->hash);
    else if (kind == 1)
        key = PyTuple_Pack(4, n->hits, n->last_access, depth, n->hash);
    else
        key = PyTuple_Pack(3, n->created_at, depth, n->hash);
    Py_DECREF(depth);
    return key;
}

static PyObject *heappush = NULL, *heappop = NULL; /* _heapq's, so heaps are laid out as heapq lays them */

static int load_heapq(void) {
    if (heappush != NULL)
        return 0;
    PyObject *m = PyImport_ImportModule("_heapq");
    if (m == NULL)
        return -1;
    heappush = PyObject_GetAttrString(m, "heappush");
    heappop = PyObject_GetAttrString(m, "heappop");
    Py_DECREF(m);
    return heappush == NULL || heappop == NULL ? -1 : 0;
}

static int key_kind(PyObject *cands, long *kind) {
    PyObject *k = PyObject_GetAttrString(cands, "key_kind");
    if (k == NULL)
        return -1;
    *kind = PyLong_AsLong(k);
    Py_DECREF(k);
    return *kind == -1 && PyErr_Occurred() ? -1 : 0;
}

static int push(PyObject *heap, Node *n, long kind) {
    PyObject *key = policy_key(n, kind);
    if (key == NULL)
        return -1;
    PyObject *entry = PyTuple_Pack(2, key, n->node_id);
    Py_DECREF(key);
    if (entry == NULL)
        return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(heappush, heap, entry, NULL);
    Py_DECREF(entry);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* offer(candidates, node): eviction.Candidates.offer and _push, for the policies written here
 * (``candidates.key_kind`` >= 0); any other policy gets ``candidates._push(node, which)``. */
static PyObject *py_offer(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "offer takes 2 arguments, not %zd", nargs);
    PyObject *cands = args[0], *node = args[1];
    int which = candidacy(node);
    long kind;
    if (which < 0)
        return NULL;
    if (which == 0)
        Py_RETURN_NONE;
    if (key_kind(cands, &kind) < 0 || load_heapq() < 0)
        return NULL;
    if (kind < 0 || !is_node(node))
        return PyObject_CallMethod(cands, "_push", "Oi", node, which);
    PyObject *dev = PyObject_GetAttrString(cands, "device_heap"), *host = PyObject_GetAttrString(cands, "host_heap");
    PyObject *tree = PyObject_GetAttrString(cands, "tree"), *nodes = tree ? PyObject_GetAttrString(tree, "nodes") : NULL;
    PyObject *out = NULL;
    if (dev == NULL || host == NULL || nodes == NULL)
        goto done;
    Py_ssize_t stale = PyObject_Length(dev) + PyObject_Length(host), live = PyObject_Length(nodes);
    if (stale < 0 || live < 0)
        goto done;
    if (stale > 4 * live + 64) { /* the heaps are new lists after a rebuild */
        PyObject *r = PyObject_CallMethod(cands, "rebuild", NULL);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
        Py_SETREF(dev, PyObject_GetAttrString(cands, "device_heap"));
        Py_SETREF(host, PyObject_GetAttrString(cands, "host_heap"));
        if (dev == NULL || host == NULL)
            goto done;
    }
    if ((which & 1 && push(dev, (Node *)node, kind) < 0) || (which & 2 && push(host, (Node *)node, kind) < 0))
        goto done;
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(dev);
    Py_XDECREF(host);
    Py_XDECREF(tree);
    Py_XDECREF(nodes);
    return out;
}

static int offer1(PyObject *cands, PyObject *node) {
    PyObject *args[2] = {cands, node};
    PyObject *r = py_offer(NULL, args, 2);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static int state_field(PyObject *node, int device, int64_t *out) {
    return field(device ? ((Node *)node)->device_state : ((Node *)node)->host_state, out);
}

/* offer_around(candidates, node): eviction.Candidates.offer_around (see there). */
static PyObject *py_offer_around(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "offer_around takes 2 arguments, not %zd", nargs);
    PyObject *cands = args[0], *node = args[1];
    if (!is_node(node))
        return PyErr_Format(PyExc_TypeError, "offer_around takes a native Node, not %.100s", Py_TYPE(node)->tp_name);
    if (offer1(cands, node) < 0)
        return NULL;
    PyObject *first = ((Node *)node)->parent;
    if (!is_node(first) || !is_node(((Node *)first)->parent))
        Py_RETURN_NONE;
    Py_INCREF(first); /* an offer may run Python: hold what the walk stands on */
    PyObject *parent = Py_NewRef(first), *out = NULL;
    if (offer1(cands, parent) < 0)
        goto done;
    for (;;) {
        int64_t ds, hs;
        if (state_field(parent, 1, &ds) || state_field(parent, 0, &hs))
            goto done;
        if (!(ds == 0 && hs != 0))
            break;
        PyObject *up = ((Node *)parent)->parent;
        if (!is_node(up) || !is_node(((Node *)up)->parent)) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        Py_SETREF(parent, Py_NewRef(up));
    }
    int64_t ds;
    if (state_field(parent, 1, &ds))
        goto done;
    if (parent != first && ds == 2 && offer1(cands, parent) < 0)
        goto done;
    out = Py_NewRef(Py_None);
done:
    Py_DECREF(parent);
    Py_DECREF(first);
    return out;
}

/* pop(candidates, heap, which) -> the next live candidate of ``heap`` or None: eviction.Candidates._pop
 * with live() (a current entry: its node is a candidate of that tier, with the key it was pushed with). */
static PyObject *py_pop(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "pop takes 3 arguments, not %zd", nargs);
    PyObject *cands = args[0], *heap = args[1];
    long which = PyLong_AsLong(args[2]), kind;
    if ((which == -1 && PyErr_Occurred()) || key_kind(cands, &kind) < 0 || load_heapq() < 0)
        return NULL;
    if (!PyList_Check(heap) || kind < 0)
        return PyErr_Format(PyExc_TypeError, "pop takes a heap list, of a policy written here");
    PyObject *tree = PyObject_GetAttrString(cands, "tree"), *nodes = tree ? PyObject_GetAttrString(tree, "nodes") : NULL;
    Py_XDECREF(tree);
    if (nodes == NULL)
        return NULL;
    PyObject *out = NULL;
    while (PyList_GET_SIZE(heap) > 0) {
        PyObject *entry = PyObject_CallOneArg(heappop, heap);
        if (entry == NULL)
            goto done;
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_TypeError, "a heap entry is (key, node id)");
            goto done;
        }
        PyObject *node = PyDict_GetItemWithError(nodes, PyTuple_GET_ITEM(entry, 1)); /* borrowed */
        int live = 0;
        if (node != NULL && !is_node(node)) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_TypeError, "pop: a tree of native nodes");
            goto done;
        }
        if (node != NULL) {
            int c = candidacy(node);
            if (c < 0) {
                Py_DECREF(entry);
                goto done;
            }
            if (c & which) {
                PyObject *key = policy_key((Node *)node, kind);
                live = key == NULL ? -1 : PyObject_RichCompareBool(key, PyTuple_GET_ITEM(entry, 0), Py_EQ);
                Py_XDECREF(key);
            }
        } else if (PyErr_Occurred()) {
            live = -1;
        }
        if (live < 0) {
            Py_DECREF(entry);
            goto done;
        }
        if (live) {
            out = Py_NewRef(node);
            Py_DECREF(entry);
            goto done;
        }
        Py_DECREF(entry);
    }
    out = Py_NewRef(Py_None);
done:
    Py_DECREF(nodes);
    return out;
}

PyMethodDef candidate_methods[] = {
    {"set_candidacy", (PyCFunction)(void (*)(void))py_set_candidacy, METH_FASTCALL,
     "eviction's is_device_candidate, is_host_candidate and host_subtree_droppable."},
    {"offer", (PyCFunction)(void (*)(void))py_offer, METH_FASTCALL, "eviction.Candidates.offer (see there)."},
    {"offer_around", (PyCFunction)(void (*)(void))py_offer_around, METH_FASTCALL,
     "eviction.Candidates.offer_around (see there)."},
    {"pop", (PyCFunction)(void (*)(void))py_pop, METH_FASTCALL, "eviction.Candidates._pop (see there)."},
    {NULL, NULL, 0, NULL},
};
