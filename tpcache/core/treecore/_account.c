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

/* The record of a native node without components: 0 and an exception on a field that is not an int. */
static int node_fields(Node *n, uint8_t buf[64]) {
    int64_t ds, hs, ss, dp, hp, last, hits, created;
    if (field(n->device_state, &ds) || field(n->host_state, &hs) || field(n->storage_state, &ss) ||
        field(n->device_pins, &dp) || field(n->host_pins, &hp) || field(n->last_access, &last) ||
        field(n->hits, &hits) || field(n->created_at, &created))
        return -1;
    write64(buf, n->hash);
    write64(buf + 8, (uint64_t)(ds | hs << 2 | ss << 4));
    write64(buf + 16, (uint64_t)n->device_page);
    write64(buf + 24, (uint64_t)n->host_slot);
    write64(buf + 32, (uint64_t)dp << 32 | (uint64_t)hp);
    write64(buf + 40, (uint64_t)last);
    write64(buf + 48, (uint64_t)hits);
    write64(buf + 56, (uint64_t)created);
    return 0;
}

int record_native(Node *n, uint64_t *out) {
    uint8_t buf[64];
    if (node_fields(n, buf) < 0)
        return -1;
    *out = XXH3_64bits(buf, 64) & DIGEST_MASK;
    return 0;
}

enum { COMP_ON_STACK = 64 }; /* component fields packed on the stack (8 components); more: the heap */

/* The record of a node with a component record (a list of ints): its fields and then each component
 * field as a little-endian int64, as accounting.reference_record_of packs them. */
static int record_with_parts(Node *n, uint64_t *out) {
    PyObject *rec = n->comp;
    if (!PyList_Check(rec)) {
        PyErr_Format(PyExc_TypeError, "a node's component record is a list of ints, not %.100s", Py_TYPE(rec)->tp_name);
        return -1;
    }
    Py_ssize_t count = PyList_GET_SIZE(rec);
    uint8_t stack[64 + 8 * COMP_ON_STACK], *buf = count <= COMP_ON_STACK ? stack : PyMem_Malloc(64 + 8 * (size_t)count);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = node_fields(n, buf);
    for (Py_ssize_t i = 0; rc == 0 && i < count; i++) {
        PyObject *v = PyList_GET_ITEM(rec, i);
        int overflow = 0;
        long long x = PyLong_Check(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : 0;
        if (!PyLong_Check(v) || overflow) {
            PyErr_Format(PyLong_Check(v) ? PyExc_OverflowError : PyExc_TypeError,
                         "a component record's field %zd is not an int64", i);
            rc = -1;
        } else
            write64(buf + 64 + 8 * i, (uint64_t)x);
    }
    if (rc == 0)
        *out = XXH3_64bits(buf, 64 + 8 * (size_t)count) & DIGEST_MASK;
    if (buf != stack)
        PyMem_Free(buf);
    return rc;
}

int record_any(PyObject *node, uint64_t *out) {
    if (!is_node(node)) {
        PyErr_Format(PyExc_TypeError, "record_of takes a native Node, not %.100s", Py_TYPE(node)->tp_name);
        return -1;
    }
    if (((Node *)node)->comp == Py_None)
        return record_native((Node *)node, out);
    return record_with_parts((Node *)node, out);
}

static PyObject *py_record_of(PyObject *mod, PyObject *node) {
    uint64_t r;
    if (record_any(node, &r) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(r);
}

/* mix(*fields): digest.mix, XXH3-64 of up to eight int fields packed as "<QqqqqqqQ" (the first and
 * last unsigned, the rest signed; unused fields zero), masked to 62 bits. Bad fields raise what
 * digest.reference_mix raises for them (digest.bad_fields): TypeError for more than eight or one
 * that is not an int, OverflowError for one out of its range. */
static PyObject *py_mix(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 8)
        return PyErr_Format(PyExc_TypeError, "mix takes at most 8 fields, not %zd", nargs);
    uint8_t buf[64] = {0};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (!PyLong_Check(args[i]))
            return PyErr_Format(PyExc_TypeError, "mix: field %zd is not an int", i);
        uint64_t v;
        int overflow = 0;
        if (i == 0 || i == 7) {
            v = PyLong_AsUnsignedLongLong(args[i]);
            overflow = v == (uint64_t)-1 && PyErr_Occurred();
        } else
            v = (uint64_t)PyLong_AsLongLongAndOverflow(args[i], &overflow);
        if (overflow) {
            PyErr_Clear();
            return PyErr_Format(PyExc_OverflowError, "mix: field %zd is out of range (%s)", i,
                                i == 0 || i == 7 ? "uint64" : "int64");
        }
        write64(buf + 8 * i, v);
    }
    return PyLong_FromUnsignedLongLong(XXH3_64bits(buf, 64) & DIGEST_MASK);
}

