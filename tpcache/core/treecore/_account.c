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

/* The 64 bytes a record hashes first: a node's fields, little-endian, as accounting.reference_record_of
 * packs them. */
static void pack_fields(const Fields *f, uint8_t buf[64]) {
    write64(buf, f->hash);
    write64(buf + 8, (uint64_t)(f->ds | f->hs << 2 | f->ss << 4));
    write64(buf + 16, (uint64_t)f->device_page);
    write64(buf + 24, (uint64_t)f->host_slot);
    write64(buf + 32, (uint64_t)f->dp << 32 | (uint64_t)f->hp);
    write64(buf + 40, (uint64_t)f->last);
    write64(buf + 48, (uint64_t)f->hits);
    write64(buf + 56, (uint64_t)f->created);
}

uint64_t record_fields(const Fields *f) {
    uint8_t buf[64];
    pack_fields(f, buf);
    return XXH3_64bits(buf, 64) & DIGEST_MASK;
}

/* A native node's fields as its record packs them. */
static void node_fields(const Node *n, Fields *f) {
    *f = (Fields){.hash = n->hash, .ds = n->device_state, .hs = n->host_state, .ss = n->storage_state,
                  .device_page = n->device_page, .host_slot = n->host_slot, .dp = n->device_pins,
                  .hp = n->host_pins, .last = n->last_access, .hits = n->hits, .created = n->created_at};
}

uint64_t record_native(const Node *n) {
    Fields f;
    node_fields(n, &f);
    return record_fields(&f);
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
    Fields f;
    int rc = 0;
    node_fields(n, &f);
    pack_fields(&f, buf);
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
    if (((Node *)node)->comp == Py_None) {
        *out = record_native((Node *)node);
        return 0;
    }
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

/* The nodes of the path a touch finds, kept between calls (grown to the longest path touched; no
 * Python code runs during a touch, so no touch starts inside another). */
static Node **path_nodes = NULL;
static Py_ssize_t path_room = 0;

/* The nodes of ``ids`` found by following parents up from the last one's (found in ``tree_nodes``)
 * for as long as each parent's id is the next id down, into ``found``; the rest are left NULL (the
 * caller looks those up, and reports what the lookup finds wrong). A path costs one lookup in the
 * tree's table, not one a page. Pure. */
static void path_up(NodeTable *tree_nodes, PyObject *const *ids, Py_ssize_t n, Node **found) {
    memset(found, 0, (size_t)n * sizeof(Node *));
    Node *last = PyLong_CheckExact(ids[n - 1]) ? table_find(tree_nodes, ids[n - 1]) : NULL;
    if (last == NULL) {
        PyErr_Clear();
        return;
    }
    found[n - 1] = last;
    for (Py_ssize_t i = n - 2; i >= 0; i--) {
        PyObject *up = found[i + 1]->parent;
        int64_t id;
        if (!is_node(up) || !PyLong_CheckExact(ids[i]) || field(ids[i], &id) < 0 || ((Node *)up)->node_id != id) {
            PyErr_Clear(); /* (an id past int64 is no node's: the caller reports it) */
            return;
        }
        found[i] = (Node *)up;
    }
}

/* touch(tree_nodes, ids, device_pins, stamp, hit, clock, digest, candidates) -> (digest, evictable
 * delta, protected delta, unresident): Ledger.touch's loop (see there) over the nodes ``ids`` name
 * in the tree's NodeTable (``tree_nodes`` None: ``ids`` holds the nodes themselves, a walk's), each
 * offered to ``candidates`` as Candidates.offer does (``lazy_offer``), its heaps loaded at the first
 * push; ``unresident``: the ids of those with no copy on device or host, in order (``unresident``'s
 * filter in the same pass). A KeyError names an id not in the tree. */
static PyObject *py_touch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8)
        return PyErr_Format(PyExc_TypeError, "touch takes 8 arguments, not %zd", nargs);
    if (!is_table(args[0]) && args[0] != Py_None)
        return PyErr_Format(PyExc_TypeError, "touch takes the tree's NodeTable (or None)");
    NodeTable *tree_nodes = args[0] == Py_None ? NULL : (NodeTable *)args[0];
    long long delta = PyLong_AsLongLong(args[2]);
    int stamp = PyObject_IsTrue(args[3]), hit = PyObject_IsTrue(args[4]);
    PyObject *clock = args[5];
    LazyHeaps heaps = {.cands = args[7]};
    unsigned long long value = PyLong_AsUnsignedLongLongMask(args[6]);
    if (PyErr_Occurred() || stamp < 0 || hit < 0)
        return NULL;
    /* A list (a lease's holding is a list subclass) is read in place, its length read again each
     * turn: PySequence_Fast would copy it. */
    PyObject *seq = PyList_Check(args[1]) ? Py_NewRef(args[1]) : PySequence_Fast(args[1], "touch takes a sequence of node ids");
    PyObject *gone = seq ? PyList_New(0) : NULL;
    if (seq == NULL || gone == NULL) {
        Py_XDECREF(seq);
        Py_XDECREF(gone);
        return NULL;
    }
    int64_t evictable = 0, protected_ = 0, stamp_value = 0;
    if (stamp && field(clock, &stamp_value) < 0) /* (read before any node changes) */
        goto fail;
    /* A touch changes no parent and no entry of the tree's NodeTable: the nodes found first stay theirs. */
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    int by_id = tree_nodes != NULL && count > 0;
    if (by_id && count > path_room) {
        Node **grown = PyMem_Realloc(path_nodes, (size_t)count * sizeof(Node *));
        if (grown == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        path_nodes = grown;
        path_room = count;
    }
    Node **found = path_nodes;
    if (by_id)
        path_up(tree_nodes, PySequence_Fast_ITEMS(seq), count, found);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i), *item = key;
        if (by_id && i < count && found[i] != NULL)
            item = (PyObject *)found[i];
        else if (tree_nodes != NULL && !PyLong_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError, "touch: a node id (an int)");
            goto fail;
        } else if (tree_nodes != NULL && (item = (PyObject *)table_find(tree_nodes, key)) == NULL) { /* borrowed */
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, key);
            goto fail;
        }
        if (!is_node(item)) {
            PyErr_SetString(PyExc_TypeError, "touch: a native Node");
            goto fail;
        }
        Node *n = (Node *)item;
        Fields f; /* read once: the record is made from them as they change */
        uint64_t rec, old = n->record;
        node_fields(n, &f);
        int64_t pins = f.dp, state = f.ds;
        if (state == 0 && f.hs == 0 && append_id(gone, n->node_id) < 0)
            goto fail;
        int64_t now = f.dp = pins + delta;
        if (set_pins(&n->device_pins, now) < 0)
            goto fail;
        if (state == 2)
            evictable += (now == 0) - (pins == 0);
        if (state != 0)
            protected_ += (now > 0) - (pins > 0);
        if (stamp)
            n->last_access = f.last = stamp_value;
        if (hit)
            n->hits = ++f.hits;
        if (n->comp == Py_None)
            rec = record_fields(&f);
        else if (record_any(item, &rec) < 0)
            goto fail;
        n->record = rec;
        value += rec - old;
        /* candidacy's own gate on the fields just read: a pinned path, a lock's, offers nothing
         * and is not read again. */
        if (may_be_candidate(f.ds, f.dp, f.hs, f.hp) && lazy_offer(&heaps, item) < 0)
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
    return PyLong_FromLong(node_flags((Node *)node));
}

