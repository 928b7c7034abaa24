/* Eviction's common case in C: the device leaves that ``Evictor.evict_device`` frees through
 * ``Ledger.drop_device_leaf`` (an unpinned device page with no children, host copy, component or
 * backlog entry, below a device page or the root), popped and dropped in one loop.
 *
 * The first popped candidate that is not such a leaf is handed back to the caller, which treats it
 * as its own loop would and calls again, so the pages freed, their order, the nodes, the digest, the
 * counters and the heaps are those of the reference loop (eviction.py keeps it; the simulator
 * schedules of test_native_nodes and test_native_ledger hold the two equal).
 *
 * A chain goes leaf first, and each parent left a leaf is most often the very next pop (stamped with
 * its child, it is next in LRU and FIFO order): the loop then drops it without the push and pop
 * the reference makes (``offer_parent``), which leaves the heap the same entries, perhaps in
 * another order of heapq's list (test_native_evict_chains). On the conversation trace that is 211k
 * of the 221k parents offered.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "_node.h"

int heaps_next_pop(Heaps *h, Node *node); /* _candidates.c */

/* 1: a leaf drop_device_leaf takes (and not in the backlog, whose pop drop_device counts); 0: not. */
static int plain_leaf(Node *n, PyObject *backlog) {
    if (kids_count(n) != 0 || n->comp != Py_None || !is_node(n->parent))
        return 0;
    if (n->device_state != 2 || n->device_pins != 0 || n->host_state != 0 || n->host_pins != 0)
        return 0;
    Node *parent = (Node *)n->parent;
    PyObject *up = parent->parent;
    if (up != NULL && up != Py_None) { /* not the root (a parent is a Node, or None for the root) */
        /* A chain goes leaf first: the parent's turn reads the next node up (its grandparent
         * here), most often not in the cache; fetch it now, a drop ahead of its use, without
         * reading it here (that read would wait for it). */
        for (size_t at = 0; at < offsetof(Node, tok) + 63; at += 64) /* each line its fields touch */
            __builtin_prefetch((char *)up + at);
        if (parent->device_state != 2)
            return 0;
    }
    if (PyDict_GET_SIZE(backlog) == 0) /* most often: no host tier, or no backup waits */
        return 1;
    PyObject *key = PyLong_FromLongLong(n->node_id);
    int in = key == NULL ? -1 : PyDict_Contains(backlog, key);
    Py_XDECREF(key);
    return in < 0 ? -1 : !in;
}

/* tree.drop_pages: forget the run cache holding the node's device page. */
static int drop_pages(Node *n) {
    if (n->pages_run == Py_None)
        return 0;
    if (run_forget_pages(n->pages_run) < 0)
        return -1;
    Py_SETREF(n->pages_run, Py_NewRef(Py_None));
    return 0;
}

static void set_field(PyObject **slot, PyObject *value) { Py_SETREF(*slot, Py_NewRef(value)); }

enum { BATCH = 4096 }; /* most freed pages joining the free list at once (one growth of it, not one each) */

/* The state drop_leaves works on, read once per call and written back on every way out. */
typedef struct {
    PyObject *owned, *free, *digest, *backlog;
    PyObject *tail; /* a list of the freed pages not yet on the free list, in order (made with room) */
    Py_ssize_t batched, room, left; /* left: pages the call still wants, this one included */
    PyObject *dropped; /* a list each dropped leaf is appended to (the ledger's change feed), or NULL */
    Heaps *heaps;
    uint64_t value;
    long long evictable;
} Pool;

/* The batched pages onto the end of the free list, in the order they were freed: 0, or -1 and an
 * exception (those pages are then lost to the pool, as after any failed append). */
static int flush_pages(Pool *s) {
    PyObject *tail = s->tail;
    if (tail == NULL)
        return 0;
    Py_SET_SIZE(tail, s->batched); /* its filled items (the rest of its room is empty) */
    s->tail = NULL;
    s->batched = s->room = 0;
    Py_ssize_t at = PyList_GET_SIZE(s->free);
    int rc = PyList_SetSlice(s->free, at, at, tail);
    Py_DECREF(tail);
    return rc;
}