/* touch(nodes, device_pins, stamp, hit, clock, digest, candidates) -> (digest, evictable delta,
 * protected delta): Ledger.touch's loop (see there), each node offered to ``candidates`` as
 * Candidates.offer does (``lazy_offer``), its heaps loaded at the first push. */
static PyObject *py_touch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7)
        return PyErr_Format(PyExc_TypeError, "touch takes 7 arguments, not %zd", nargs);
    long long delta = PyLong_AsLongLong(args[1]);
    int stamp = PyObject_IsTrue(args[2]), hit = PyObject_IsTrue(args[3]);
    PyObject *clock = args[4];
    LazyHeaps heaps = {.cands = args[6]};
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
        int64_t pins, state, hits;
        uint64_t rec, old = n->record;
        if (field(n->device_pins, &pins) || field(n->device_state, &state))
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
    return Py_BuildValue("KLL", value & DIGEST_MASK, (long long)evictable, (long long)protected_);
fail:
    lazy_clear(&heaps);
    Py_DECREF(seq);
    return NULL;
}

/* ------------------------------------------------------------------ lease records */

static PyObject *s_lease_id, *s_device_nodes, *s_host_nodes, *s_pages, *s_ops, *s_releasing, *s_cursor,
    *s_prefetch, *s_admission, *s_parts, *s_hit_pages, *s_record, *s_kept, *s_total, *s_node_id;

static int load_lease_names(void) {
    if (s_node_id != NULL)
        return 0;
    if (INTERN(lease_id) || INTERN(device_nodes) || INTERN(host_nodes) || INTERN(pages) || INTERN(ops) ||
        INTERN(releasing) || INTERN(cursor) || INTERN(prefetch) || INTERN(admission) || INTERN(parts) ||
        INTERN(hit_pages) || INTERN(record) || INTERN(kept) || INTERN(total) || INTERN(node_id))
        return -1;
    return 0;
}

/* An int attribute of ``o`` (``sub`` of it when given: lease.pages.total): 0, or -1 and an exception. */
static int int_attr(PyObject *o, PyObject *name, PyObject *sub, int64_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (sub == s_total && is_holding(v)) { /* a native holding's total, read without an int object */
        *out = (int64_t)((Holding *)v)->total;
        Py_DECREF(v);
        return 0;
    }
    if (v != NULL && sub != NULL)
        Py_SETREF(v, PyObject_GetAttr(v, sub));
    int rc = v == NULL ? -1 : field(v, out);
    Py_XDECREF(v);
    return rc;
}

/* 1: o.name is None or empty (no prefetch, no admission, no ops, no parts), 0: it is not, -1: an error. */
static int attr_empty(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int empty = v == Py_None ? 1 : PyObject_Not(v);
    Py_DECREF(v);
    return empty;
}

/* The records of a lease with no prefetch, admission, ops, components or protected hit
 * (accounting.lease_record, and the kept record of Leases.records): 1 with them set, 0 for any
 * other lease (the reference's), -1 and an exception. */
static int simple_lease(PyObject *lease, uint64_t tag, uint64_t no_ids, uint64_t *record, uint64_t *kept) {
    int e;
    PyObject *names[4] = {s_prefetch, s_admission, s_ops, s_parts};
    for (int i = 0; i < 4; i++)
        if ((e = attr_empty(lease, names[i])) <= 0)
            return e;
    int64_t id, dn, hn, pages, hit, releasing;
    if (int_attr(lease, s_hit_pages, NULL, &hit) || int_attr(lease, s_lease_id, NULL, &id) ||
        int_attr(lease, s_device_nodes, s_total, &dn) || int_attr(lease, s_host_nodes, s_total, &hn) ||
        int_attr(lease, s_pages, s_total, &pages))
        return -1;
    if (hit != 0)
        return 0;
    PyObject *r = PyObject_GetAttr(lease, s_releasing), *cursor = r ? PyObject_GetAttr(lease, s_cursor) : NULL;
    releasing = r ? PyObject_IsTrue(r) : -1;
    int64_t at = -1;
    int bad = cursor == NULL || releasing < 0 || (cursor != Py_None && int_attr(cursor, s_node_id, NULL, &at));
    Py_XDECREF(r);
    Py_XDECREF(cursor);
    if (bad)
        return -1;
    uint8_t buf[64];
    write64(buf, tag);
    write64(buf + 8, (uint64_t)id);
    write64(buf + 16, (uint64_t)dn);
    write64(buf + 24, (uint64_t)hn);
    write64(buf + 32, (uint64_t)pages);
    write64(buf + 40, no_ids);
    write64(buf + 48, (uint64_t)(releasing | (at + 1) << 1));
    write64(buf + 56, no_ids);
    *record = XXH3_64bits(buf, 64) & DIGEST_MASK;
    *kept = 0;
    if (!releasing) {
        memset(buf, 0, sizeof buf);
        write64(buf, (uint64_t)id);
        write64(buf + 8, (uint64_t)pages);
        *kept = XXH3_64bits(buf, 64) & DIGEST_MASK;
    }
    return 1;
}

