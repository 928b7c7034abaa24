/* The native tree node's layout, shared by the node type (_node.c) and the ledger's kernels
 * (_account.c, _candidates.c), which read its fields directly. */
#ifndef TPCACHE_NODE_H
#define TPCACHE_NODE_H
#include <Python.h>
#include <stdint.h>

/* A node's numbers (its id, tier states, pins, stamps, hits, hash, record, device page, host slot,
 * depth) are C integers, each as wide as its values need: the kernels read and write them without
 * an int object between, and a node of 16-token pages is one 208-byte block of pymalloc. Python
 * reads each as an int made when read (small ones are the interpreter's cached ints) and writes it
 * through ``int_set`` (_node.c), which refuses a value out of the field's range. The object fields
 * (the parent, the component record, the run caches) are declared in Node below and listed in
 * FIELDS once: dealloc clears, a copy copies, and Python reads and writes, each one listed. */
#define FIELDS(X) X(parent) X(comp) X(run) X(pages_run)

typedef struct {
    PyObject_VAR_HEAD /* ob_size: how many bytes of token ids ``tok`` holds (the page's key, inline) */
    /* The fields in the order the kernels read them (a touch, a candidacy, a drop), so that those
     * reads span as few cache lines as they can: a node of 16-token pages is a 208-byte block of
     * pymalloc, and a touch reads the lines up to ``host_slot``. */
    PyObject *parent;
    /* The children: NULL when there is none, the child itself when there is one (most nodes: a chain
     * costs no dict), a dict of two or more keyed by their tokens (_kids.c). Changed only by kids_add
     * and kids_del, which keep that shape. */
    PyObject *kids;
    int8_t device_state, host_state, storage_state; /* tiers.DeviceState, HostState, StorageState */
    int32_t device_pins, host_pins;                 /* (a record packs each in 32 bits) */
    int64_t last_access, created_at, hits;
    PyObject *comp;
    uint64_t hash, record;
    /* A device page and a host slot (-1: none) in 32 bits, as the walk's and the holdings' int32
     * arrays hold them; the id, fixed when the node is made. */
    int32_t device_page, host_slot;
    int64_t node_id;
    /* Pages above it to the root (the root's is 0; fixed when the node is made), and its place in
     * its run cache (tree.py's walk). */
    int32_t depth, run_at;
    PyObject *run, *pages_run;
    char tok[];
} Node;

extern PyTypeObject NodeType;
extern PyMethodDef account_methods[];   /* _account.c */
extern PyMethodDef candidate_methods[]; /* _candidates.c */
extern PyMethodDef evict_methods[];     /* _evict.c */
extern PyMethodDef chain_methods[];     /* _chain.c */
extern PyMethodDef settle_methods[];    /* _settle.c */
extern PyMethodDef round_methods[];     /* _round.c */
extern PyMethodDef pool_methods[];      /* _pool.c */
extern PyMethodDef lookup_methods[];    /* _lookup.c */
extern PyMethodDef bind_methods[];      /* _bind.c */

/* Which eviction heaps a node is a candidate of: 1 device, 2 host, 0 neither, -1 an error
 * (TypeError for what is not a native node). */
int candidacy(PyObject *node); /* _candidates.c */
/* Whether a node with these device state and pins, host state and pins can be a candidate at all
 * (candidacy then asks its children): an unpinned valid device page, or an idle host-only page. */
static inline int may_be_candidate(int64_t ds, int64_t dp, int64_t hs, int64_t hp) {
    return (ds == 2 && dp == 0) || (ds == 0 && hs == 2 && hp == 0);
}
/* The tree's nodes by id (tree.RadixTree.nodes under the native core; _table.c): an open-addressing
 * hash table keyed by the int64 id. ``cap`` slots (a power of two, 0 before the first put), each an
 * id and its node, NULL where empty. An id sits at the first free slot from its home (linear
 * probing); a removal shifts the entries after it back, so there are no tombstones and a lookup
 * stops at the first free slot. Homes keep runs of TABLE_RUN consecutive ids together: a run's
 * first home is the high bits of its number times a 64-bit odd constant (Fibonacci hashing spreads
 * the runs evenly), its ids the slots after it. The kernels look up ids made together (a path's
 * pages, a request's new pages), which then share a few cache lines: on a replay, hashing each id
 * apart takes the core about 1.8 times as long as runs of 16 do. The table doubles past a
 * load of 0.7 and shrinks to a load of 0.25-0.5 below 0.15 (never under TABLE_MIN slots), so it
 * costs 16 bytes a slot: 23-46 bytes a live node as it grows, at most about 107 as it empties,
 * whatever the ids. It hashes rather than indexing memory by id because a tree's live ids are
 * scattered over every id it ever made (the root's is 0 and never goes; the nodes an LRU keeps were
 * made at any time): memory indexed by id would follow that span, not the live nodes. No slot's
 * place is observable: every listing is sorted by id. It holds native nodes only (the collector need
 * not walk it). */
