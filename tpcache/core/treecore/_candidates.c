/* The eviction candidates' kernels in C: which heap a node is a candidate of, its offer (with the
 * policy's key), offers around a change, pops that skip stale entries and the heaps' rebuild, on a
 * ``Heaps`` object that holds the two heaps, the tree's nodes and the policy's key kind. The heaps
 * are lists of ints laid out as heapq lays them (the same sifts here), so a pop from Python's heapq
 * and one from here agree. candidates.py keeps the Python versions as the reference; tests hold the
 * two equal (same heaps entry for entry, same pops).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_node.h"

enum { STRIDE = 8, PART_HOST = 2, PART_HPINS = 6, HOST_WRITING = 1 }; /* components.py */

/* components.host_parts_idle: 1 no component host copy of the node is written or pinned, 0 one is,
 * -1 and an exception (a record that is not a list of ints). */
static int parts_idle(Node *n) {
    PyObject *rec = n->comp;
    if (rec == Py_None)
        return 1;
    if (!PyList_Check(rec)) {
        PyErr_SetString(PyExc_TypeError, "a node's component record is a list of ints");
        return -1;
    }
    for (Py_ssize_t b = 0; b < PyList_GET_SIZE(rec); b += STRIDE) {
        if (b + PART_HPINS >= PyList_GET_SIZE(rec)) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return -1;
        }
        int64_t host, pins;
        if (field(PyList_GET_ITEM(rec, b + PART_HOST), &host) || field(PyList_GET_ITEM(rec, b + PART_HPINS), &pins))
            return -1;
        if (host == HOST_WRITING || pins != 0)
            return 0;
    }
    return 1;
}

