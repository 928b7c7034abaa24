/* The ledger's per-node kernels in C: a node's digest record and counter flags, the pins, stamps
 * and hits of a path (Ledger.touch) and a holding's digest terms (the candidates' kernels are in
 * _candidates.c). accounting.py, ledger.py and holdings.py keep the Python versions as the
 * reference; tests hold the two equal (same records, digests, counters).
 *
 * Records are XXH3-64 (seed 0) of the same little-endian fields the reference packs, computed by
 * xxHash itself (_hash.h), so digests do not depend on which path computed them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_node.h"
#include "_hash.h"

/* A little-endian 64-bit store: one instruction on a little-endian host. */
static inline void write64(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

/* The reference record (accounting.reference_record_of), called for what the kernel does not cover: a node with a
 * component record, or a reference node. Set once by accounting.py. */
static PyObject *record_fallback = NULL;

/* The record of a native node without components: 0 and an exception on a field that is not an int. */
int record_native(Node *n, uint64_t *out) {
    int64_t ds, hs, ss, dp, hp, last, hits, created;
    if (field(n->device_state, &ds) || field(n->host_state, &hs) || field(n->storage_state, &ss) ||
        field(n->device_pins, &dp) || field(n->host_pins, &hp) || field(n->last_access, &last) ||
        field(n->hits, &hits) || field(n->created_at, &created))
        return -1;
    uint8_t buf[64];
    write64(buf, n->hash);
    write64(buf + 8, (uint64_t)(ds | hs << 2 | ss << 4));
    write64(buf + 16, (uint64_t)n->device_page);
    write64(buf + 24, (uint64_t)n->host_slot);
    write64(buf + 32, (uint64_t)dp << 32 | (uint64_t)hp);
    write64(buf + 40, (uint64_t)last);
    write64(buf + 48, (uint64_t)hits);
    write64(buf + 56, (uint64_t)created);
    *out = XXH3_64bits(buf, 64) & DIGEST_MASK;
    return 0;
}

int record_any(PyObject *node, uint64_t *out) {
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

static PyObject *mix_fallback = NULL; /* digest.reference_mix, set once by digest.py */

/* The reference's answer (its value, or what it raises) for fields the kernel does not take. */
static PyObject *mix_by_reference(PyObject *const *args, Py_ssize_t nargs) {
    if (mix_fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_node.mix: no reference mix set");
        return NULL;
    }
    return PyObject_Vectorcall(mix_fallback, args, (size_t)nargs, NULL);
}

/* mix(*fields): digest.mix, XXH3-64 of up to eight fields packed as "<QqqqqqqQ" (the first and
 * last unsigned, the rest signed; unused fields zero), masked to 62 bits. A field that does not
 * fit or is not an int goes to the reference, which raises what it raises. */
static PyObject *py_mix(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 8)
        return mix_by_reference(args, nargs);
    uint8_t buf[64] = {0};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (!PyLong_Check(args[i]))
            return mix_by_reference(args, nargs);
        uint64_t v;
        if (i == 0 || i == 7) {
            v = PyLong_AsUnsignedLongLong(args[i]);
        } else {
            int overflow;
            v = (uint64_t)PyLong_AsLongLongAndOverflow(args[i], &overflow);
            if (overflow)
                return mix_by_reference(args, nargs);
        }
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return mix_by_reference(args, nargs);
        }
        write64(buf + 8 * i, v);
    }
    return PyLong_FromUnsignedLongLong(XXH3_64bits(buf, 64) & DIGEST_MASK);
}

static PyObject *py_set_mix_fallback(PyObject *mod, PyObject *fn) {
    Py_INCREF(fn);
    Py_XSETREF(mix_fallback, fn);
    Py_RETURN_NONE;
}

/* touch(tree_nodes, ids, device_pins, stamp, hit, clock, digest, candidates) -> (digest, evictable
 * delta, protected delta, unresident): Ledger.touch's loop (see there) over the nodes ``ids`` name
 * in the tree's nodes dict (``tree_nodes`` None: ``ids`` holds the nodes themselves, a walk's), each
 * offered to ``candidates`` as Candidates.offer does (``lazy_offer``), its heaps loaded at the first
 * push; ``unresident``: the ids of those with no copy on device or host, in order (``unresident``'s
 * filter in the same pass). A KeyError names an id not in the tree. */