enum { TABLE_MIN = 8, TABLE_RUN = 16 };
typedef struct {
    int64_t id;
    Node *node; /* NULL: the slot is free */
} TableSlot;
typedef struct {
    PyObject_HEAD
    TableSlot *slot;
    Py_ssize_t cap, len; /* slots (a power of two, or 0: no array yet), nodes held */
    int shift;           /* 64 - log2(cap): a run's hash shifted right by it is the run's home slot */
} NodeTable;
extern PyTypeObject NodeTableType;
static inline int is_table(PyObject *o) { return o != NULL && Py_IS_TYPE(o, &NodeTableType); }
/* ``o`` as a NodeTable, or NULL and a TypeError naming ``who``. */
NodeTable *as_table(PyObject *o, const char *who);
/* The home slot of ``id`` in a table of 2**(64 - shift) slots: its run's home, plus its place in
 * the run. */
static inline Py_ssize_t table_home(int64_t id, int shift) {
    uint64_t run = (uint64_t)id / TABLE_RUN, at = (run * UINT64_C(0x9E3779B97F4A7C15)) >> shift;
    return (Py_ssize_t)((at + (uint64_t)id % TABLE_RUN) & (UINT64_MAX >> shift));
}
/* The node of ``id`` (borrowed), or NULL (no exception): the kernels' lookup. */
static inline Node *table_get(const NodeTable *t, int64_t id) {
    if (t->len == 0)
        return NULL;
    Py_ssize_t mask = t->cap - 1;
    for (Py_ssize_t i = table_home(id, t->shift);; i = (i + 1) & mask) {
        const TableSlot *s = &t->slot[i];
        if (s->node == NULL || s->id == id)
            return s->node; /* (a free slot ends the probe: the load stays under 1) */
    }
}
/* The node of the id ``key`` (borrowed), or NULL: then an exception is set only for what is not an
 * int (TypeError); an int out of int64 range is simply absent. */
Node *table_find(const NodeTable *t, PyObject *key);
/* Put ``node`` in under ``id`` (replacing any node there): 0, or -1 and an exception. */
int table_put(NodeTable *t, int64_t id, Node *node);
/* Take the node of ``id`` out: 0, or -1 and a KeyError when there is none. */
int table_del(NodeTable *t, int64_t id);
/* The nodes by ascending id (a new list), or NULL and an exception. */
PyObject *table_nodes(NodeTable *t);

/* The device and host candidate heaps of one tree (lists of ints laid out as heapq lays them), the
 * tree's node table and the policy's key kind (0 LRU, 1 LFU, 2 FIFO): the ``Heaps`` object a
 * candidates.Candidates makes once and hands to the kernels. */
typedef struct {
    PyObject_HEAD
    PyObject *dev, *host;
    NodeTable *nodes;
    long kind;
} Heaps;
extern PyTypeObject HeapsType;
/* ``o`` as Heaps, or NULL and a TypeError (_heap.c). */
Heaps *as_heaps(PyObject *o);
/* heapq.heappush(heap, entry), stealing ``entry``: 0, or -1 and an exception (_heap.c). */
int heap_push(PyObject *heap, PyObject *entry);
/* heapq.heappop(heap) of a non-empty heap: the least entry (a new reference), or NULL and an exception. */
PyObject *heap_pop(PyObject *heap);
/* heapq.heapify(heap): 0, or -1 and an exception. */
int heap_order(PyObject *heap);
/* Candidates.offer(node) on a Heaps object: 0, or -1 and an exception. */
int offer1(PyObject *heaps, PyObject *node);
int heaps_offer(Heaps *h, PyObject *node); /* Candidates.offer(node): 0, or -1 and an exception */
/* A Heaps object checked at the first push of a loop of offers (most offers push nothing). */
typedef struct {
    PyObject *cands;
    int loaded;
} LazyHeaps;
int lazy_offer(LazyHeaps *h, PyObject *node);        /* Candidates.offer: 0, or -1 and an exception */
int lazy_offer_around(LazyHeaps *h, PyObject *node); /* Candidates.offer_around, for a native node */
void lazy_clear(LazyHeaps *h);
/* Push a candidate of ``which`` heaps (candidacy's answer) as Candidates._push: 0, or -1 and an exception. */
int heaps_push(Heaps *h, PyObject *node, int which);
/* The next live candidate of the device (1) or host (2) heap (a new reference), None when there is
 * none, NULL on an error. */
