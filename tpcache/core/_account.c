/* The ledger's per-node kernels in C: a node's digest record, the pins/stamps/hits of a path
 * (Ledger.touch) and a holding's digest terms. tpcache/core/ledger.py and holdings.py keep the
 * Python versions as the reference; tests hold the two equal (same records, digests, counters,
 * offers).
 *
 * Records are XXH3-64 (seed 0, default secret) of the same little-endian fields the reference
 * packs, so digests do not depend on which path computed them. Only inputs of 17-128 bytes occur
 * (a record is 64 bytes, a holding term 24), so only that branch of the algorithm is here, written
 * from its specification (xxHash's doc/xxhash_spec.md); a test compares it with the xxhash
 * package for every length it accepts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_node.h"

#define DIGEST_MASK ((UINT64_C(1) << 62) - 1)
#define PRIME64_1 UINT64_C(0x9E3779B185EBCA87)
#define PRIME_MX1 UINT64_C(0x165667919E3779F9)

static const uint8_t SECRET[128] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
};

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static inline void write64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++, v >>= 8)
        p[i] = (uint8_t)v;
}

static inline uint64_t mix16(const uint8_t *data, const uint8_t *secret) {
    __uint128_t m = (__uint128_t)(read64(data) ^ read64(secret)) * (read64(data + 8) ^ read64(secret + 8));
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

/* XXH3-64 of 17 to 128 bytes. */
static uint64_t xxh3_17to128(const uint8_t *input, size_t len) {
    uint64_t acc = len * PRIME64_1;
    for (int i = (int)((len - 1) >> 5); i >= 0; i--) {
        acc += mix16(input + 16 * i, SECRET + 32 * i);
        acc += mix16(input + len - 16 * i - 16, SECRET + 32 * i + 16);
    }
    acc ^= acc >> 37;
    acc *= PRIME_MX1;
    return acc ^ (acc >> 32);
}

/* The reference record (ledger._record_of), called for what the kernel does not cover: a node with a
 * component record, or a reference node. Set once by ledger.py. */
static PyObject *record_fallback = NULL;

static int field(PyObject *v, int64_t *out) {
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* The record of a native node without components: 0 and an exception on a field that is not an int. */
static int record_native(Node *n, uint64_t *out) {
    int64_t ds, hs, ss, page, slot, dp, hp, last, hits, created;
    unsigned long long hash = PyLong_AsUnsignedLongLong(n->hash);
    if (hash == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (field(n->device_state, &ds) || field(n->host_state, &hs) || field(n->storage_state, &ss) ||
        field(n->device_page, &page) || field(n->host_slot, &slot) || field(n->device_pins, &dp) ||
        field(n->host_pins, &hp) || field(n->last_access, &last) || field(n->hits, &hits) ||
        field(n->created_at, &created))
        return -1;
    uint8_t buf[64];
    write64(buf, hash);
    write64(buf + 8, (uint64_t)(ds | hs << 2 | ss << 4));
    write64(buf + 16, (uint64_t)page);
    write64(buf + 24, (uint64_t)slot);
    write64(buf + 32, (uint64_t)dp << 32 | (uint64_t)hp);
    write64(buf + 40, (uint64_t)last);
    write64(buf + 48, (uint64_t)hits);
    write64(buf + 56, (uint64_t)created);
    *out = xxh3_17to128(buf, 64) & DIGEST_MASK;
    return 0;
}

static int record_any(PyObject *node, uint64_t *out) {
    if (is_node(node) && ((Node *)node)->comp == Py_None)
        return record_native((Node *)node, out);
    if (record_fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_node.record_of: no reference record for this node");
        return -1;
    }
    PyObject *r = PyObject_CallOneArg(record_fallback, node);
    if (r == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static PyObject *py_record_of(PyObject *mod, PyObject *node) {
    uint64_t r;
    if (record_any(node, &r) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(r);
}

static PyObject *py_set_record_fallback(PyObject *mod, PyObject *fn) {
    Py_INCREF(fn);
    Py_XSETREF(record_fallback, fn);
    Py_RETURN_NONE;
}

static PyObject *py_xxh3(PyObject *mod, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len < 17 || view.len > 128) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "xxh3_17to128 takes 17 to 128 bytes, not %zd", view.len);
    }
    uint64_t h = xxh3_17to128(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static int set_int(PyObject **slot, int64_t v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL)
        return -1;
    Py_SETREF(*slot, o);
    return 0;
}

/* Could eviction.Candidates.offer push this node? False only where it surely would not: pinned, on
 * neither tier, or (for the device heap) the root or a page with a child on device. */
static int may_offer(Node *n, int64_t state, int64_t pins) {
    int64_t hs, hp;
    if (state == 2 && pins == 0) {
        if (n->parent == Py_None)
            return 0;
        PyObject *child;
        Py_ssize_t pos = 0;
        while (PyDict_Next(n->children, &pos, NULL, &child)) {
            int64_t cs;
            if (!is_node(child) || field(((Node *)child)->device_state, &cs) < 0) {
                PyErr_Clear();
                return 1; /* let the reference decide */
            }
            if (cs != 0)
                return 0;
        }
        return 1;
    }
    if (state != 0 || field(n->host_state, &hs) < 0 || field(n->host_pins, &hp) < 0) {
        PyErr_Clear();
        return state == 0;
    }
    return hs == 2 && hp == 0;
}

/* touch(nodes, device_pins, stamp, hit, clock, digest, offer) -> (digest, evictable delta,
 * protected delta): Ledger.touch's loop (see there). */
static PyObject *py_touch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7)
        return PyErr_Format(PyExc_TypeError, "touch takes 7 arguments, not %zd", nargs);
    long long delta = PyLong_AsLongLong(args[1]);
    int stamp = PyObject_IsTrue(args[2]), hit = PyObject_IsTrue(args[3]);
    PyObject *clock = args[4], *offer = args[6];
    unsigned long long value = PyLong_AsUnsignedLongLongMask(args[5]);
    if (PyErr_Occurred() || stamp < 0 || hit < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "touch takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    int64_t evictable = 0, protected_ = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!is_node(item)) {
            PyErr_SetString(PyExc_TypeError, "touch: a native Node");
            goto fail;
        }
        Node *n = (Node *)item;
        int64_t pins, state, old, hits;
        uint64_t rec;
        if (field(n->device_pins, &pins) || field(n->device_state, &state) || field(n->record, &old))
            goto fail;
        int64_t now = pins + delta;
        if (set_int(&n->device_pins, now) < 0)
            goto fail;
        if (state == 2)
            evictable += (now == 0) - (pins == 0);
        if (state != 0)
            protected_ += (now > 0) - (pins > 0);
        if (stamp) {
            Py_INCREF(clock);
            Py_SETREF(n->last_access, clock);
        }
        if (hit && (field(n->hits, &hits) || set_int(&n->hits, hits + 1) < 0))
            goto fail;
        if (record_any(item, &rec) < 0 || set_int(&n->record, (int64_t)rec) < 0)
            goto fail;
        value += rec - (uint64_t)old;
        if (may_offer(n, state, now)) {
            PyObject *r = PyObject_CallOneArg(offer, item);
            if (r == NULL)
                goto fail;
            Py_DECREF(r);
        }
    }
    Py_DECREF(seq);
    return Py_BuildValue("KLL", value & DIGEST_MASK, (long long)evictable, (long long)protected_);
fail:
    Py_DECREF(seq);
    return NULL;
}

