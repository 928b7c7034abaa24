/* An insert's per-page work in C: token ids to the int32 bytes pages are keyed by
 * (hashing.as_token_bytes) and a chain of new pinned device pages (Ledger.add_pinned_chain, with
 * the page hashes of tree.Walk.hashes and the nodes of RadixTree.add_chain). The Python versions
 * stay as the reference; tests hold the two equal (same bytes, hashes, node ids, records).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_node.h"
#include "_hash.h"

/* token_bytes(tokens) -> bytes, or None for anything but a list or tuple of ints (the reference
 * takes those, and raises what it raises). ValueError for an id outside int32, as the reference. */
static PyObject *py_token_bytes(PyObject *mod, PyObject *seq) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL)
        return NULL;
    int32_t *dst = (int32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(items[i])) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow || v < INT32_MIN || v > INT32_MAX) {
            Py_DECREF(out);
            return PyErr_Format(PyExc_ValueError, "token ids must fit in int32");
        }
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        dst[i] = (int32_t)v;
    }
    return out;
}

/* hashing.page_hash of a new node's tokens below a page of hash ``up``: XXH3-64 of ``up`` (8 bytes,
 * little-endian) and the tokens, with the namespace's seed. Hashed where the tokens lie: the 8 bytes
 * before them (``pages_run``, and on a 32-bit build ``run`` too: fields node_fill sets afterwards)
 * hold ``up`` meanwhile (no copy of the page to hash). */
static uint64_t page_hash(Node *node, uint64_t up, uint64_t seed) {
    _Static_assert(offsetof(Node, tok) == offsetof(Node, pages_run) + sizeof(PyObject *) &&
                       offsetof(Node, tok) >= offsetof(Node, run) + 8,
                   "the 8 bytes before the tokens are fields node_fill sets");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    up = __builtin_bswap64(up);
#endif
    char *at = node->tok - 8;
    memcpy(at, &up, 8);
    return seeded_hash(at, (size_t)Py_SIZE(node) + 8, seed);
}

/* The device pages' int objects, freed long before, are most often out of the cache: each is
 * fetched this many pages ahead of its read. */
enum { PAGES_AHEAD = 4 };

/* Add the chain's nodes below ``parent``; ``nodes`` receives them and ``ids`` their ids (as ints).
 * 0, or -1 and an exception (the nodes added so far stay: the caller's state is then as broken as
 * after any failed reference call). */
static int add_chain(NodeTable *tree_nodes, long long next_id, Node *parent, const char *data, Py_ssize_t step,
                     uint64_t seed, PyObject *pages, PyObject *clock, PyObject *nodes, PyObject *ids, uint64_t *records) {
    uint64_t h = parent->hash;
    Py_ssize_t count = PyList_GET_SIZE(pages);
    /* Every new node's record packs the same fields but its hash and page. */
    Fields f = {.host_slot = -1, .dp = 1, .ds = STATE_VALID};
    if (field(clock, &f.last) < 0)
        return -1; /* (a clock past int64: nothing made) */
    f.created = f.last;
    Node *up = (Node *)Py_NewRef(parent), *first = parent;
    int rc = -1;
    for (Py_ssize_t i = 0; i < count && i < PAGES_AHEAD; i++)
        __builtin_prefetch(PyList_GET_ITEM(pages, i));
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t page;
        if (i + PAGES_AHEAD < count)
            __builtin_prefetch(PyList_GET_ITEM(pages, i + PAGES_AHEAD));
        if (field(PyList_GET_ITEM(pages, i), &page) < 0) /* (int32: pinned checked them) */
            goto done;
        PyObject *id = PyLong_FromLongLong(next_id + i);
        Node *node = id != NULL ? node_alloc(step) : NULL;
        if (node == NULL) {
            Py_XDECREF(id);
            goto done;
        }
        if (i + 1 < count)
            node_warm(step);
        memcpy(node->tok, data + i * step, (size_t)step);
        h = page_hash(node, h, seed);
        node_fill(node, next_id + i, (PyObject *)up, h, f.last); /* (``up`` is a node: it cannot fail) */
        node->device_state = STATE_VALID;
        node->device_page = (int32_t)page;
        node->device_pins = 1;
        int added = kids_add(up, node);
        if (added > 0)
            PyErr_Format(PyExc_ValueError, "node %lld already has a child for this page", (long long)up->node_id);
        PyList_SET_ITEM(nodes, i, Py_NewRef(node)); /* (the lists are made with room for each) */
        PyList_SET_ITEM(ids, i, id); /* (the list takes it) */
        f.hash = h;
        f.device_page = page;
        uint64_t rec = record_fields(&f);
        int bad = added != 0 || table_put(tree_nodes, next_id + i, node) < 0;
        if (!bad) {
            node->record = rec;
            *records += rec;
        }
        Py_SETREF(up, node);
        if (bad)
            goto done;
    }
    rc = 0;
    /* As the reference: the tree's runs change only once every node is in (its next id: the caller's). */
    if (kids_count(first) == 2)
        invalidate_runs((PyObject *)first);
