/* The round's per-step arithmetic in C: the digest of a list of ids (digest.mix_ids), what a rank
 * saw of each completion queue (round.queue_fields), the round vector's (x, -x) pairs
 * (RoundLayout.pack_values), and the event stream's digest terms (events.wire.pair_sum).
 * round.py and round_vector.py keep the Python versions as the reference; tests hold the two equal. */
#include "_node.h"
#include "_hash.h"


/* XXH3 of the ``n`` ids at ``items`` as little-endian int64, mod 2**62: 0, or -1 and an exception
 * (OverflowError for an id outside int64, as array('q') raises). */
static int hash_ids(PyObject *const *items, Py_ssize_t n, uint64_t *out) {
    int64_t local[32] = {0}, *buf = n <= 32 ? local : PyMem_Malloc((size_t)n * 8);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) {
            if (buf != local)
                PyMem_Free(buf);
            return -1;
        }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        v = (long long)__builtin_bswap64((uint64_t)v);
#endif
        buf[i] = (int64_t)v;
    }
    *out = XXH3_64bits(buf, (size_t)n * 8) & DIGEST_MASK;
    if (buf != local)
        PyMem_Free(buf);
    return 0;
}

/* mix_ids(ids) -> digest.mix_ids(ids) for a list or tuple of ints (a copy is hashed: an id's
 * __index__ cannot change the list under the loop). */
static PyObject *py_mix_ids(PyObject *mod, PyObject *ids) {
    if (!PyList_Check(ids) && !PyTuple_Check(ids))
        return PyErr_Format(PyExc_TypeError, "mix_ids takes a list of ints, not %.100s", Py_TYPE(ids)->tp_name);
    PyObject *items = PySequence_Tuple(ids);
    if (items == NULL)
        return NULL;
    uint64_t h;
    int rc = hash_ids(PySequence_Fast_ITEMS(items), PyTuple_GET_SIZE(items), &h);
    Py_DECREF(items);
    return rc < 0 ? NULL : PyLong_FromUnsignedLongLong(h);
}

/* One queue's four fields (round.queue_fields) appended to ``out``, from its ops' ids and page counts
 * (two lists of ints, in the queue's order): 0; 1 when a landed count is not an int64, which the
 * reference (its caller's fallback) reads as it reads it; or -1 and an exception. */
static int one_queue(PyObject *ids, PyObject *sizes, PyObject *landed, PyObject *out) {
    if (!PyList_Check(ids) || !PyList_Check(sizes) || PyList_GET_SIZE(ids) != PyList_GET_SIZE(sizes)) {
        PyErr_SetString(PyExc_TypeError, "queue_fields takes, per queue, a list of op ids and a list of page counts");
        return -1;
    }
    PyObject *copy = PyList_GetSlice(ids, 0, PyList_GET_SIZE(ids)); /* a dict lookup cannot change it */
    if (copy == NULL)
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(copy);
    int64_t done = 0, clean = 0, head = 0;
    int rc = -1;
    for (Py_ssize_t i = 0; i < n && PyList_GET_SIZE(sizes) == n; i++) {
        PyObject *pages = PyDict_GetItemWithError(landed, PyList_GET_ITEM(copy, i)); /* borrowed */
        if (pages == NULL && PyErr_Occurred())
            goto out;
        if (pages == NULL || pages == Py_None)
            break; /* the first op not finished ends the count */
        int overflow = 0;
        long long landed_pages = PyLong_Check(pages) ? PyLong_AsLongLongAndOverflow(pages, &overflow) : 0;
        if (!PyLong_Check(pages) || overflow) {
            rc = 1;
            goto out;
        }
        done++;
        if (i == 0)
            head = landed_pages;
        if (clean == done - 1) {
            int64_t num_pages;
            if (field(PyList_GET_ITEM(sizes, i), &num_pages) < 0)
                goto out;
            clean += landed_pages == num_pages;
        }
    }
    uint64_t digest;
    if (hash_ids(PySequence_Fast_ITEMS(copy), n, &digest) < 0)
        goto out;
    int64_t fields[3] = {done, clean, done ? head : 0};
    PyObject *d = PyLong_FromUnsignedLongLong(digest);
    if (d == NULL || PyList_Append(out, d) < 0) {
        Py_XDECREF(d);
        goto out;
    }
    Py_DECREF(d);
    for (int i = 0; i < 3; i++) {
        PyObject *v = PyLong_FromLongLong(fields[i]);
        if (v == NULL || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            goto out;
        }
        Py_DECREF(v);
    }
    rc = 0;
out:
    Py_DECREF(copy);
    return rc;
}

