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
        while (kids_next(n, &pos, &child)) {
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
    while (kids_next(n, &pos, &child)) {
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

/* A node's heap entry, ``key << 64 | node_id`` with candidates.LRU/LFU/FIFO.key: kind 0 LRU, 1 LFU,
 * 2 FIFO. The key's fields are 64-bit words, most significant first: ``entry_words`` gives them
 * little-endian (node id first), how many (4, or 5 for LFU), or -1 and an exception for a field
 * outside 0..2**64-1. */
static int entry_words(Node *n, long kind, uint64_t w[5]) {
    int k = 0;
    PyObject *first = kind == 1 ? n->hits : kind == 0 ? n->last_access : n->created_at;
    PyObject *fields[5] = {n->node_id, NULL /* the hash */, NULL /* the depth */, n->last_access /* LFU only */, first};
    for (int f = 0; f < 5; f++) {
        if (f == 3 && kind != 1)
            continue;
        uint64_t v = f == 1 ? n->hash : (uint64_t)n->depth;
        if (f != 1 && f != 2 && ufield(fields[f], &v) < 0)
            return -1;
        w[k++] = f == 2 ? UINT64_MAX - v : v;
    }
    return k;
}

/* The heap entry itself, an int built from ``entry_words`` in one call: NULL and an exception for a
 * field outside 0..2**64-1. */
static PyObject *heap_entry(Node *n, long kind) {
    uint64_t w[5];
    int k = entry_words(n, kind, w);
    if (k < 0)
        return NULL;
    unsigned char bytes[40];
    for (int i = 0; i < k; i++)
        for (int b = 0; b < 8; b++)
            bytes[8 * i + b] = (unsigned char)(w[i] >> (8 * b));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(bytes, (size_t)(8 * k), Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray(bytes, (size_t)(8 * k), 1, 0);
#endif
}

/* A heap entry (an int) against a node's entry given as its ``k`` words, without making the node's:
 * -1 below it, 0 equal, 1 above; -2 and an exception on an error. */
static int entry_cmp(PyObject *entry, const uint64_t *w, int k) {
    if (!PyLong_Check(entry)) {
        PyErr_SetString(PyExc_TypeError, "a heap entry is an int (key << 64 | node id)");
        return -2;
    }
#if PY_VERSION_HEX < 0x030C0000
    /* The entry's 30-bit digits gathered into 64-bit words, least significant first. */
    Py_ssize_t digits = Py_SIZE(entry);
    if (digits < 0)
        return -1; /* negative: below every entry */
    const digit *d = ((PyLongObject *)entry)->ob_digit;
    uint64_t t[5] = {0};
    for (Py_ssize_t i = 0, bit = 0; i < digits; i++, bit += PyLong_SHIFT) {
        uint64_t v = d[i];
        Py_ssize_t word = bit / 64, off = bit % 64;
        uint64_t spill = off + PyLong_SHIFT > 64 ? v >> (64 - off) : 0;
        if (word >= k || (spill && word + 1 >= k)) {
            if (v != 0)
                return 1; /* wider than the node's entry: above it */
            continue;
        }
        t[word] |= v << off;
        if (spill)
            t[word + 1] |= spill;
    }
    for (int i = k - 1; i >= 0; i--)
        if (t[i] != w[i])
            return t[i] < w[i] ? -1 : 1;
    return 0;
#else
    unsigned char bytes[40];
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t need = PyLong_AsNativeBytes(entry, bytes, (Py_ssize_t)(8 * k),
                                           Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
                                               Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (need < 0) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError))
            return -2;
        PyErr_Clear();
        return -1; /* negative: below every entry */
    }
    if (need > 8 * k)
        return 1; /* wider than the node's entry: above it */
#else
    if (_PyLong_Sign(entry) < 0)
        return -1;
    if (_PyLong_AsByteArray((PyLongObject *)entry, bytes, (size_t)(8 * k), 1, 0) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -2;
        PyErr_Clear();
        return 1;
    }
#endif
    for (int i = k - 1; i >= 0; i--) {
        uint64_t v = 0;
        for (int b = 7; b >= 0; b--)
            v = v << 8 | bytes[8 * i + b];
        if (v != w[i])
            return v < w[i] ? -1 : 1;
    }
    return 0;
#endif
}

static PyObject *heappush = NULL, *heappop = NULL; /* _heapq's, so heaps are laid out as heapq lays them */
static PyObject *s_device_heap, *s_host_heap, *s_tree, *s_nodes, *s_key_kind, *s_rebuild;

static int load_heapq(void) {
    if (heappush != NULL)
        return 0;
    if (INTERN(device_heap) || INTERN(host_heap) || INTERN(tree) || INTERN(nodes) || INTERN(key_kind) || INTERN(rebuild))
        return -1;
    PyObject *m = PyImport_ImportModule("_heapq");
    if (m == NULL)
        return -1;
    heappop = PyObject_GetAttrString(m, "heappop");
    heappush = heappop ? PyObject_GetAttrString(m, "heappush") : NULL;
    Py_DECREF(m);
    return heappush == NULL ? -1 : 0;
}

static int key_kind(PyObject *cands, long *kind) {
    if (load_heapq() < 0)
        return -1;
    PyObject *k = PyObject_GetAttr(cands, s_key_kind);
    if (k == NULL)
        return -1;
    *kind = PyLong_AsLong(k);
    Py_DECREF(k);
    return *kind == -1 && PyErr_Occurred() ? -1 : 0;
}

static int push(PyObject *heap, Node *n, long kind) {
    PyObject *entry = heap_entry(n, kind);
    if (entry == NULL)
        return -1;
    PyObject *args[2] = {heap, entry};
    PyObject *r = PyObject_Vectorcall(heappush, args, 2, NULL);
    Py_DECREF(entry);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static int load_lists(Heaps *h) {
    Py_XSETREF(h->dev, PyObject_GetAttr(h->cands, s_device_heap));
    Py_XSETREF(h->host, PyObject_GetAttr(h->cands, s_host_heap));
    if (h->dev == NULL || h->host == NULL)
        return -1;
    if (!PyList_Check(h->dev) || !PyList_Check(h->host)) {
        PyErr_SetString(PyExc_TypeError, "the candidates' heaps are lists");
        return -1;
    }
    return 0;
}

int heaps_load(Heaps *h, PyObject *cands) {
    h->cands = cands;
    h->dev = h->host = h->nodes = NULL;
    if (key_kind(cands, &h->kind) < 0)
        return -1;
    PyObject *tree = PyObject_GetAttr(cands, s_tree);
    h->nodes = tree ? PyObject_GetAttr(tree, s_nodes) : NULL;
    Py_XDECREF(tree);
    if (h->nodes == NULL || load_lists(h) < 0)
        return -1;
    if (!PyDict_Check(h->nodes)) {
        PyErr_SetString(PyExc_TypeError, "the tree's nodes are a dict");
        return -1;
    }
    return 0;
}

void heaps_clear(Heaps *h) {
    Py_CLEAR(h->dev);
    Py_CLEAR(h->host);
    Py_CLEAR(h->nodes);
}

/* eviction.Candidates.offer and _push, for the policies written here (``key_kind`` >= 0); any other
 * policy, or a reference node, gets ``candidates._push(node, which)``. */
int heaps_push(Heaps *h, PyObject *node, int which) {
    if (h->kind < 0 || !is_node(node)) {
        PyObject *r = PyObject_CallMethod(h->cands, "_push", "Oi", node, which);
        Py_XDECREF(r);
        return r == NULL || load_lists(h) < 0 ? -1 : 0;
    }
    if (PyList_GET_SIZE(h->dev) + PyList_GET_SIZE(h->host) > 4 * PyDict_GET_SIZE(h->nodes) + 64) {
        PyObject *r = PyObject_CallMethodNoArgs(h->cands, s_rebuild); /* the heaps are new lists after it */
        Py_XDECREF(r);
        if (r == NULL || load_lists(h) < 0)
            return -1;
    }
    if ((which & 1 && push(h->dev, (Node *)node, h->kind) < 0) || (which & 2 && push(h->host, (Node *)node, h->kind) < 0))
        return -1;
    return 0;
}

int heaps_offer(Heaps *h, PyObject *node) {
    int which = candidacy(node);
    return which <= 0 ? which : heaps_push(h, node, which);
}

/* offer(candidates, node): ``heaps_offer``. */
static PyObject *py_offer(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "offer takes 2 arguments, not %zd", nargs);
    return offer1(args[0], args[1]) < 0 ? NULL : Py_NewRef(Py_None);
}

int offer1(PyObject *cands, PyObject *node) {
    LazyHeaps h = {.cands = cands};
    int rc = lazy_offer(&h, node);
    lazy_clear(&h);
    return rc;
}

static int state_field(PyObject *node, int device, int64_t *out) {
    return field(device ? ((Node *)node)->device_state : ((Node *)node)->host_state, out);
}

int lazy_offer(LazyHeaps *h, PyObject *node) {
    int which = candidacy(node); /* most offers push nothing: no need for the heaps */
    if (which <= 0)
        return which;
    if (!h->loaded) {
        if (heaps_load(&h->heaps, h->cands) < 0) {
            heaps_clear(&h->heaps);
            return -1;
        }
        h->loaded = 1;
    }
    return heaps_push(&h->heaps, node, which);
}

void lazy_clear(LazyHeaps *h) {
    if (h->loaded)
        heaps_clear(&h->heaps);
    h->loaded = 0;
}

int lazy_offer_around(LazyHeaps *h, PyObject *node) {
    if (lazy_offer(h, node) < 0)
        return -1;
    PyObject *first = ((Node *)node)->parent;
    if (!is_node(first) || !is_node(((Node *)first)->parent))
        return 0;
    Py_INCREF(first); /* an offer may run Python: hold what the walk stands on */
    PyObject *parent = Py_NewRef(first);
    int rc = -1;
    if (lazy_offer(h, parent) < 0)
        goto done;
    for (;;) {
        int64_t ds, hs;
        if (state_field(parent, 1, &ds) || state_field(parent, 0, &hs))
            goto done;
        if (!(ds == 0 && hs != 0))
            break;
        PyObject *up = ((Node *)parent)->parent;
        if (!is_node(up) || !is_node(((Node *)up)->parent)) {
            rc = 0;
            goto done;
        }
        Py_SETREF(parent, Py_NewRef(up));
    }
    int64_t ds;
    if (state_field(parent, 1, &ds))
        goto done;
    rc = parent != first && ds == 2 ? lazy_offer(h, parent) : 0;
done:
    Py_DECREF(parent);
    Py_DECREF(first);
    return rc < 0 ? -1 : 0;
}

/* offer_around(candidates, node): eviction.Candidates.offer_around (see there). */
static PyObject *py_offer_around(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "offer_around takes 2 arguments, not %zd", nargs);
    if (!is_node(args[1]))
        return PyErr_Format(PyExc_TypeError, "offer_around takes a native Node, not %.100s", Py_TYPE(args[1])->tp_name);
    LazyHeaps h = {.cands = args[0]};
    int rc = lazy_offer_around(&h, args[1]);
    lazy_clear(&h);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

/* Whether a popped (or top) entry is live: its node is a candidate of ``which`` with the key it was
 * pushed with (eviction.Candidates.live). 1 and the node (a new reference) in ``*out``, 0 stale,
 * -1 and an exception. */
static int entry_node(PyObject *entry, long which, PyObject *nodes, long kind, PyObject **out) {
    if (!PyLong_Check(entry)) {
        PyErr_SetString(PyExc_TypeError, "a heap entry is an int (key << 64 | node id)");
        return -1;
    }
    PyObject *id = PyLong_FromUnsignedLongLong(PyLong_AsUnsignedLongLongMask(entry));
    PyObject *node = id == NULL ? NULL : PyDict_GetItemWithError(nodes, id); /* borrowed */
    Py_XDECREF(id);
    if (node == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!is_node(node)) {
        PyErr_SetString(PyExc_TypeError, "pop: a tree of native nodes");
        return -1;
    }
    Py_INCREF(node); /* candidacy may run Python (its fallbacks) */
    int c = candidacy(node), live = c < 0 ? -1 : 0;
    if (c > 0 && c & which) {
        uint64_t w[5];
        int k = entry_words((Node *)node, kind, w), cmp = k < 0 ? -2 : entry_cmp(entry, w, k);
        live = cmp == -2 ? -1 : cmp == 0;
    }
    if (live > 0)
        *out = node;
    else
        Py_DECREF(node);
    return live;
}

/* A push now would rebuild the heaps first (heaps_push's test). */
static int rebuild_due(Heaps *h) {
    return PyList_GET_SIZE(h->dev) + PyList_GET_SIZE(h->host) > 4 * PyDict_GET_SIZE(h->nodes) + 64;
}

/* The next live candidate of ``heap`` (a new reference) or None: eviction.Candidates._pop with live()
 * (a current entry: its node is a candidate of that tier, with the key it was pushed with). ``nodes``
 * is the tree's nodes dict, ``kind`` the policy's key kind. NULL and an exception on an error. */
PyObject *pop_candidate(PyObject *heap, long which, PyObject *nodes, long kind) {
    if (load_heapq() < 0)
        return NULL;
    while (PyList_GET_SIZE(heap) > 0) {
        PyObject *entry = PyObject_CallOneArg(heappop, heap), *node = NULL;
        int live = entry == NULL ? -1 : entry_node(entry, which, nodes, kind, &node);
        Py_XDECREF(entry);
        if (live < 0)
            return NULL;
        if (live > 0)
            return node;
    }
    return Py_NewRef(Py_None);
}

/* Whether the device-only candidate ``node``, offered now, would be the device heap's next pop with
 * nothing else changed. Not when a rebuild is due (its push would run one, on the heaps as they are
 * now). Else the pop after its push would drop the stale entries below its entry and return the
 * first live one below it, or else the node: so those stale entries go now (an entry's liveness
 * depends on its node alone, not on the heap), and the node is next unless a live entry is below
 * its own (heapq pops the least int). 1 yes, 0 no, -1 and an exception. */
int heaps_next_pop(Heaps *h, Node *node) {
    if (h->kind < 0 || rebuild_due(h))
        return 0;
    uint64_t w[5];
    int k = entry_words(node, h->kind, w);
    if (k < 0 || load_heapq() < 0)
        return -1;
    int first = 1;
    while (PyList_GET_SIZE(h->dev) > 0) {
        PyObject *top = Py_NewRef(PyList_GET_ITEM(h->dev, 0)), *other = NULL;
        int cmp = entry_cmp(top, w, k), below = cmp == -2 ? -1 : cmp < 0;
        int live = below > 0 ? entry_node(top, 1, h->nodes, h->kind, &other) : below;
        Py_XDECREF(other);
        Py_DECREF(top);
        if (below == 0 || live != 0) {
            first = below == 0 ? 1 : live < 0 ? -1 : 0;
            break;
        }
        PyObject *gone = PyObject_CallOneArg(heappop, h->dev); /* stale, below the node's entry */
        if (gone == NULL) {
            first = -1;
            break;
        }
        Py_DECREF(gone);
    }
    return first;
}

/* pop(candidates, heap, which) -> the next live candidate of ``heap`` or None (``pop_candidate``). */
static PyObject *py_pop(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "pop takes 3 arguments, not %zd", nargs);
    PyObject *heap = args[1], *out = NULL;
    long which = PyLong_AsLong(args[2]);
    if (which == -1 && PyErr_Occurred())
        return NULL;
    Heaps h;
    if (heaps_load(&h, args[0]) < 0) {
        heaps_clear(&h);
        return NULL;
    }
    if (!PyList_Check(heap) || h.kind < 0)
        PyErr_Format(PyExc_TypeError, "pop takes a heap list, of a policy written here");
    else
        out = pop_candidate(heap, which, h.nodes, h.kind);
    heaps_clear(&h);
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