done:
    Py_DECREF(up);
    return rc;
}

/* The pages of token_bytes from byte ``offset`` on, one per device page of ``pages``: new nodes, each
 * below the one before, device VALID on its page, pinned once, recorded, their ids ``next_id`` on and
 * added to ``tree_nodes`` (the tree's NodeTable): (nodes, sum of their records, their ids), or NULL and an
 * exception; a page that is no int32, or a clock that is no int64, raises before any node is made. */
static PyObject *pinned(PyObject *tree_nodes, long long next_id, Py_ssize_t step, uint64_t seed, PyObject *parent,
                        PyObject *data, Py_ssize_t offset, PyObject *pages, PyObject *clock) {
    NodeTable *table = as_table(tree_nodes, "pinned_chain");
    if (table == NULL)
        return NULL;
    if (step <= 0)
        return PyErr_Format(PyExc_TypeError, "pinned_chain: a page of at least one token");
    Py_ssize_t count = PyList_GET_SIZE(pages);
    if (offset < 0 || offset + count * step > PyBytes_GET_SIZE(data))
        return PyErr_Format(PyExc_ValueError, "pinned_chain: fewer tokens than pages");
    if (count > 0) {
        node_warm(step); /* (the first node's tokens, while the rest is checked and made) */
        int taken = kids_at((Node *)parent, PyBytes_AS_STRING(data) + offset, step) != NULL;
        taken = taken == 0 && PyErr_Occurred() ? -1 : taken;
        if (taken > 0)
            PyErr_Format(PyExc_ValueError, "node %lld already has a child for this page", (long long)((Node *)parent)->node_id);
        if (taken != 0)
            return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) { /* every page checked before the first node is made */
        int64_t page;
        if (field(PyList_GET_ITEM(pages, i), &page) < 0)
            return NULL;
        if (page < INT32_MIN || page > INT32_MAX)
            return PyErr_Format(PyExc_OverflowError, "pinned_chain: device page %lld is past int32", (long long)page);
    }
    PyObject *nodes = PyList_New(count), *ids = PyList_New(count), *out = NULL;
    uint64_t records = 0;
    if (nodes != NULL && ids != NULL &&
        add_chain(table, next_id, (Node *)parent, PyBytes_AS_STRING(data) + offset, step, seed, pages, clock,
                  nodes, ids, &records) == 0)
        out = Py_BuildValue("(OKO)", nodes, (unsigned long long)records, ids);
    Py_XDECREF(nodes);
    Py_XDECREF(ids);
    return out;
}

/* pinned_chain(tree_nodes, next_id, page_size, seed, parent, token_bytes, offset, pages, clock)
 *     -> (nodes, sum of their records, their ids), or None for pages not in a list (the reference
 * handles those):
 * Ledger.add_pinned_chain's new nodes (``pinned``), their ids from ``next_id`` on (the caller moves
 * the tree's next id past them). */