/* Replace lease.<name> (an int record) with ``now``; ``*sum`` (mod 2**62) follows. */
static int swap_record(PyObject *lease, PyObject *name, uint64_t now, uint64_t *sum) {
    int64_t old;
    if (int_attr(lease, name, NULL, &old) < 0)
        return -1;
    PyObject *v = PyLong_FromUnsignedLongLong(now);
    int rc = v == NULL ? -1 : PyObject_SetAttr(lease, name, v);
    Py_XDECREF(v);
    *sum = (*sum - (uint64_t)old + now) & DIGEST_MASK;
    return rc;
}

/* fold_leases(leases, digest, kept_digest, tag, no_ids, records) -> (digest, kept_digest): Ledger.record_leases's
 * loop, re-recording each lease in both sums; ``records(lease)`` gives (record, kept) for the leases the kernel
 * does not take. */
static PyObject *py_fold_leases(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6)
        return PyErr_Format(PyExc_TypeError, "fold_leases takes 6 arguments, not %zd", nargs);
    uint64_t value = PyLong_AsUnsignedLongLongMask(args[1]), kept_sum = PyLong_AsUnsignedLongLongMask(args[2]);
    uint64_t tag = PyLong_AsUnsignedLongLongMask(args[3]), no_ids = PyLong_AsUnsignedLongLongMask(args[4]);
    if (PyErr_Occurred() || load_lease_names() < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "fold_leases takes a sequence of leases");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *lease = PySequence_Fast_GET_ITEM(seq, i);
        uint64_t record, kept;
        int simple = simple_lease(lease, tag, no_ids, &record, &kept);
        if (simple == 0) {
            PyObject *both = PyObject_CallOneArg(args[5], lease);
            if (both == NULL || !PyArg_ParseTuple(both, "KK", &record, &kept)) {
                Py_XDECREF(both);
                goto fail;
            }
            Py_DECREF(both);
        } else if (simple < 0)
            goto fail;
        if (swap_record(lease, s_record, record, &value) < 0 || swap_record(lease, s_kept, kept, &kept_sum) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return Py_BuildValue("KK", (unsigned long long)value, (unsigned long long)kept_sum);
fail:
    Py_DECREF(seq);
    return NULL;
}

int holding_term(int64_t lease, int64_t kind, PyObject *item, uint64_t *out) {
    int64_t key;
    if (is_node(item) || PyLong_Check(item)) {
        if (field(is_node(item) ? ((Node *)item)->node_id : item, &key) < 0)
            return -1;
    } else { /* any other node: its node_id */
        PyObject *id = PyObject_GetAttrString(item, "node_id");
        int bad = id == NULL || field(id, &key) < 0;
        Py_XDECREF(id);
        if (bad)
            return -1;
    }
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

/* unresident(nodes) -> the native nodes with no copy on device or host (both states 0), in order: the
 * filter a release runs over its path and a completion over its op's pages (accounting.unresident). */
static PyObject *py_unresident(PyObject *mod, PyObject *nodes) {
    PyObject *seq = PySequence_Fast(nodes, "unresident takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t count = out ? PySequence_Fast_GET_SIZE(seq) : 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int64_t ds, hs;
        if (!is_node(item)) {
            PyErr_Format(PyExc_TypeError, "unresident takes native Nodes, not %.100s", Py_TYPE(item)->tp_name);
            goto fail;
        }
        if (field(((Node *)item)->device_state, &ds) || field(((Node *)item)->host_state, &hs))
            goto fail;
        if (ds == 0 && hs == 0 && PyList_Append(out, item) < 0)
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
    {"unresident", (PyCFunction)py_unresident, METH_O, "The nodes with no copy on device or host (accounting.unresident)."},
    {"record_of", (PyCFunction)py_record_of, METH_O, "A node's digest record (accounting.record_of)."},
    {"touch", (PyCFunction)(void (*)(void))py_touch, METH_FASTCALL, "Ledger.touch's loop over a path."},
    {"mix", (PyCFunction)(void (*)(void))py_mix, METH_FASTCALL, "digest.mix (see there)."},
    {"fold_leases", (PyCFunction)(void (*)(void))py_fold_leases, METH_FASTCALL,
     "Ledger.record_leases's loop: leases re-recorded in the state and kept digests."},
    {"flags_of", (PyCFunction)py_flags_of, METH_O, "accounting.reference_flags_of (see there)."},
    {NULL, NULL, 0, NULL},
};