/* queue_fields(ids, sizes, landed) -> [digest, done, clean, head_acked] per queue, in order, as
 * round.queue_fields computes them: ``ids[q]`` the op ids in queue q, ``sizes[q]`` their pages,
 * ``landed`` a dict: op id -> pages landed. None when a landed count is not an int64 (the caller
 * falls back to the reference). */
static PyObject *py_queue_fields(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[2]) ||
        PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1]))
        return PyErr_Format(PyExc_TypeError, "queue_fields takes two lists (op ids, page counts) and a dict of landed ops");
    PyObject *out = PyList_New(0);
    for (Py_ssize_t q = 0; out != NULL && q < PyList_GET_SIZE(args[0]) && q < PyList_GET_SIZE(args[1]); q++) {
        PyObject *ids = Py_NewRef(PyList_GET_ITEM(args[0], q)), *sizes = Py_NewRef(PyList_GET_ITEM(args[1], q));
        int rc = one_queue(ids, sizes, args[2], out);
        Py_DECREF(ids);
        Py_DECREF(sizes);
        if (rc < 0)
            Py_CLEAR(out);
        else if (rc > 0) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
    }
    return out;
}

/* pack_pairs(values) -> array('q', [x0, -x0, x1, -x1, ...]), what the collective sends (no int
 * object made per element), or None when a value is not an int in [-INT64_MAX, INT64_MAX] (the
 * caller's reference raises the error that names the field). */
static PyObject *py_pack_pairs(PyObject *mod, PyObject *values) {
    if (!PyList_CheckExact(values))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(values);
    PyObject *raw = PyBytes_FromStringAndSize(NULL, 16 * n);
    if (raw == NULL)
        return NULL;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(raw);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(values, i);
        int overflow = 0;
        long long v = PyLong_Check(x) ? PyLong_AsLongLongAndOverflow(x, &overflow) : 0;
        if (!PyLong_Check(x) || overflow || v < -INT64_MAX || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            Py_DECREF(raw);
            Py_RETURN_NONE;
        }
        out[2 * i] = (int64_t)v;
        out[2 * i + 1] = -(int64_t)v;
    }
    PyObject *vector = array_from_bytes("q", raw);
    Py_DECREF(raw);
    return vector;
}

/* pair_sum(hashes, tier) -> the sum mod 2**64 of XXH3-64 of le64(hash) || u8(tier) over the page
 * hashes (the event stream's digest terms, events/wire.py): hashes are uint64; None and an exception
 * for anything else. */
static PyObject *py_pair_sum(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "pair_sum takes 2 arguments (%zd given)", nargs);
    PyObject *seq = PySequence_Fast(args[0], "pair_sum takes a list of page hashes");
    if (seq == NULL)
        return NULL;
    long tier = PyLong_AsLong(args[1]);
    if (tier == -1 && PyErr_Occurred()) {
        Py_DECREF(seq);
        return NULL;
    }
    uint8_t buf[9];
    buf[8] = (uint8_t)tier;
    uint64_t total = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long h = PyLong_AsUnsignedLongLong(items[i]);
        if (h == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        for (int b = 0; b < 8; b++)
            buf[b] = (uint8_t)(h >> (8 * b));
        total += XXH3_64bits(buf, 9);
    }
    Py_DECREF(seq);
    return PyLong_FromUnsignedLongLong(total);
}

PyMethodDef round_methods[] = {
    {"mix_ids", py_mix_ids, METH_O, "digest.mix_ids(ids) in C."},
    {"pair_sum", (PyCFunction)(void (*)(void))py_pair_sum, METH_FASTCALL, "events.wire.pair_sum in C."},
    {"queue_fields", (PyCFunction)(void (*)(void))py_queue_fields, METH_FASTCALL, "round.queue_fields in C."},
    {"pack_pairs", py_pack_pairs, METH_O, "RoundLayout.pack_values' pairs in C, as an array('q') (None: let the reference raise)."},
    {NULL, NULL, 0, NULL},
};