static PyObject *py_pinned_chain(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9)
        return PyErr_Format(PyExc_TypeError, "pinned_chain takes 9 arguments, not %zd", nargs);
    long long next_id = PyLong_AsLongLong(args[1]);
    Py_ssize_t size = PyLong_AsSsize_t(args[2]), offset = PyLong_AsSsize_t(args[6]);
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (!is_node(args[4]) || !PyBytes_Check(args[5]) || !PyList_Check(args[7]))
        Py_RETURN_NONE; /* the reference takes any other sequence of pages (and refuses what it refuses) */
    return pinned(args[0], next_id, size * 4, seed, args[4], args[5], offset, args[7], args[8]);
}

enum { APPEND_MAX = 64 }; /* pages one append_chain takes (more: the reference) */

/* Whether page ``p`` is an entry of ``held`` (int entries compared by value, as a set of ints does). */
static int holds(PyObject *held, int64_t p) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(held); i++) {
        PyObject *item = PyList_GET_ITEM(held, i);
        if (!PyLong_Check(item))
            continue;
        long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred())
            PyErr_Clear(); /* past int64: not a page */
        else if (v == p)
            return 1;
    }
    return 0;
}

/* The first ``n`` of ``pages`` into ``out`` when they are distinct int32 pages the lease holds: 1, else 0. */
static int fresh_pages(PyObject *pages, Py_ssize_t n, PyObject *held, int64_t *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(pages, i);
        long long v = PyLong_Check(item) ? PyLong_AsLongLong(item) : -1;
        if (!PyLong_Check(item) || (v == -1 && PyErr_Occurred()) || v < INT32_MIN || v > INT32_MAX) {
            PyErr_Clear();
            return 0;
        }
        for (Py_ssize_t k = 0; k < i; k++)
            if (out[k] == v)
                return 0;
        if (!holds(held, v))
            return 0;
        out[i] = v;
    }
    return 1;
}

/* The lease's side of the chain: its pages leave ``held`` (lease.pages), the ``n`` new nodes' ``ids``
 * (pinned's) join ``pinned_nodes`` (lease.device_nodes). ``*whole``: whether the lease then pins
 * exactly the path to the last node (the caller moves its cursor there, or clears it). */
static int adopt(PyObject *held, PyObject *pinned_nodes, Node *cursor, PyObject *ids, const int64_t *fresh,
                 Py_ssize_t n, int *whole) {
    int64_t depth = cursor->depth;
    PyObject *extended = NULL;
    /* Holding exactly the n distinct pages, the lease holds nothing else: emptied, as the reference does. */
    int all = PyList_GET_SIZE(held) == n;
    if ((all ? holding_clear((Holding *)held) < 0 : holding_drop_ints((Holding *)held, fresh, n) < 0) ||
        (extended = holding_extend((Holding *)pinned_nodes, ids)) == NULL)
        return -1;
    Py_DECREF(extended);
    *whole = PyList_GET_SIZE(pinned_nodes) == depth + n;
    return 0;
}

/* append_chain(tree_nodes, next_id, page_size, seed, clock, held, pinned_nodes, cursor, data, pages)
 * -> (ids, records, whole, nodes), or None, changing nothing: Inserter._append_new and _add_new's
 * tree and holding changes in one call (TreeCore.append_chain makes the rest: the tree's next id,
 * the ledger's clock, digest and protected count, the lease's cursor), for an append whose pages are
 * all new below ``cursor`` (it has no child for the first) and whose first n ``pages`` (n = the full
 * pages of ``data``) are distinct pages the lease holds (``held``, its pages). The nodes are
 * pinned_chain's, with ids from ``next_id`` on, stamped ``clock`` (the ticked clock); ``records``:
 * the sum of their records; the lease adopts them (``adopt``, ``whole``); ``nodes``: the new nodes
 * (the ledger's count and feed take them, with no lookup of their ids). None for any other append,
 * and for holdings, pages or a clock the kernel does not take: the reference decides those. */
