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
    /* A list (a lease's holding is a list subclass) is read in place, its length read again each
     * turn (an offer may run Python): PySequence_Fast would copy it. */
    PyObject *seq = PyList_Check(args[0]) ? Py_NewRef(args[0]) : PySequence_Fast(args[0], "touch takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    int64_t evictable = 0, protected_ = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
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

/* unresident(nodes) -> the nodes with no copy on device or host (both states 0), in order: the
 * filter a release runs over its path and a completion over its op's pages (accounting.unresident).
 * Reference nodes are tested as the reference does. */
static PyObject *py_unresident(PyObject *mod, PyObject *nodes) {
    /* A list is read in place (as in touch), its length read again each turn. */
    PyObject *seq = PyList_Check(nodes) ? Py_NewRef(nodes) : PySequence_Fast(nodes, "unresident takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int keep;
        if (is_node(item)) {
            int64_t ds, hs;
            if (field(((Node *)item)->device_state, &ds) || field(((Node *)item)->host_state, &hs))
                goto fail;
            keep = ds == 0 && hs == 0;
        } else {
            PyObject *d = PyObject_GetAttrString(item, "device_state");
            int on = d ? PyObject_IsTrue(d) : -1;
            Py_XDECREF(d);
            if (on == 0) {
                PyObject *h = PyObject_GetAttrString(item, "host_state");
                on = h ? PyObject_IsTrue(h) : -1;
                Py_XDECREF(h);
            }
            if (on < 0)
                goto fail;
            keep = !on;
        }
        if (keep && PyList_Append(out, item) < 0)
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
    {"set_record_fallback", (PyCFunction)py_set_record_fallback, METH_O,
     "The reference record, for nodes with components or reference nodes."},
    {"touch", (PyCFunction)(void (*)(void))py_touch, METH_FASTCALL, "Ledger.touch's loop over a path."},
    {"mix", (PyCFunction)(void (*)(void))py_mix, METH_FASTCALL, "digest.mix (the reference for fields it does not take)."},
    {"fold_leases", (PyCFunction)(void (*)(void))py_fold_leases, METH_FASTCALL,
     "Ledger.record_leases's loop: leases re-recorded in the state and kept digests."},
    {"set_mix_fallback", (PyCFunction)py_set_mix_fallback, METH_O, "The reference mix, for fields the kernel does not take."},
    {"flags_of", (PyCFunction)py_flags_of, METH_O, "accounting.reference_flags_of (see there)."},
    {NULL, NULL, 0, NULL},
};