/* A freed page (a new reference, taken) into the batch: 0, or -1 and an exception. */
static int batch_page(Pool *s, PyObject *page, Py_ssize_t left) {
    if (s->batched == s->room && flush_pages(s) < 0) {
        Py_DECREF(page);
        return -1;
    }
    if (s->tail == NULL && left <= 1) { /* the call's last page (most calls under write-back free one) */
        int rc = PyList_Append(s->free, page);
        Py_DECREF(page);
        return rc;
    }
    if (s->tail == NULL) {
        s->room = left > BATCH ? BATCH : left;
        if ((s->tail = PyList_New(s->room)) == NULL) {
            s->room = 0;
            Py_DECREF(page);
            return -1;
        }
    }
    PyList_SET_ITEM(s->tail, s->batched++, page);
    return 0;
}

/* Offer the parent of a leaf just dropped, as drop_device_leaf does; with ``take`` (the loop pops
 * again) a parent that is now a plain leaf and would be the next pop is handed back in ``*next``
 * instead of pushed and popped: the loop drops the same node next and the heap holds the same
 * entries (a chain goes leaf first, and each parent, stamped with its child, is next in line). */
static int offer_parent(Pool *s, Node *parent, int take, PyObject **next) {
    int which = candidacy((PyObject *)parent);
    if (which <= 0)
        return which;
    if (take && which == 1) {
        int plain = plain_leaf(parent, s->backlog);
        int first = plain > 0 ? heaps_next_pop(s->heaps, parent) : plain;
        if (first < 0)
            return -1;
        if (first) {
            *next = Py_NewRef((PyObject *)parent);
            return 0;
        }
    }
    return heaps_offer(s->heaps, (PyObject *)parent);
}

/* Free the device page of a plain leaf and take the leaf out of the tree (drop_device_leaf, then
 * RadixTree.remove_leaf); offer its parent (``offer_parent``). */
static int drop(Pool *s, Node *n, int take, PyObject **next) {
    int64_t page = n->device_page;
    Py_ssize_t size = PyByteArray_GET_SIZE(s->owned);
    char *owned = PyByteArray_AS_STRING(s->owned);
    if (page < 0 || page >= size || !owned[page]) {
        PyErr_Format(PyExc_ValueError, "device pool: page %lld freed but not allocated", (long long)page);
        return -1;
    }
    owned[page] = 0;
    PyObject *freed = PyLong_FromLongLong(page);
    int bad = freed == NULL || batch_page(s, freed, s->left) < 0 || drop_pages(n) < 0; /* listed at a flush */
    if (bad || (s->dropped != NULL && PyList_Append(s->dropped, (PyObject *)n) < 0))
        return -1;
    n->device_state = STATE_NONE;
    n->device_page = -1;
    s->evictable -= 1;
    s->value = (s->value - n->record) & DIGEST_MASK;
    n->record = 0;
    Node *parent = (Node *)Py_NewRef(n->parent);
    int rc = -1;
    if (kids_del(parent, n) < 0 || table_del(s->heaps->nodes, n->node_id) < 0)
        goto done;
    set_field(&n->parent, Py_None);
    set_field(&n->run, Py_None);
    if (kids_count(parent) == 0)
        invalidate_runs((PyObject *)parent);
    rc = is_node(parent->parent) ? offer_parent(s, parent, take, next) : 0;
done:
    Py_DECREF(parent);
    return rc;
}

/* drop_leaves(heaps, owned, free, backlog, tally, want[, dropped]) -> (pages freed, node or None):
 * pop device candidates off ``heaps`` and drop the plain leaves among them until ``want`` are freed
 * (then None), the heap is empty (None), or a candidate is not a plain leaf (returned, off its heap,
 * for the caller's loop). ``owned`` and ``free`` are the device allocator's (a bytearray, a list),
 * ``backlog`` the backup backlog (a dict by node id), ``tally`` a list [digest value, evictable
 * device pages] updated in place on every way out, errors included. ``dropped``, a list: each leaf
 * dropped is appended to it. */