static PyObject *py_append_chain(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10)
        return PyErr_Format(PyExc_TypeError, "append_chain takes 10 arguments, not %zd", nargs);
    PyObject *tree_nodes = args[0], *clock = args[4], *held = args[5], *pinned_nodes = args[6];
    PyObject *cursor = args[7], *data = args[8], *pages = args[9];
    long long next_id = PyLong_AsLongLong(args[1]);
    Py_ssize_t size = PyLong_AsSsize_t(args[2]);
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (as_table(tree_nodes, "append_chain") == NULL)
        return NULL;
    if (size <= 0)
        return PyErr_Format(PyExc_TypeError, "append_chain takes the tree's page size");
    int64_t stamp;
    if (!is_node(cursor) || !PyBytes_Check(data) || !PyList_Check(pages) || !is_holding(held) ||
        !is_holding(pinned_nodes) || field(clock, &stamp) < 0) {
        PyErr_Clear(); /* a clock past int64: the reference's */
        Py_RETURN_NONE;
    }
    Py_ssize_t step = size * 4, n = PyBytes_GET_SIZE(data) / step;
    int64_t fresh[APPEND_MAX];
    if (n == 0 || n > APPEND_MAX || PyList_GET_SIZE(pages) < n || PyList_GET_SIZE(held) < n ||
        !fresh_pages(pages, n, held, fresh))
        Py_RETURN_NONE;
    if (kids_at((Node *)cursor, PyBytes_AS_STRING(data), step) != NULL || PyErr_Occurred()) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE; /* a page already below the cursor: _adopt's */
    }
    PyObject *taken = PyList_GetSlice(pages, 0, n), *out = NULL;
    PyObject *made = taken ? pinned(tree_nodes, next_id, step, seed, cursor, data, 0, taken, clock) : NULL;
    int whole = 0;
    if (made != NULL && adopt(held, pinned_nodes, (Node *)cursor, PyTuple_GET_ITEM(made, 2), fresh, n, &whole) == 0)
        out = Py_BuildValue("(OOOO)", PyTuple_GET_ITEM(made, 2), PyTuple_GET_ITEM(made, 1), whole ? Py_True : Py_False,
                            PyTuple_GET_ITEM(made, 0));
    Py_XDECREF(made);
    Py_XDECREF(taken);
    return out;
}

/* chain_below(node) -> (nodes, tokens, ids): the single-child chain below ``node`` (its only child,
 * that one's only child, ...) as a tuple, their page tokens joined and their ids (a tuple of ints),
 * as RadixTree._run gathers them for a Run; read from the nodes' inline
 * tokens, without a bytes object per page. None for a node of the reference type. */
static PyObject *py_chain_below(PyObject *mod, PyObject *start) {
    if (!is_node(start))
        Py_RETURN_NONE;
    Py_ssize_t count = 0, size = 0;
    for (Node *cur = (Node *)start; cur->kids != NULL && Py_IS_TYPE(cur->kids, &NodeType); cur = (Node *)cur->kids)
        count++;
    PyObject *nodes = PyTuple_New(count), *ids = PyTuple_New(count); /* filled below: no growth step by step */
    if (nodes == NULL || ids == NULL) {
        Py_XDECREF(nodes);
        Py_XDECREF(ids);
        return NULL;
    }
    Node *cur = (Node *)start;
    for (Py_ssize_t i = 0; i < count; i++, cur = (Node *)cur->kids) {
        PyTuple_SET_ITEM(nodes, i, Py_NewRef(cur->kids));
        PyObject *id = PyLong_FromLongLong(((Node *)cur->kids)->node_id);
        if (id == NULL) {
            Py_DECREF(nodes);
            Py_DECREF(ids);
            return NULL;
        }
        PyTuple_SET_ITEM(ids, i, id);
        size += Py_SIZE(cur->kids);
    }
    PyObject *data = PyBytes_FromStringAndSize(NULL, size);
    if (data == NULL) {
        Py_DECREF(nodes);
        Py_DECREF(ids);
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(data);
    for (Py_ssize_t i = 0; i < count; i++) {
        Node *n = (Node *)PyTuple_GET_ITEM(nodes, i);
        memcpy(dst, n->tok, (size_t)Py_SIZE(n));
        dst += Py_SIZE(n);
    }
    PyObject_GC_UnTrack(nodes); /* native nodes and ints: in no cycle, nothing for the collector to walk */
    PyObject_GC_UnTrack(ids);
    return Py_BuildValue("(NNN)", nodes, data, ids);
}

/* mark_run(run, node, chain) -> True, or False changing nothing for a node or chain (a list or tuple)
 * of the reference type: RadixTree._run's marks, ``node`` gets the run at 0 and each chain node but the last the run
 * at its own start (run_at = i + 1). */
static PyObject *py_mark_run(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "mark_run takes 3 arguments, not %zd", nargs);
    PyObject *run = args[0], *chain = args[2];
    if (!is_node(args[1]) || !(PyList_CheckExact(chain) || PyTuple_CheckExact(chain)))
        Py_RETURN_FALSE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(chain);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!is_node(PySequence_Fast_GET_ITEM(chain, i)))
            Py_RETURN_FALSE;
    Node *node = (Node *)args[1];
    run_untrack(run); /* (its nodes are native: nothing the collector could free goes through it) */
    Py_SETREF(node->run, Py_NewRef(run));
    node->run_at = 0;
    for (Py_ssize_t i = 0; i + 1 < n; i++) {
        Node *c = (Node *)PySequence_Fast_GET_ITEM(chain, i);
        Py_SETREF(c->run, Py_NewRef(run));
        c->run_at = (int32_t)(i + 1); /* (a chain of 2**31 nodes would not fit in memory) */
    }
    Py_RETURN_TRUE;
}