static int not_native(PyObject *o) {
    PyErr_Format(PyExc_TypeError, "eviction candidates: a native Node, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
}

/* Push the children of ``n`` that have a host copy on ``stack``: 0, or -1 and an exception. */
static int push_host_children(Node *n, PyObject *stack) {
    PyObject *child;
    Py_ssize_t pos = 0;
    while (kids_next(n, &pos, &child)) {
        if (!is_node(child))
            return not_native(child);
        if (((Node *)child)->host_state != 0 && PyList_Append(stack, child) < 0)
            return -1;
    }
    return 0;
}

/* eviction.host_subtree_droppable: 1 the host-only pages below ``n`` can all go with it, 0 not, -1
 * and an exception. */
static int subtree_droppable(Node *n) {
    PyObject *stack = PyList_New(0);
    if (stack == NULL || push_host_children(n, stack) < 0) {
        Py_XDECREF(stack);
        return -1;
    }
    int rc = 1;
    while (rc == 1 && PyList_GET_SIZE(stack) > 0) {
        Py_ssize_t last = PyList_GET_SIZE(stack) - 1;
        Node *child = (Node *)Py_NewRef(PyList_GET_ITEM(stack, last));
        if (PyList_SetSlice(stack, last, last + 1, NULL) < 0)
            rc = -1;
        else if (child->host_state != 2 || child->host_pins != 0 || child->device_state != 0)
            rc = 0;
        else if ((rc = parts_idle(child)) == 1 && push_host_children(child, stack) < 0)
            rc = -1;
        Py_DECREF(child);
    }
    Py_DECREF(stack);
    return rc;
}

/* Which heaps a node is a candidate of: 1 device, 2 host, 0 neither, -1 an error
 * (eviction.is_device_candidate | eviction.is_host_candidate << 1). */
int candidacy(PyObject *obj) {
    if (!is_node(obj))
        return not_native(obj);
    Node *n = (Node *)obj;
    int64_t state = n->device_state, pins = n->device_pins, hs = n->host_state, hp = n->host_pins;
    if (n->parent == Py_None || !may_be_candidate(state, pins, hs, hp))
        return 0;
    PyObject *child;
    Py_ssize_t pos = 0;
    if (state == 2) { /* unpinned (may_be_candidate) */
        int host_children = 0;
        while (kids_next(n, &pos, &child)) {
            if (!is_node(child))
                return not_native(child);
            int cd = ((Node *)child)->device_state, ch = ((Node *)child)->host_state;
            if (cd != 0)
                return 0;
            host_children |= ch != 0;
        }
        if (!host_children || hs != 0)
            return 1;
        return subtree_droppable(n);
    }
    int idle = parts_idle(n); /* host-only and idle (may_be_candidate) */
    if (idle <= 0)
        return idle;
    while (kids_next(n, &pos, &child)) {
        if (!is_node(child))
            return not_native(child);
        if (((Node *)child)->host_state != 0)
            return 0;
    }
    return 2;
}
/* A node's heap entry, ``key << 64 | node_id`` with candidates.LRU/LFU/FIFO.key: kind 0 LRU, 1 LFU,
 * 2 FIFO. The key's fields are 64-bit words, most significant first: ``entry_words`` gives them
 * little-endian (node id first), how many (4, or 5 for LFU), or -1 and an OverflowError for a
 * negative id, stamp or hit count. */
static int entry_words(Node *n, long kind, uint64_t w[5]) {
    int k = 0;
    int64_t first = kind == 1 ? n->hits : kind == 0 ? n->last_access : n->created_at;
    int64_t v[5] = {n->node_id, 0 /* the hash */, n->depth, n->last_access /* LFU only */, first};
    if (v[0] < 0 || v[4] < 0 || (kind == 1 && v[3] < 0)) {
        PyErr_SetString(PyExc_OverflowError, "a heap entry takes no negative id, stamp or hit count");
        return -1;
    }
    for (int f = 0; f < 5; f++) {
        if (f == 3 && kind != 1)
            continue;
        uint64_t x = f == 1 ? n->hash : (uint64_t)v[f];
        w[k++] = f == 2 ? UINT64_MAX - x : x;
    }
    return k;
}

/* The heap entry itself, an int built from ``entry_words`` in one call: NULL and an exception where
 * ``entry_words`` refuses the node. */
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

/* A node's heap entry as the comparisons below take it: its ``k`` words (``entry_words``) and, where
 * ints are arrays of digits (before 3.12), how many digits it has. */
typedef struct {
    uint64_t w[5];
    int k;
    Py_ssize_t size;
} Key;

/* ``key`` for a node: 0, or -1 and an exception (``entry_words``). */
static int node_key(Node *n, long kind, Key *key) {
    if ((key->k = entry_words(n, kind, key->w)) < 0)
        return -1;
    int top = key->k - 1;
    while (top > 0 && key->w[top] == 0)
        top--;
    Py_ssize_t bits = key->w[top] == 0 ? 0 : 64 * top + 64 - __builtin_clzll(key->w[top]);
    key->size = (bits + PyLong_SHIFT - 1) / PyLong_SHIFT;
    return 0;
}

#if PY_VERSION_HEX < 0x030C0000
/* The key's digit ``i`` (least significant first), made when a comparison gets to it. */
static inline digit key_digit(const Key *key, Py_ssize_t i) {
    Py_ssize_t bit = i * PyLong_SHIFT, word = bit / 64, off = bit % 64;
    uint64_t v = key->w[word] >> off;
    if (off + PyLong_SHIFT > 64 && word + 1 < key->k)
        v |= key->w[word + 1] << (64 - off);
    return (digit)(v & PyLong_MASK);
}
#endif

/* A heap entry (an int) against a node's entry given as its ``key``, without making the node's: -1
 * below it, 0 equal, 1 above; -2 and an exception on an error. */
static int entry_cmp(PyObject *entry, const Key *key) {
    if (!PyLong_Check(entry)) {
        PyErr_SetString(PyExc_TypeError, "a heap entry is an int (key << 64 | node id)");
        return -2;
    }
#if PY_VERSION_HEX < 0x030C0000
    /* As int comparison compares: the sign and the number of digits, then the digits from the most
     * significant (most often the first differs: the entries' leading words are their stamps). */
    Py_ssize_t size = Py_SIZE(entry);
    if (size < 0)
        return -1; /* negative: below every entry */
    if (size != key->size)
        return size < key->size ? -1 : 1;
    const digit *d = ((PyLongObject *)entry)->ob_digit;
    for (Py_ssize_t i = size - 1; i >= 0; i--) {
        digit mine = key_digit(key, i);
        if (d[i] != mine)
            return d[i] < mine ? -1 : 1;
    }
    return 0;
#else
    const uint64_t *w = key->w;
    int k = key->k;
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

/* A push now would rebuild the heaps first (candidates.Candidates._push's test). */
static int rebuild_due(Heaps *h) {
    return PyList_GET_SIZE(h->dev) + PyList_GET_SIZE(h->host) > 4 * h->nodes->len + 64;
}

/* Exchange the items of two lists (their arrays, sizes and capacities). */
static void swap_items(PyListObject *a, PyListObject *b) {
    PyObject **items = a->ob_item;
    Py_ssize_t size = Py_SIZE(a), allocated = a->allocated;
    a->ob_item = b->ob_item;
    Py_SET_SIZE(a, Py_SIZE(b));
    a->allocated = b->allocated;
    b->ob_item = items;
    Py_SET_SIZE(b, size);
    b->allocated = allocated;
}

/* candidates.Candidates.rebuild, in place: one entry per candidate, nodes by ascending id (the
 * reference dict's insertion order), heapified: 0, or -1 and an exception. */
static int heaps_rebuild(Heaps *h) {
    PyObject *dev = PyList_New(0), *host = PyList_New(0);
    PyObject *nodes = dev == NULL || host == NULL ? NULL : table_nodes(h->nodes);
    int rc = nodes == NULL ? -1 : 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(nodes); i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        int which = candidacy(node);
        PyObject *entry = which > 0 ? heap_entry((Node *)node, h->kind) : NULL;
        if (which < 0 || (which > 0 && entry == NULL))
            rc = -1;
        else if (which > 0)
            rc = PyList_Append(which & 1 ? dev : host, entry);
        Py_XDECREF(entry);
    }
    if (rc == 0) { /* the new entries become the heaps' (the same list objects), the stale ones go */
        swap_items((PyListObject *)h->dev, (PyListObject *)dev);
        swap_items((PyListObject *)h->host, (PyListObject *)host);
        rc = heap_order(h->dev) < 0 || heap_order(h->host) < 0 ? -1 : 0;
    }
    Py_XDECREF(nodes);
    Py_XDECREF(dev);
    Py_XDECREF(host);
    return rc;
}

/* candidates.Candidates._push: ``node`` on the device heap (``which & 1``) and the host heap
 * (``which & 2``), the heaps rebuilt first when stale entries outnumber the nodes. */
int heaps_push(Heaps *h, PyObject *node, int which) {
    if (rebuild_due(h) && heaps_rebuild(h) < 0)
        return -1;
    if (which & 1) {
        PyObject *entry = heap_entry((Node *)node, h->kind);
        if (entry == NULL || heap_push(h->dev, entry) < 0)
            return -1;
    }
    if (which & 2) {
        PyObject *entry = heap_entry((Node *)node, h->kind);
        if (entry == NULL || heap_push(h->host, entry) < 0)
            return -1;
    }
    return 0;
}

int heaps_offer(Heaps *h, PyObject *node) {
    int which = candidacy(node);
    return which <= 0 ? which : heaps_push(h, node, which);
}

int offer1(PyObject *cands, PyObject *node) {
    Heaps *h = as_heaps(cands);
    return h == NULL ? -1 : heaps_offer(h, node);
}

/* offer(heaps, node): candidates.Candidates.offer. */
static PyObject *py_offer(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "offer takes 2 arguments, not %zd", nargs);
    return offer1(args[0], args[1]) < 0 ? NULL : Py_NewRef(Py_None);
}

