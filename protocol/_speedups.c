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

static PyObject *ids_non_negative(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    Py_ssize_t n = view.len;
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
    PyBuffer_Release(&view);
    /* bytes 3 and 7 of each 8-byte word hold the sign bits of its two little-endian int32s */
    unsigned char signs = (unsigned char)(((const unsigned char *)&acc)[3] | ((const unsigned char *)&acc)[7] | tail);
    return PyBool_FromLong(!(signs & 0x80));
}

/* scan(buffer, max_str, max_bin, max_array, max_map, max_depth, max_objects) -> None or a tuple
naming the first problem, exactly as protocol.codec.scan_py finds it (codec.py raises from it):
("truncated",) ("too_large", kind, length, cap) ("depth",) ("objects",) ("ext",) ("invalid", byte)
("trailing", count). kind: 1 str, 2 bin, 3 array, 4 map. */
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
    int depth = 0;
    PyObject *problem = NULL;
    for (;;) {
        if (!remaining) {
            if (!depth) {
                break;
            }
            remaining = stack[--depth];
            continue;
        }
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
                if (kind == K_MAP) {
                    length *= 2;
                }
                objects += length;
                if (objects > max_objects) {
                    problem = Py_BuildValue("(s)", "objects");
                    goto done;
                }
                stack[depth++] = remaining;
                remaining = length;
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
    PyBuffer_Release(&view);
    if (problem == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return problem;
}

static PyMethodDef methods[] = {
    {"ids_non_negative", ids_non_negative, METH_O, "Whether no little-endian int32 in the buffer is negative."},
    {"scan", scan, METH_VARARGS, "The msgpack header scan of protocol.codec, in C (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups", "Optional C helpers of the protocol codec.", -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModule_Create(&module); }