PyObject *pop_candidate(Heaps *h, long which);

/* A node's page tokens, as a new bytes object. */
static inline PyObject *node_tokens(Node *n) { return PyBytes_FromStringAndSize(n->tok, Py_SIZE(n)); }

/* A node's children (its ``kids``). */
static inline Py_ssize_t kids_count(Node *n) {
    return n->kids == NULL ? 0 : Py_IS_TYPE(n->kids, &NodeType) ? 1 : PyDict_GET_SIZE(n->kids);
}
/* The child keyed by ``key`` (borrowed), or NULL: then an exception is set on an error only. */
PyObject *kids_get(Node *n, PyObject *key);
/* The child whose tokens are the ``len`` bytes at ``key`` (borrowed), or NULL: then an exception is
 * set on an error only. */
PyObject *kids_at(Node *n, const char *key, Py_ssize_t len);
/* array.array(typecode, raw) for typecode "i" or "q" and bytes ``raw`` (a new reference; _bind.c), or
 * NULL and an exception. */
PyObject *array_from_bytes(const char *typecode, PyObject *raw);
/* Add ``child`` under its tokens: 0, 1 if a child has those tokens already (nothing changed), or -1
 * and an exception. */
int kids_add(Node *n, Node *child);
/* Remove ``child``: 0, or -1 and an exception (KeyError when it is not a child of ``n``). */
int kids_del(Node *n, Node *child);
/* The next child (borrowed) as PyDict_Next gives it: 1, or 0 when there is no more; ``*pos`` 0 first. */
int kids_next(Node *n, Py_ssize_t *pos, PyObject **child);
/* The children in the order they were added (a new list), or NULL and an exception. */
PyObject *kids_list(Node *n);
/* The children by their tokens, a read-only mapping made now (Node.children), or NULL and an exception. */
PyObject *kids_view(Node *n);
extern PyTypeObject TokKeyType; /* a children dict's key (_kids.c) */

/* One entry's term in a lease's holding (holdings._Holding._term): XXH3 of the little-endian
 * (lease, kind, key), key a page or a node's id, mod 2**62: 0, or -1 and an exception (_account.c). */
int holding_term(int64_t lease, int64_t kind, PyObject *item, uint64_t *out);
extern PyTypeObject HoldingType; /* _holding.c */
/* ``total`` covers the first ``hashed`` entries; those up to ``added``, put in by the methods since,
 * are summed when the total is read or an entry goes: a lease's pages, allocated and then adopted by
 * its insert, cost no terms unless a digest is read in between. (An entry put in behind the
 * methods' back, past ``added``, is never summed: the invariant check finds the total stale.) */
typedef struct {
    PyListObject list;
    int64_t lease_id, kind;
    uint64_t total;
    Py_ssize_t hashed, added;
} Holding;
static inline int is_holding(PyObject *o) { return o != NULL && PyObject_TypeCheck(o, &HoldingType); }
/* Holding.extend: None, or NULL and an exception. */
PyObject *holding_extend(Holding *self, PyObject *items);
/* Holding.discard of the int entries equal to one of ``drop``: 0, or -1 and an exception. */
int holding_drop_ints(Holding *self, const int64_t *drop, Py_ssize_t count);
/* Holding.empty: 0, or -1 and an exception. */
int holding_clear(Holding *self);

/* A native node's digest record (accounting.record_of) for a node without components (_account.c). */
uint64_t record_native(const Node *n);
/* The fields a record hashes, read (or known) once, each widened to 64 bits as the record packs it. */
typedef struct {
    uint64_t hash;
    int64_t ds, hs, ss, device_page, host_slot, dp, hp, last, hits, created;
} Fields;
/* record_native's value for a node without components whose fields are ``f`` (_account.c). */
uint64_t record_fields(const Fields *f);
/* A native node's digest record, with its component record if it has one (accounting.record_of):
 * 0, or -1 and an exception (a TypeError for anything but a native node; _account.c). */