int lazy_offer(LazyHeaps *h, PyObject *node) {
    int which = candidacy(node); /* most offers push nothing */
    if (which <= 0)
        return which;
    if (!h->loaded) {
        if (as_heaps(h->cands) == NULL)
            return -1;
        h->loaded = 1;
    }
    return heaps_push((Heaps *)h->cands, node, which);
}

void lazy_clear(LazyHeaps *h) { h->loaded = 0; }

int lazy_offer_around(LazyHeaps *h, PyObject *node) {
    if (lazy_offer(h, node) < 0)
        return -1;
    PyObject *first = ((Node *)node)->parent;
    if (!is_node(first) || !is_node(((Node *)first)->parent))
        return 0;
    if (lazy_offer(h, first) < 0)
        return -1;
    PyObject *parent = first; /* offers change no tree: the walk's nodes stay where they are */
    for (;;) {
        if (!(((Node *)parent)->device_state == 0 && ((Node *)parent)->host_state != 0))
            break;
        PyObject *up = ((Node *)parent)->parent;
        if (!is_node(up) || !is_node(((Node *)up)->parent))
            return 0;
        parent = up;
    }
    return parent != first && ((Node *)parent)->device_state == 2 ? (lazy_offer(h, parent) < 0 ? -1 : 0) : 0;
}

/* offer_around(heaps, node): candidates.Candidates.offer_around (see there). */
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
 * pushed with (candidates.Candidates.live). 1 and the node (a new reference) in ``*out``, 0 stale,
 * -1 and an exception. */
