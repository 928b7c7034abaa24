/* A native node's children (``Node.kids``): none (NULL), the one child itself, or a dict of two or
 * more. The dict's keys are ``TokKey`` objects: a page's tokens by reference, hashed once with XXH3
 * and compared with memcmp. A bytes key of the tokens would be a copy of them (2 KiB for a page of
 * 512 tokens) hashed with SipHash on every lookup, insert and removal; a branch point that many
 * requests pass (a shared system prompt's last page) paid that on each. Equal tokens are equal keys
 * whatever their hash, so a collision of hashes costs a compare, never a wrong child.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_hash.h"
#include "_node.h"

/* Up to this many children (a dict of them) a removal or a lookup at a position scans them, with no
 * key made at all. */
enum { SCAN_KIDS = 16 };

/* A dict key: ``len`` token bytes at ``tok``, held alive by ``owner`` (the child node a stored key
 * names, or NULL for a lookup's key, which lives only during the lookup). */
typedef struct {
    PyObject_HEAD
    PyObject *owner;
    const char *tok;
    Py_ssize_t len;
    Py_hash_t hash;
} TokKey;

static void tokkey_dealloc(TokKey *self) {
    Py_CLEAR(self->owner);
    PyObject_Free(self);
}

static Py_hash_t tokkey_hash(TokKey *self) { return self->hash; }

static PyObject *tokkey_compare(PyObject *a, PyObject *b, int op) {
    if (!Py_IS_TYPE(b, Py_TYPE(a)) || (op != Py_EQ && op != Py_NE))
        Py_RETURN_NOTIMPLEMENTED;
    TokKey *x = (TokKey *)a, *y = (TokKey *)b;
    int same = x->len == y->len && memcmp(x->tok, y->tok, (size_t)x->len) == 0;
    return PyBool_FromLong(op == Py_EQ ? same : !same);
}

static PyObject *tokkey_repr(TokKey *self) { return PyUnicode_FromFormat("<tokens of %zd bytes>", self->len); }

PyTypeObject TokKeyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tpcache.core.treecore._node.TokKey",
    .tp_basicsize = sizeof(TokKey),
    .tp_dealloc = (destructor)tokkey_dealloc,
    .tp_repr = (reprfunc)tokkey_repr,
    .tp_hash = (hashfunc)tokkey_hash,
    .tp_richcompare = tokkey_compare,
    .tp_flags = Py_TPFLAGS_DEFAULT, /* never tracked: a dict of these and of nodes stays untracked */
    .tp_doc = "A child page's tokens as a children dict's key (by reference, XXH3-hashed).",
};

/* The seed of the keys' hashes, drawn from the interpreter's own keyed hash of a constant at the first
 * key (so PYTHONHASHSEED governs it as it governs bytes): only a dict's layout depends on it, never
 * an order or a decision, and tokens a client chose cannot be made to collide without knowing it. */
static uint64_t key_seed;
static int key_seeded = 0;

static int seed_keys(void) {
    PyObject *probe = PyBytes_FromString("tpcache children");
    Py_hash_t h = probe ? PyObject_Hash(probe) : -1;
    Py_XDECREF(probe);
    if (h == -1)
        return -1;
    key_seed = (uint64_t)h;
    key_seeded = 1;
    return 0;
}

/* A key for ``len`` bytes at ``tok`` (a new reference; ``owner`` taken as a new reference when not
 * NULL), or NULL and an exception. */
static PyObject *tok_key(const char *tok, Py_ssize_t len, PyObject *owner) {
    if (!key_seeded && seed_keys() < 0)
        return NULL;
    TokKey *k = PyObject_New(TokKey, &TokKeyType);
    if (k == NULL)
        return NULL;
    Py_hash_t h = (Py_hash_t)seeded_hash(tok, (size_t)len, key_seed);
    k->hash = h == -1 ? -2 : h; /* -1 means an error to the interpreter */
    k->owner = Py_XNewRef(owner);
    k->tok = tok;
    k->len = len;
    return (PyObject *)k;
}

static PyObject *child_key(Node *child) { return tok_key(child->tok, Py_SIZE(child), (PyObject *)child); }

/* PyDict_SetItem(d, the child's key, child): 0, or -1 and an exception. */
static int set_child(PyObject *d, Node *child) {
    PyObject *key = child_key(child);
    int rc = key ? PyDict_SetItem(d, key, (PyObject *)child) : -1;
    Py_XDECREF(key);
    return rc;
}

static inline int same_page(Node *c, const char *key, Py_ssize_t len) {
    return Py_SIZE(c) == len && memcmp(c->tok, key, (size_t)len) == 0;
}

