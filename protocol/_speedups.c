/* Optional C helpers of the protocol codec; protocol/ids.py and protocol/codec.py fall back to pure
Python without them, and tests hold both to the same answers.

ids_non_negative(buffer) -> bool: whether no little-endian int32 in the buffer is negative, i.e.
the top bit of every fourth byte is clear. The buffer's length is a multiple of 4 (checked by the
caller). Words are read 8 bytes at a time and OR-ed together, so a 16 KiB id array costs about a
microsecond instead of a strided copy.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_speedups.h"

/* whether no little-endian int32 in p[0..n) is negative (n a multiple of 4) */
int no_negative(const unsigned char *p, Py_ssize_t n) {
    uint64_t acc = 0;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t word;
        memcpy(&word, p + i, 8); /* byte order does not matter: only the positions of the sign bytes */
        acc |= word;
    }
    unsigned char tail = 0;
    for (Py_ssize_t j = i + 3; j < n; j += 4) {
        tail |= p[j];
    }
    /* bytes 3 and 7 of each 8-byte word hold the sign bits of its two little-endian int32s */
    unsigned char signs = (unsigned char)(((const unsigned char *)&acc)[3] | ((const unsigned char *)&acc)[7] | tail);
    return !(signs & 0x80);
}

/* no_negative(src, n), copying src[0..n) to dst on the way: one pass over the ids instead of a
check and then a copy (the compiler vectorises the loop) */
int copy_no_negative(unsigned char *restrict dst, const unsigned char *restrict src, Py_ssize_t n) {
    uint64_t acc = 0;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t word;
        memcpy(&word, src + i, 8);
        memcpy(dst + i, &word, 8);
        acc |= word;
    }
    unsigned char tail = 0;
    if (i < n) { /* one int32 left: n is a multiple of 4 */
        memcpy(dst + i, src + i, (size_t)(n - i));
        tail = src[i + 3];
    }
    unsigned char signs = (unsigned char)(((const unsigned char *)&acc)[3] | ((const unsigned char *)&acc)[7] | tail);
    return !(signs & 0x80);
}