/* run_pages(run, nodes) -> array('i') of the nodes' device pages (``nodes`` a list or tuple), each node's ``pages_run`` set to
 * ``run`` (another run caching a node's page forgets its pages): Run.device_pages's loop. None,
 * changing nothing, for nodes of the reference type (the reference's). */
static PyObject *py_run_pages(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "run_pages takes 2 arguments, not %zd", nargs);
    PyObject *run = args[0], *nodes = args[1];
    if (!PyList_CheckExact(nodes) && !PyTuple_CheckExact(nodes))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(nodes, i);
        if (!is_node(item))
            Py_RETURN_NONE;
    }
    PyObject *raw = PyBytes_FromStringAndSize(NULL, n * 4);
    if (raw == NULL)
        return NULL;
    int32_t *dst = (int32_t *)PyBytes_AS_STRING(raw);
    for (Py_ssize_t i = 0; i < n; i++) {
        Node *node = (Node *)PySequence_Fast_GET_ITEM(nodes, i);
        PyObject *other = node->pages_run;
        if (other != Py_None && other != run && run_forget_pages(other) < 0) {
            Py_DECREF(raw);
            return NULL;
        }
        Py_SETREF(node->pages_run, Py_NewRef(run));
        dst[i] = (int32_t)node->device_page;
    }
    PyObject *out = array_from_bytes("i", raw);
    Py_DECREF(raw);
    if (out != NULL && PyObject_IS_GC(out))
        PyObject_GC_UnTrack(out); /* an array refers to no object: the collector need not walk it */
    return out;
}

PyMethodDef chain_methods[] = {
    {"chain_below", (PyCFunction)py_chain_below, METH_O, "RadixTree._run's chain, its joined tokens and its ids (see _chain.c)."},
    {"mark_run", (PyCFunction)(void (*)(void))py_mark_run, METH_FASTCALL, "RadixTree._run's marks on its chain."},
    {"run_pages", (PyCFunction)(void (*)(void))py_run_pages, METH_FASTCALL, "Run.device_pages's loop (see _chain.c)."},
    {"token_bytes", (PyCFunction)py_token_bytes, METH_O, "hashing.as_token_bytes of a list or tuple of ints, or None."},
    {"pinned_chain", (PyCFunction)(void (*)(void))py_pinned_chain, METH_FASTCALL,
     "Ledger.add_pinned_chain's nodes and records (see _chain.c)."},
    {"append_chain", (PyCFunction)(void (*)(void))py_append_chain, METH_FASTCALL,
     "Inserter._append_new's new pinned chain below a lease's cursor (see _chain.c)."},
    {NULL, NULL, 0, NULL},
};