PyObject *kids_at(Node *n, const char *key, Py_ssize_t len) {
    PyObject *kids = n->kids, *found = NULL;
    if (kids == NULL)
        return NULL;
    if (Py_IS_TYPE(kids, &NodeType))
        return same_page((Node *)kids, key, len) ? kids : NULL;
    if (PyDict_GET_SIZE(kids) <= SCAN_KIDS) {
        Py_ssize_t at = 0;
        PyObject *v;
        while (found == NULL && PyDict_Next(kids, &at, NULL, &v))
            if (same_page((Node *)v, key, len)) /* children are nodes: kids_add is the only way in */
                found = v;
        return found;
    }
    PyObject *k = tok_key(key, len, NULL);
    found = k ? PyDict_GetItemWithError(kids, k) : NULL;
    Py_XDECREF(k);
    return found;
}

PyObject *kids_get(Node *n, PyObject *key) {
    if (n->kids == NULL || !PyBytes_Check(key)) /* a page's tokens are bytes: nothing else names a child */
        return NULL;
    return kids_at(n, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
}

int kids_add(Node *n, Node *child) {
    if (n->kids == NULL) {
        n->kids = Py_NewRef(child);
        return 0;
    }
    if (Py_IS_TYPE(n->kids, &NodeType)) {
        if (same_page((Node *)n->kids, child->tok, Py_SIZE(child)))
            return 1;
        PyObject *d = PyDict_New();
        if (d == NULL || set_child(d, (Node *)n->kids) < 0 || set_child(d, child) < 0) {
            Py_XDECREF(d);
            return -1;
        }
        Py_SETREF(n->kids, d);
        return 0;
    }
    PyObject *key = child_key(child);
    int in = key ? PyDict_Contains(n->kids, key) : -1;
    if (in == 0)
        in = PyDict_SetItem(n->kids, key, (PyObject *)child);
    else if (in > 0)
        in = 1;
    Py_XDECREF(key);
    return in;
}

int kids_del(Node *n, Node *child) {
    if (n->kids == (PyObject *)child) {
        Py_CLEAR(n->kids);
        return 0;
    }
    PyObject *key = NULL;
    if (n->kids != NULL && !Py_IS_TYPE(n->kids, &NodeType)) {
        if (PyDict_GET_SIZE(n->kids) <= SCAN_KIDS) { /* found by identity: no key made */
            Py_ssize_t pos = 0;
            PyObject *k, *v;
            while (PyDict_Next(n->kids, &pos, &k, &v))
                if (v == (PyObject *)child) {
                    key = Py_NewRef(k);
                    break;
                }
        } else
            key = tok_key(child->tok, Py_SIZE(child), NULL);
    }
    if (key == NULL || PyDict_GetItemWithError(n->kids, key) != (PyObject *)child) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_KeyError, "node %lld is not a child of node %lld", (long long)child->node_id,
                         (long long)n->node_id);
        Py_XDECREF(key);
        return -1;
    }
    int rc = PyDict_DelItem(n->kids, key);
    Py_DECREF(key);
    if (rc < 0)
        return -1;
    if (PyDict_GET_SIZE(n->kids) == 1) { /* back to the one-child shape */
        Py_ssize_t pos = 0;
        PyObject *only;
        PyDict_Next(n->kids, &pos, NULL, &only);
        Py_SETREF(n->kids, Py_NewRef(only));
    }
    return 0;
}

int kids_next(Node *n, Py_ssize_t *pos, PyObject **child) {
    if (n->kids == NULL)
        return 0;
    if (Py_IS_TYPE(n->kids, &NodeType)) {
        if (*pos != 0)
            return 0;
        *pos = 1;
        *child = n->kids;
        return 1;
    }
    return PyDict_Next(n->kids, pos, NULL, child);
}

PyObject *kids_list(Node *n) {
    PyObject *out = PyList_New(kids_count(n));
    Py_ssize_t pos = 0, i = 0;
    PyObject *child;
    while (out != NULL && kids_next(n, &pos, &child))
        PyList_SET_ITEM(out, i++, Py_NewRef(child));
    return out;
}

PyObject *kids_view(Node *n) {
    PyObject *d = PyDict_New();
    Py_ssize_t pos = 0;
    PyObject *child;
    while (d != NULL && kids_next(n, &pos, &child)) {
        PyObject *key = node_tokens((Node *)child);
        if (key == NULL || PyDict_SetItem(d, key, child) < 0)
            Py_CLEAR(d);
        Py_XDECREF(key);
    }
    PyObject *view = d ? PyDictProxy_New(d) : NULL;
    Py_XDECREF(d);
    return view;
}