static PyObject *py_touch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8)
        return PyErr_Format(PyExc_TypeError, "touch takes 8 arguments, not %zd", nargs);
    if (!PyDict_CheckExact(args[0]) && args[0] != Py_None)
        return PyErr_Format(PyExc_TypeError, "touch takes the tree's nodes dict (or None)");
    PyObject *tree_nodes = args[0];
    long long delta = PyLong_AsLongLong(args[2]);
    int stamp = PyObject_IsTrue(args[3]), hit = PyObject_IsTrue(args[4]);
    PyObject *clock = args[5];
    LazyHeaps heaps = {.cands = args[7]};
    unsigned long long value = PyLong_AsUnsignedLongLongMask(args[6]);
    if (PyErr_Occurred() || stamp < 0 || hit < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "touch takes a sequence of node ids"), *gone = PyList_New(0);
    if (seq == NULL || gone == NULL) {
        Py_XDECREF(seq);
        Py_XDECREF(gone);
        return NULL;
    }
    int64_t evictable = 0, protected_ = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i), *item = key;
        if (tree_nodes != Py_None && !PyLong_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError, "touch: a node id (an int)");
            goto fail;
        }
        if (tree_nodes != Py_None && (item = PyDict_GetItemWithError(tree_nodes, key)) == NULL) { /* borrowed */
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, key);
            goto fail;
        }
        if (!is_node(item)) {
            PyErr_SetString(PyExc_TypeError, "touch: a native Node");
            goto fail;
        }
        Node *n = (Node *)item;
        int64_t pins, state, hits, host;
        uint64_t rec, old = n->record;
        if (field(n->device_pins, &pins) || field(n->device_state, &state) || field(n->host_state, &host))
            goto fail;
        if (state == 0 && host == 0 && PyList_Append(gone, n->node_id) < 0)
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
        if (record_any(item, &rec) < 0)
            goto fail;
        n->record = rec;
        value += rec - old;
        if (lazy_offer(&heaps, item) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    lazy_clear(&heaps);
    return Py_BuildValue("KLLN", value & DIGEST_MASK, (long long)evictable, (long long)protected_, gone);
fail:
    lazy_clear(&heaps);
    Py_DECREF(seq);
    Py_DECREF(gone);
    return NULL;
}

/* ------------------------------------------------------------------ holdings */

int holding_term(int64_t lease, int64_t kind, PyObject *item, uint64_t *out) {
    int64_t key;
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "a holding's entry is a node id or a page (an int), not %.100s",
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    if (field(item, &key) < 0)
        return -1;
    uint8_t buf[24];
    write64(buf, (uint64_t)lease);
    write64(buf + 8, (uint64_t)kind);
    write64(buf + 16, (uint64_t)key);
    *out = XXH3_64bits(buf, 24) & DIGEST_MASK;
    return 0;
}

/* flags_of(node): accounting.reference_flags_of, evictable | protected << 1 | mirror << 2. */
static PyObject *py_flags_of(PyObject *mod, PyObject *node) {
    if (!is_node(node))
        return PyErr_Format(PyExc_TypeError, "flags_of takes a native Node, not %.100s", Py_TYPE(node)->tp_name);
    int bits;
    return node_flags((Node *)node, &bits) < 0 ? NULL : PyLong_FromLong(bits);
}

/* unresident(tree_nodes, ids) -> those of ``ids`` whose node in the tree's nodes dict has no copy on
 * device or host (both states 0), in order; an id not in the tree is left out (it holds nothing):
 * the filter a release runs over its path and a completion over its op's pages (accounting.unresident). */
static PyObject *py_unresident(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_CheckExact(args[0]))
        return PyErr_Format(PyExc_TypeError, "unresident takes the tree's nodes dict and a sequence of ids");
    PyObject *seq = PySequence_Fast(args[1], "unresident takes a sequence of node ids");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t count = out ? PySequence_Fast_GET_SIZE(seq) : 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyLong_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError, "unresident: a node id (an int)");
            goto fail;
        }
        PyObject *item = PyDict_GetItemWithError(args[0], key); /* borrowed */
        if (item == NULL && PyErr_Occurred())
            goto fail;
        if (item == NULL)
            continue;
        if (!is_node(item)) {
            PyErr_SetString(PyExc_TypeError, "unresident: a native Node");
            goto fail;
        }
        int64_t ds, hs;
        if (field(((Node *)item)->device_state, &ds) || field(((Node *)item)->host_state, &hs))
            goto fail;
        if (ds == 0 && hs == 0 && PyList_Append(out, key) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

PyMethodDef account_methods[] = {
    {"unresident", (PyCFunction)(void (*)(void))py_unresident, METH_FASTCALL,
     "The ids of the nodes with no copy on device or host (accounting.unresident)."},
    {"record_of", (PyCFunction)py_record_of, METH_O, "A node's digest record (accounting.record_of)."},
    {"set_record_fallback", (PyCFunction)py_set_record_fallback, METH_O,
     "The reference record, for nodes with components or reference nodes."},
    {"touch", (PyCFunction)(void (*)(void))py_touch, METH_FASTCALL, "Ledger.touch's loop over a path."},
    {"mix", (PyCFunction)(void (*)(void))py_mix, METH_FASTCALL, "digest.mix (the reference for fields it does not take)."},
    {"set_mix_fallback", (PyCFunction)py_set_mix_fallback, METH_O, "The reference mix, for fields the kernel does not take."},
    {"flags_of", (PyCFunction)py_flags_of, METH_O, "accounting.reference_flags_of (see there)."},
    {NULL, NULL, 0, NULL},
};