static PyObject *ids_non_negative(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    int ok = no_negative((const unsigned char *)view.buf, view.len);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* scan(buffer, max_str, max_bin, max_array, max_map, max_depth, max_objects) -> None or a tuple
naming the first problem, exactly as protocol.codec.scan_py finds it (codec.py raises from it):
("truncated",) ("too_large", kind, length, cap) ("depth",) ("objects",) ("ext",) ("invalid", byte)
("trailing", count) ("key_type",) ("duplicate_key",). kind: 1 str, 2 bin, 3 array, 4 map.

Every open map keeps its keys seen so far in an open-addressing table (FNV-1a over the key's
bytes, twice as many slots as the map has pairs), taken from one arena in stack order: a map's
table is dropped when the map closes, so the arena never holds more than the open maps' tables. */
enum { K_SCALAR, K_STR, K_BIN, K_ARRAY, K_MAP, K_EXT, K_INVALID };

static void header(unsigned char b, int *kind, int *size_bytes, int64_t *length) {
    *size_bytes = 0;
    *length = 0;
    if (b <= 0x7f || b >= 0xe0) {
        *kind = K_SCALAR;
    } else if (b <= 0x8f) {
        *kind = K_MAP;
        *length = b & 0x0f;
    } else if (b <= 0x9f) {
        *kind = K_ARRAY;
        *length = b & 0x0f;
    } else if (b <= 0xbf) {
        *kind = K_STR;
        *length = b & 0x1f;
    } else {
        switch (b) {
        case 0xc0: case 0xc2: case 0xc3: *kind = K_SCALAR; break;
        case 0xc1: *kind = K_INVALID; break;
        case 0xc4: *kind = K_BIN; *size_bytes = 1; break;
        case 0xc5: *kind = K_BIN; *size_bytes = 2; break;
        case 0xc6: *kind = K_BIN; *size_bytes = 4; break;
        case 0xca: *kind = K_SCALAR; *length = 4; break;
        case 0xcb: *kind = K_SCALAR; *length = 8; break;
        case 0xcc: case 0xd0: *kind = K_SCALAR; *length = 1; break;
        case 0xcd: case 0xd1: *kind = K_SCALAR; *length = 2; break;
        case 0xce: case 0xd2: *kind = K_SCALAR; *length = 4; break;
        case 0xcf: case 0xd3: *kind = K_SCALAR; *length = 8; break;
        case 0xd9: *kind = K_STR; *size_bytes = 1; break;
        case 0xda: *kind = K_STR; *size_bytes = 2; break;
        case 0xdb: *kind = K_STR; *size_bytes = 4; break;
        case 0xdc: *kind = K_ARRAY; *size_bytes = 2; break;
        case 0xdd: *kind = K_ARRAY; *size_bytes = 4; break;
        case 0xde: *kind = K_MAP; *size_bytes = 2; break;
        case 0xdf: *kind = K_MAP; *size_bytes = 4; break;
        default: *kind = K_EXT; break; /* 0xc7..0xc9 ext, 0xd4..0xd8 fixext */
        }
    }
}

#define MAX_STACK 64 /* deeper than any max_depth a server sets; a larger one is refused below */

typedef struct {
    int64_t off; /* key payload offset in the frame; -1: empty slot */
    int64_t len;
} key_slot;

typedef struct {
    key_slot *slots;
    int64_t top, cap;
} key_arena;

/* A table of 2**k >= 2 * pairs slots on top of the arena; returns its first index, -1 on no memory. */
static int64_t table_open(key_arena *a, int64_t pairs, int64_t *mask) {
    int64_t size = 8;
    while (size < 2 * pairs) {
        size <<= 1;
    }
    if (a->top + size > a->cap) {
        int64_t cap = a->cap ? a->cap : 256;
        while (cap < a->top + size) {
            cap <<= 1;
        }
        key_slot *grown = PyMem_Realloc(a->slots, (size_t)cap * sizeof(key_slot));
        if (grown == NULL) {
            return -1;
        }
        a->slots = grown;
        a->cap = cap;
    }
    int64_t base = a->top;
    for (int64_t i = 0; i < size; i++) {
        a->slots[base + i].off = -1;
    }
    a->top += size;
    *mask = size - 1;
    return base;
}

/* Insert the key d[off, off + len) into the table at base; 1 when it was already there. */
static int table_insert(key_arena *a, int64_t base, int64_t mask, const unsigned char *d, int64_t off, int64_t len) {
    uint64_t h = 1469598103934665603ULL;
    for (int64_t i = 0; i < len; i++) {
        h = (h ^ d[off + i]) * 1099511628211ULL;
    }
    for (int64_t i = (int64_t)(h & (uint64_t)mask);; i = (i + 1) & mask) {
        key_slot *slot = &a->slots[base + i];
        if (slot->off < 0) {
            slot->off = off;
            slot->len = len;
            return 0;
        }
        if (slot->len == len && memcmp(d + slot->off, d + off, (size_t)len) == 0) {
            return 1;
        }
    }
}

static PyObject *scan(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    long long cap[5] = {0, 0, 0, 0, 0};
    long long max_depth, max_objects;
    if (!PyArg_ParseTuple(args, "y*LLLLLL", &view, &cap[K_STR], &cap[K_BIN], &cap[K_ARRAY], &cap[K_MAP], &max_depth,
                          &max_objects)) {
        return NULL;
    }
    if (max_depth < 0 || max_depth > MAX_STACK) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "max_depth out of the C scanner's range");
        return NULL;
    }
    const unsigned char *d = (const unsigned char *)view.buf;
    int64_t n = view.len, pos = 0, objects = 1, remaining = 1;
    int64_t stack[MAX_STACK];
    /* per level: the table of the open map's keys (base -1: not a map), as in codec.scan_py */
    int64_t key_base = -1, key_mask = 0;
    int64_t base_stack[MAX_STACK], mask_stack[MAX_STACK];
    key_arena arena = {NULL, 0, 0};
    int depth = 0;
    PyObject *problem = NULL;
    for (;;) {
        if (!remaining) {
            if (!depth) {
                break;
            }
            if (key_base >= 0) {
                arena.top = key_base; /* the closed map's table goes */
            }
            depth--;
            remaining = stack[depth];
            key_base = base_stack[depth];
            key_mask = mask_stack[depth];
            continue;
        }
        /* a map's items alternate key, value; its count is even exactly at a key */
        int is_key = key_base >= 0 && !(remaining & 1);
        remaining--;
        if (pos >= n) {
            problem = Py_BuildValue("(s)", "truncated");
            goto done;
        }
        int kind, size_bytes;
        int64_t length;
        unsigned char b = d[pos++];
        header(b, &kind, &size_bytes, &length);
        if (size_bytes) {
            if (pos + size_bytes > n) {
                problem = Py_BuildValue("(s)", "truncated");
                goto done;
            }
            length = 0;
            for (int i = 0; i < size_bytes; i++) {
                length = (length << 8) | d[pos + i];
            }
            pos += size_bytes;
        }
        if (is_key) {
            if (kind != K_STR) {
                problem = Py_BuildValue("(s)", "key_type");
                goto done;
            }
            if (length <= cap[K_STR] && length <= n - pos && table_insert(&arena, key_base, key_mask, d, pos, length)) {
                problem = Py_BuildValue("(s)", "duplicate_key");
                goto done;
            }
        }
        if (kind <= K_BIN) {
            if (kind && length > cap[kind]) {
                problem = Py_BuildValue("(siLL)", "too_large", kind, (long long)length, cap[kind]);
                goto done;
            }
            pos += length;
        } else if (kind <= K_MAP) {
            if (length > cap[kind]) {
                problem = Py_BuildValue("(siLL)", "too_large", kind, (long long)length, cap[kind]);
                goto done;
            }
            if (depth >= max_depth) {
                problem = Py_BuildValue("(s)", "depth");
                goto done;
            }
            if (length) {
                int64_t pairs = length;
                if (kind == K_MAP) {
                    length *= 2;
                }
                objects += length;
                if (objects > max_objects) {
                    problem = Py_BuildValue("(s)", "objects");
                    goto done;
                }
                stack[depth] = remaining;
                base_stack[depth] = key_base;
                mask_stack[depth] = key_mask;
                depth++;
                remaining = length;
                key_base = -1;
                if (kind == K_MAP) {
                    key_base = table_open(&arena, pairs, &key_mask);
                    if (key_base < 0) {
                        PyErr_NoMemory();
                        goto done;
                    }
                }
            }
        } else if (kind == K_EXT) {
            problem = Py_BuildValue("(s)", "ext");
            goto done;
        } else {
            problem = Py_BuildValue("(si)", "invalid", (int)b);
            goto done;
        }
    }
    if (pos > n) {
        problem = Py_BuildValue("(s)", "truncated");
    } else if (pos < n) {
        problem = Py_BuildValue("(sL)", "trailing", (long long)(n - pos));
    }
done:
    PyMem_Free(arena.slots);
    PyBuffer_Release(&view);
    if (problem == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return problem;
}

static PyMethodDef methods[] = {
    {"ids_non_negative", ids_non_negative, METH_O, "Whether no little-endian int32 in the buffer is negative."},
    {"scan", scan, METH_VARARGS, "The msgpack header scan of protocol.codec, in C (see the source)."},
    {"match_request", match_request, METH_VARARGS, "The fast reader of a plain match request (see the source)."},
    {"match_reply", match_reply, METH_VARARGS, "The frame of a successful match reply (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups", "Optional C helpers of the protocol codec.", -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (match_init() < 0) {
        return NULL;
    }
    return PyModule_Create(&module);
}