int record_any(PyObject *node, uint64_t *out);
/* A new node is made in two steps (_node.c), as Node(node_id, parent, tokens, hash_, clock) makes
 * it: node_alloc, a node with room for ``len`` token bytes, its fields and tokens left as they come
 * (zeroing 2 KiB pages first was a tenth of a replay), or NULL and an exception; the caller copies
 * the tokens in; then node_fill sets every field: 0, or -1 and a TypeError for a parent that is
 * neither a Node nor None (its fields then cleared). Until node_fill it must not be released. */
Node *node_alloc(Py_ssize_t len);
int node_fill(Node *self, int64_t node_id, PyObject *parent, uint64_t hash, int64_t clock);
/* Fetch the token area of the node node_alloc(len) gives next, for writing, where it is known (a
 * freed node's). A node's memory was most often freed long before and is out of the cache: a 2 KiB
 * page copied into it would wait for each of its lines, which, fetched while the node before is
 * made, are there in time. */
void node_warm(Py_ssize_t len);

/* Intern ``text`` into ``var`` (an attribute name a kernel looks up, made once): true on a failure,
 * so that a loader chains them with || and returns -1. INTERN(name): s_<name> for "name". */
#define INTERN_AS(var, text) (((var) = PyUnicode_InternFromString(text)) == NULL)
#define INTERN(name) INTERN_AS(s_##name, #name)

static inline int is_node(PyObject *o) { return o != NULL && Py_IS_TYPE(o, &NodeType); }

/* An int's value (a page, a clock, an argument): -1 and an exception if it is not an int64. Most
 * are small: those are read here, without a call into the interpreter. */
static inline int field(PyObject *v, int64_t *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_Check(v) && PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)v);
        return 0;
    }
#else
    if (PyLong_Check(v)) {
        Py_ssize_t size = Py_SIZE(v);
        const digit *d = ((PyLongObject *)v)->ob_digit;
        if (size == 0 || size == 1 || size == -1) {
            *out = size == 0 ? 0 : (int64_t)size * (int64_t)d[0];
            return 0;
        }
        if (size == 2) {
            *out = (int64_t)d[0] | (int64_t)d[1] << PyLong_SHIFT;
            return 0;
        }
    }
#endif
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)x;
    return 0;
}

enum { STATE_NONE = 0, STATE_VALID = 2 }; /* tiers' NONE, and DeviceState/HostState VALID */

/* Append ``id`` to ``list`` as an int: 0, or -1 and an exception. */
static inline int append_id(PyObject *list, int64_t id) {
    PyObject *v = PyLong_FromLongLong(id);
    int rc = v == NULL ? -1 : PyList_Append(list, v);
    Py_XDECREF(v);
    return rc;
}

#define DIGEST_MASK ((UINT64_C(1) << 62) - 1) /* digest.DIGEST_MASK */

/* accounting.reference_flags_of of a native node, evictable | protected << 1 | mirror << 2. */
static inline int node_flags(const Node *n) {
    int ds = n->device_state, dp = n->device_pins, hs = n->host_state, ss = n->storage_state;
    return (ds == 2 && dp == 0) | (ds != 0 && dp > 0) << 1 | (ds == 2 && hs == 2 && ss == 2) << 2;
}

/* Set a pin count: 0, or -1 and an OverflowError past int32 (a record packs it in 32 bits). */
static inline int set_pins(int32_t *slot, int64_t v) {
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a pin count past int32");
        return -1;
    }
    *slot = (int32_t)v;
    return 0;
}

/* Whether tree.py bound tree.Run's ``pages`` slot and the arrays new arrays are copied from
 * (``bind``, _bind.c): 1 once it has. */
int kernels_bound(void);
/* run.pages = None for a tree.Run (tree.drop_pages's first half): 0, or -1 and an exception. */
int run_forget_pages(PyObject *run);
/* Stop the collector tracking a tree.Run (anything else is left alone). A run of native nodes is in
 * no cycle the tree does not break itself (its nodes point to it; dispose clears those), and the
 * collector cannot see native nodes anyway: tracked, one object per cached chain would be walked by
 * every full collection (tens of milliseconds at a hundred thousand chains). */
void run_untrack(PyObject *run);

/* RadixTree._invalidate: drop the runs through ``node`` and those of the single-child chain above it. */
static inline void invalidate_runs(PyObject *cur) {
    while (is_node(cur) && ((Node *)cur)->run != Py_None) {
        Py_SETREF(((Node *)cur)->run, Py_NewRef(Py_None));
        cur = ((Node *)cur)->parent;
    }
}

#endif