/* unresident(tree_nodes, ids) -> those of ``ids`` whose node in the tree's NodeTable has no copy on
 * device or host (both states 0), in order; an id not in the tree is left out (it holds nothing):
 * the filter a release runs over its path and a completion over its op's pages (accounting.unresident). */
static PyObject *py_unresident(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !is_table(args[0]))
        return PyErr_Format(PyExc_TypeError, "unresident takes the tree's NodeTable and a sequence of ids");
    /* A list is read in place (as in touch), its length read again each turn. */
    PyObject *seq = PyList_Check(args[1]) ? Py_NewRef(args[1]) : PySequence_Fast(args[1], "unresident takes a sequence of node ids");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyLong_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError, "unresident: a node id (an int)");
            goto fail;
        }
        PyObject *item = (PyObject *)table_find((NodeTable *)args[0], key); /* borrowed */
        if (item == NULL && PyErr_Occurred())
            goto fail;
        if (item == NULL)
            continue;
        if (!is_node(item)) {
            PyErr_SetString(PyExc_TypeError, "unresident: a native Node");
            goto fail;
        }
        if (((Node *)item)->device_state == 0 && ((Node *)item)->host_state == 0 && PyList_Append(out, key) < 0)
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
    {"touch", (PyCFunction)(void (*)(void))py_touch, METH_FASTCALL, "Ledger.touch's loop over a path."},
    {"mix", (PyCFunction)(void (*)(void))py_mix, METH_FASTCALL, "digest.mix (see there)."},
    {"flags_of", (PyCFunction)py_flags_of, METH_O, "accounting.reference_flags_of (see there)."},
    {NULL, NULL, 0, NULL},
};
