/* Ledger.settle in C: one agreed tier change applied to each node of a list, in order. */
#include "_node.h"

/* Whether ``old -> new`` is allowed for tier ``t`` (0 device, 1 host, 2 storage): ``allowed[3 t + old]``
 * has bit ``new`` set (tiers.TRANSITIONS, built from the tier tables). */
static int allowed_move(const unsigned char *allowed, int t, int64_t old, int64_t new) {
    return old >= 0 && old < 3 && new >= 0 && new < 3 && (allowed[3 * t + old] >> new & 1);
}

/* ``state`` (a tier state object or None: unchanged) as its value in ``*out``; -1 for None. */
static int target(PyObject *state, int64_t *out) {
    if (state == Py_None) {
        *out = -1;
        return 0;
    }
    return field(state, out);
}

/* settle(nodes, device, host, storage, host_pins, digest, candidates, mirrors, allowed)
 *     -> (digest, evictable delta, protected delta, stopped)
 * For each native node in order, ``Ledger.update(node, device=(device, its page), host=(host, its
 * slot), storage=storage, host_pins=host_pins)`` (None: that tier unchanged): the states set, the
 * record and the mirror index kept, the node offered around. ``stopped``: -1, or the index of the
 * first node the kernel did not change, whose transition the tier tables refuse or which is not a
 * native node; the caller goes on from there with ``update``, which raises what the reference raises. */
static PyObject *py_settle(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9)
        return PyErr_Format(PyExc_TypeError, "settle takes 9 arguments, not %zd", nargs);
    PyObject *states[3] = {args[1], args[2], args[3]}, *mirrors = args[7];
    int64_t want[3], hpins;
    if (target(states[0], &want[0]) || target(states[1], &want[1]) || target(states[2], &want[2]) ||
        field(args[4], &hpins))
        return NULL;
    unsigned long long value = PyLong_AsUnsignedLongLongMask(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyDict_Check(mirrors))
        return PyErr_Format(PyExc_TypeError, "settle: the mirror index is a dict");
    Py_buffer allowed;
    if (PyObject_GetBuffer(args[8], &allowed, PyBUF_SIMPLE) < 0)
        return NULL;
    if (allowed.len != 9) {
        PyBuffer_Release(&allowed);
        return PyErr_Format(PyExc_ValueError, "settle: 9 transition masks, not %zd", allowed.len);
    }
    PyObject *seq = PySequence_Fast(args[0], "settle takes a sequence of nodes");
    if (seq == NULL) {
        PyBuffer_Release(&allowed);
        return NULL;
    }
    LazyHeaps heaps = {.cands = args[6]};
    int64_t evictable = 0, protected_ = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), stopped = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!is_node(item)) {
            stopped = i;
            break;
        }
        Node *n = (Node *)item;
        int8_t *slots[3] = {&n->device_state, &n->host_state, &n->storage_state};
        int ok = 1, was, now;
        for (int t = 0; t < 3 && ok; t++)
            ok = want[t] < 0 || allowed_move(allowed.buf, t, *slots[t], want[t]);
        if (!ok) {
            stopped = i;
            break;
        }
        int32_t pins = n->host_pins;
        if (set_pins(&pins, pins + hpins) < 0) /* (checked before the node changes) */
            goto fail;
        was = node_flags(n);
        for (int t = 0; t < 3; t++) {
            if (want[t] >= 0)
                *slots[t] = (int8_t)want[t]; /* (0-2: allowed_move) */
        }
        n->host_pins = pins;
        uint64_t rec, old = n->record;
        if (record_any(item, &rec) < 0)
            goto fail;
        now = node_flags(n);
        n->record = rec;
        value += rec - old;
        evictable += (now & 1) - (was & 1);
        protected_ += (now >> 1 & 1) - (was >> 1 & 1);
        if ((now ^ was) & 4) {
            PyObject *key = PyLong_FromLongLong(n->node_id);
            int rc = key == NULL ? -1 : now & 4 ? PyDict_SetItem(mirrors, key, item) : PyDict_DelItem(mirrors, key);
            Py_XDECREF(key);
            if (rc < 0)
                goto fail;
        }
        if (lazy_offer_around(&heaps, item) < 0)
            goto fail;
    }
    lazy_clear(&heaps);
    Py_DECREF(seq);
    PyBuffer_Release(&allowed);
    return Py_BuildValue("KLLn", value & DIGEST_MASK, (long long)evictable, (long long)protected_, stopped);
fail:
    lazy_clear(&heaps);
    Py_DECREF(seq);
    PyBuffer_Release(&allowed);
    return NULL;
}

PyMethodDef settle_methods[] = {
    {"settle", (PyCFunction)(void (*)(void))py_settle, METH_FASTCALL, "Ledger.settle's loop over nodes."},
    {NULL, NULL, 0, NULL},
};
