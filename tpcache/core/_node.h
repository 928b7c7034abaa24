/* The native tree node's layout, shared by the node type (_node.c) and the ledger's kernels
 * (_account.c, _candidates.c), which read its fields directly. */
#ifndef TPCACHE_NODE_H
#define TPCACHE_NODE_H
#include <Python.h>
#include <stdint.h>

/* Every field is an object pointer read and written as T_OBJECT_EX: the interpreter specializes
 * those attribute accesses as it does __slots__ (other member types take its slow generic path). */
#define FIELDS(X)                                                                                     \
    X(node_id) X(parent) X(children) X(tokens) X(hash) X(depth) X(device_page) X(device_state)      \
    X(device_pins) X(host_slot) X(host_state) X(host_pins) X(storage_state) X(last_access)           \
    X(created_at) X(hits) X(comp) X(record) X(run) X(run_at) X(pages_run)

#define DECLARE(name) PyObject *name;
typedef struct {
    PyObject_HEAD
    FIELDS(DECLARE)
} Node;

extern PyTypeObject NodeType;
extern PyMethodDef account_methods[];   /* _account.c */
extern PyMethodDef candidate_methods[]; /* _candidates.c */

/* Which eviction heaps a node is a candidate of: 1 device, 2 host, 0 neither, -1 an error. */
int candidacy(PyObject *node); /* _candidates.c */

static inline int is_node(PyObject *o) { return o != NULL && Py_IS_TYPE(o, &NodeType); }

/* An int field's value: -1 and an exception if it is not an int64. */
static inline int field(PyObject *v, int64_t *out) {
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)x;
    return 0;
}

#endif