/* terms(lease_id, kind, keys) -> the sum (mod 2**62) of holdings' per-entry terms: XXH3 of the
 * little-endian (lease_id, kind, key) of each key: a page, or a node's id. */
static PyObject *py_terms(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "terms takes 3 arguments, not %zd", nargs);
    long long lease = PyLong_AsLongLong(args[0]), kind = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[2], "terms takes a sequence of keys");
    if (seq == NULL)
        return NULL;
    uint8_t buf[24];
    write64(buf, (uint64_t)lease);
    write64(buf + 8, (uint64_t)kind);
    uint64_t total = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int64_t key;
        int bad;
        if (is_node(item) || PyLong_Check(item)) {
            bad = field(is_node(item) ? ((Node *)item)->node_id : item, &key);
        } else { /* any other node: its node_id */
            PyObject *id = PyObject_GetAttrString(item, "node_id");
            bad = id == NULL || field(id, &key);
            Py_XDECREF(id);
        }
        if (bad) {
            Py_DECREF(seq);
            return NULL;
        }
        write64(buf + 16, (uint64_t)key);
        total += xxh3_17to128(buf, 24) & DIGEST_MASK;
    }
    Py_DECREF(seq);
    return PyLong_FromUnsignedLongLong(total & DIGEST_MASK);
}

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

/* Which heaps a node is a candidate of: 1 device, 2 host (eviction.Candidates.offer's test). */
static int candidacy(PyObject *obj) {
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

/* flags_of(node): ledger.reference_flags_of, evictable | protected << 1 | mirror << 2. */
static PyObject *py_flags_of(PyObject *mod, PyObject *node) {
    if (!is_node(node))
        return PyErr_Format(PyExc_TypeError, "flags_of takes a native Node, not %.100s", Py_TYPE(node)->tp_name);
    Node *n = (Node *)node;
    int64_t ds, dp, hs, ss;
    if (field(n->device_state, &ds) || field(n->device_pins, &dp) || field(n->host_state, &hs) ||
        field(n->storage_state, &ss))
        return NULL;
    long bits = (ds == 2 && dp == 0) | (ds != 0 && dp > 0) << 1 | (ds == 2 && hs == 2 && ss == 2) << 2;
    return PyLong_FromLong(bits);
}

PyMethodDef account_methods[] = {
    {"record_of", (PyCFunction)py_record_of, METH_O, "A node's digest record (ledger.record_of)."},
    {"set_record_fallback", (PyCFunction)py_set_record_fallback, METH_O,
     "The reference record, for nodes with components or reference nodes."},
    {"touch", (PyCFunction)(void (*)(void))py_touch, METH_FASTCALL, "Ledger.touch's loop over a path."},
    {"terms", (PyCFunction)(void (*)(void))py_terms, METH_FASTCALL, "The sum of holdings' terms for keys (nodes or ints)."},
    {"set_candidacy", (PyCFunction)(void (*)(void))py_set_candidacy, METH_FASTCALL,
     "eviction's is_device_candidate, is_host_candidate and host_subtree_droppable."},
    {"offer", (PyCFunction)(void (*)(void))py_offer, METH_FASTCALL, "eviction.Candidates.offer (see there)."},
    {"offer_around", (PyCFunction)(void (*)(void))py_offer_around, METH_FASTCALL,
     "eviction.Candidates.offer_around (see there)."},
    {"pop", (PyCFunction)(void (*)(void))py_pop, METH_FASTCALL, "eviction.Candidates._pop (see there)."},
    {"flags_of", (PyCFunction)py_flags_of, METH_O, "ledger.reference_flags_of (see there)."},
    {"xxh3_17to128", (PyCFunction)py_xxh3, METH_O, "XXH3-64 of 17 to 128 bytes (for the tests)."},
    {NULL, NULL, 0, NULL},
};