static int entry_node(PyObject *entry, long which, NodeTable *nodes, long kind, PyObject **out) {
    if (!PyLong_Check(entry)) {
        PyErr_SetString(PyExc_TypeError, "a heap entry is an int (key << 64 | node id)");
        return -1;
    }
    uint64_t id = PyLong_AsUnsignedLongLongMask(entry);
    if (id == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    PyObject *node = id > INT64_MAX ? NULL : (PyObject *)table_get(nodes, (int64_t)id); /* borrowed */
    if (node == NULL)
        return 0;
    int c = candidacy(node), live = c < 0 ? -1 : 0;
    if (c > 0 && c & which) {
        Key key;
        int cmp = node_key((Node *)node, kind, &key) < 0 ? -2 : entry_cmp(entry, &key);
        live = cmp == -2 ? -1 : cmp == 0;
    }
    if (live > 0)
        *out = Py_NewRef(node);
    return live;
}

/* The next live candidate of the device (``which`` 1) or host (2) heap, a new reference, or None:
 * candidates.Candidates._pop with live(). NULL and an exception on an error. */
PyObject *pop_candidate(Heaps *h, long which) {
    PyObject *heap = which == 1 ? h->dev : h->host;
    while (PyList_GET_SIZE(heap) > 0) {
        PyObject *entry = heap_pop(heap), *node = NULL;
        int live = entry == NULL ? -1 : entry_node(entry, which, h->nodes, h->kind, &node);
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
    if (rebuild_due(h))
        return 0;
    Key key;
    if (node_key(node, h->kind, &key) < 0)
        return -1;
    int first = 1;
    while (PyList_GET_SIZE(h->dev) > 0) {
        PyObject *top = Py_NewRef(PyList_GET_ITEM(h->dev, 0)), *other = NULL;
        int cmp = entry_cmp(top, &key), below = cmp == -2 ? -1 : cmp < 0;
        int live = below > 0 ? entry_node(top, 1, h->nodes, h->kind, &other) : below;
        Py_XDECREF(other);
        Py_DECREF(top);
        if (below == 0 || live != 0) {
            first = below == 0 ? 1 : live < 0 ? -1 : 0;
            break;
        }
        PyObject *gone = heap_pop(h->dev); /* stale, below the node's entry */
        if (gone == NULL) {
            first = -1;
            break;
        }
        Py_DECREF(gone);
    }
    return first;
}

/* pop(heaps, which) -> the next live candidate of the device (1) or host (2) heap, or None. */
static PyObject *py_pop(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "pop takes 2 arguments, not %zd", nargs);
    Heaps *h = as_heaps(args[0]);
    long which = h == NULL ? -1 : PyLong_AsLong(args[1]);
    if (h == NULL || (which == -1 && PyErr_Occurred()))
        return NULL;
    if (which != 1 && which != 2)
        return PyErr_Format(PyExc_ValueError, "pop: which is 1 (device) or 2 (host), not %ld", which);
    return pop_candidate(h, which);
}

/* rebuild(heaps): candidates.Candidates.rebuild, in place. */
static PyObject *py_rebuild(PyObject *mod, PyObject *heaps) {
    Heaps *h = as_heaps(heaps);
    return h == NULL || heaps_rebuild(h) < 0 ? NULL : Py_NewRef(Py_None);
}

/* candidacy(node) -> 1 device, 2 host, 0 neither (eviction's is_device_candidate | is_host_candidate << 1). */
static PyObject *py_candidacy(PyObject *mod, PyObject *node) {
    int which = candidacy(node);
    return which < 0 ? NULL : PyLong_FromLong(which);
}

PyMethodDef candidate_methods[] = {
    {"candidacy", (PyCFunction)py_candidacy, METH_O, "is_device_candidate | is_host_candidate << 1 (see candidates.py)."},
    {"offer", (PyCFunction)(void (*)(void))py_offer, METH_FASTCALL, "candidates.Candidates.offer (see there)."},
    {"offer_around", (PyCFunction)(void (*)(void))py_offer_around, METH_FASTCALL,
     "candidates.Candidates.offer_around (see there)."},
    {"pop", (PyCFunction)(void (*)(void))py_pop, METH_FASTCALL, "candidates.Candidates._pop (see there)."},
    {"rebuild", (PyCFunction)py_rebuild, METH_O, "candidates.Candidates.rebuild, in place."},
    {NULL, NULL, 0, NULL},
};