static PyObject *py_drop_leaves(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 && nargs != 7)
        return PyErr_Format(PyExc_TypeError, "drop_leaves takes 6 or 7 arguments, not %zd", nargs);
    if (nargs == 7 && args[6] != Py_None && !PyList_Check(args[6]))
        return PyErr_Format(PyExc_TypeError, "drop_leaves: dropped must be a list or None");
    Pool s = {0};
    s.heaps = as_heaps(args[0]);
    if (s.heaps == NULL)
        return NULL;
    s.owned = args[1];
    s.free = args[2];
    s.backlog = args[3];
    PyObject *tally = args[4];
    if (!PyByteArray_Check(s.owned) || !PyList_Check(s.free) || !PyDict_Check(s.backlog) || !PyList_Check(tally) ||
        PyList_GET_SIZE(tally) != 2)
        return PyErr_Format(PyExc_TypeError, "drop_leaves: a bytearray, a list, a dict and a list of 2 ints");
    Py_ssize_t want = PyLong_AsSsize_t(args[5]);
    if (want == -1 && PyErr_Occurred())
        return NULL;
    if (!kernels_bound()) {
        PyErr_SetString(PyExc_RuntimeError, "drop_leaves: the kernels are not bound (tree.py binds them)");
        return NULL;
    }
    s.dropped = nargs == 7 && args[6] != Py_None ? args[6] : NULL; /* borrowed: the caller holds it */
    s.value = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(tally, 0));
    s.evictable = PyLong_AsLongLong(PyList_GET_ITEM(tally, 1));
    if (PyErr_Occurred())
        return NULL;
    PyObject *out = NULL, *node = NULL;
    PyObject *next = NULL; /* a parent that drop handed back: a plain leaf, the next pop */
    Py_ssize_t freed = 0;
    int ok = 0;
    while (freed < want) {
        if (next != NULL) {
            node = next;
            next = NULL;
        } else {
            node = pop_candidate(s.heaps, 1);
            if (node == NULL)
                goto write_back;
            if (node == Py_None)
                break;
            int plain = plain_leaf((Node *)node, s.backlog);
            if (plain < 0)
                goto write_back;
            if (!plain)
                break; /* the caller's */
        }
        s.left = want - freed;
        if (drop(&s, (Node *)node, freed + 1 < want, &next) < 0)
            goto write_back;
        Py_CLEAR(node);
        freed++;
    }
    ok = 1;
write_back:; /* the digest, the counter and the free list, also on an error: the nodes already dropped stay dropped */
    PyObject *type, *exc, *tb; /* an error's exception waits while the write-back runs */
    PyErr_Fetch(&type, &exc, &tb);
    if (flush_pages(&s) < 0) {
        ok = 0;
        if (type == NULL)
            PyErr_Fetch(&type, &exc, &tb); /* reported once the rest is written back */
        else
            PyErr_Clear();
    }
    PyObject *v = PyLong_FromUnsignedLongLong(s.value), *e = PyLong_FromLongLong(s.evictable);
    if (v == NULL || e == NULL) {
        ok = 0;
        Py_XDECREF(v);
        Py_XDECREF(e);
    } else { /* the list holds two items (checked above; no Python code ran since) */
        PyList_SetItem(tally, 0, v);
        PyList_SetItem(tally, 1, e);
    }
    if (type != NULL) {
        PyErr_Clear();
        PyErr_Restore(type, exc, tb); /* the first error is the one reported */
    }
    if (ok)
        out = Py_BuildValue("(nO)", freed, node == NULL ? Py_None : node);
    Py_XDECREF(next);
    Py_XDECREF(node);
    return out;
}

PyMethodDef evict_methods[] = {
    {"drop_leaves", (PyCFunction)(void (*)(void))py_drop_leaves, METH_FASTCALL,
     "Evictor.evict_device's loop over plain device leaves (see _evict.c)."},
    {NULL, NULL, 0, NULL},
};
