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

/* whether no little-endian int32 in p[0..n) is negative (n a multiple of 4) */
static int no_negative(const unsigned char *p, Py_ssize_t n) {
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
static int copy_no_negative(unsigned char *restrict dst, const unsigned char *restrict src, Py_ssize_t n) {
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

/* match_request(buffer, max_bin, max_ids, as_bytes=False) -> None or (id, tokens, storage), tokens an
array('i') (with as_bytes, the ids' little-endian bytes as one bytes object: what a cache keys pages
by, so a server's lookup copies them once, straight out of the transport's buffer): the fast reader
of the one request a server sees most, used by protocol.codec.decode_request before its general
path. It reads only a frame of exactly this form, in any key order, each key once:

    {"v": 1, "id": <u64>, "op": "match", "args": {"tokens": <bin>, "namespace"?: "", "storage"?: nil|bool}}

with ids whose byte length is a multiple of 4, at most max_ids of them, none negative, and nothing
after the value. For anything else (another op, a namespace, an encoding msgpack's packer does not
produce, any error) it answers None and the general decoder decides, errors included: whatever this
reads, the general decoder reads as the same request (tests/unit/test_protocol_codec.py). */

static PyObject *array_type; /* array.array, for the ids match_request returns */

static int read_uint(const unsigned char *p, Py_ssize_t n, Py_ssize_t *pos, uint64_t *out) {
    Py_ssize_t i = *pos;
    if (i >= n) {
        return 0;
    }
    unsigned char b = p[i];
    int size;
    if (b <= 0x7F) {
        *out = b;
        *pos = i + 1;
        return 1;
    } else if (b == 0xCC) {
        size = 1;
    } else if (b == 0xCD) {
        size = 2;
    } else if (b == 0xCE) {
        size = 4;
    } else if (b == 0xCF) {
        size = 8;
    } else {
        return 0;
    }
    if (i + 1 + size > n) {
        return 0;
    }
    uint64_t v = 0;
    for (int k = 0; k < size; k++) {
        v = (v << 8) | p[i + 1 + k];
    }
    *out = v;
    *pos = i + 1 + size;
    return 1;
}

/* a fixstr key equal to `key` (length < 32) */
static int key_is(const unsigned char *p, Py_ssize_t n, Py_ssize_t pos, const char *key, Py_ssize_t len) {
    return pos + 1 + len <= n && p[pos] == (0xA0 | len) && memcmp(p + pos + 1, key, (size_t)len) == 0;
}

static PyObject *match_request(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    long long max_bin, max_ids;
    int as_bytes = 0;
    if (!PyArg_ParseTuple(args, "y*LL|p", &view, &max_bin, &max_ids, &as_bytes)) {
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    Py_ssize_t n = view.len, pos = 0;
    uint64_t version = 0, rid = 0;
    Py_ssize_t tokens_at = -1, tokens_len = 0;
    int storage = -1; /* -1 absent or nil, 0 false, 1 true */
    int seen = 0, seen_args = 0;
    if (n < 1 || p[0] != 0x84) {
        goto fallback;
    }
    pos = 1;
    for (int k = 0; k < 4; k++) {
        if (key_is(p, n, pos, "v", 1) && !(seen & 1)) {
            seen |= 1;
            pos += 2;
            if (!read_uint(p, n, &pos, &version) || version != 1) {
                goto fallback;
            }
        } else if (key_is(p, n, pos, "id", 2) && !(seen & 2)) {
            seen |= 2;
            pos += 3;
            if (!read_uint(p, n, &pos, &rid)) {
                goto fallback;
            }
        } else if (key_is(p, n, pos, "op", 2) && !(seen & 4)) {
            seen |= 4;
            pos += 3;
            if (!key_is(p, n, pos, "match", 5)) {
                goto fallback;
            }
            pos += 6;
        } else if (key_is(p, n, pos, "args", 4) && !(seen & 8)) {
            seen |= 8;
            pos += 5;
            if (pos >= n || p[pos] < 0x81 || p[pos] > 0x83) {
                goto fallback;
            }
            int pairs = p[pos] & 0x0F;
            pos++;
            for (int a = 0; a < pairs; a++) {
                if (key_is(p, n, pos, "tokens", 6) && !(seen_args & 1)) {
                    seen_args |= 1;
                    pos += 7;
                    if (pos >= n) {
                        goto fallback;
                    }
                    unsigned char b = p[pos];
                    Py_ssize_t len;
                    if (b == 0xC4 && pos + 2 <= n) {
                        len = p[pos + 1];
                        pos += 2;
                    } else if (b == 0xC5 && pos + 3 <= n) {
                        len = ((Py_ssize_t)p[pos + 1] << 8) | p[pos + 2];
                        pos += 3;
                    } else if (b == 0xC6 && pos + 5 <= n) {
                        len = ((Py_ssize_t)p[pos + 1] << 24) | ((Py_ssize_t)p[pos + 2] << 16) |
                              ((Py_ssize_t)p[pos + 3] << 8) | p[pos + 4];
                        pos += 5;
                    } else {
                        goto fallback;
                    }
                    if (len > n - pos || len > max_bin || len % 4 || len / 4 > max_ids) {
                        goto fallback;
                    }
                    /* (no id may be negative: checked below, as the ids are copied out) */
                    tokens_at = pos;
                    tokens_len = len;
                    pos += len;
                } else if (key_is(p, n, pos, "namespace", 9) && !(seen_args & 2)) {
                    seen_args |= 2;
                    pos += 10;
                    if (pos >= n || p[pos] != 0xA0) {
                        goto fallback; /* a namespace is checked the general way */
                    }
                    pos++;
                } else if (key_is(p, n, pos, "storage", 7) && !(seen_args & 4)) {
                    seen_args |= 4;
                    pos += 8;
                    if (pos >= n || (p[pos] != 0xC0 && p[pos] != 0xC2 && p[pos] != 0xC3)) {
                        goto fallback;
                    }
                    storage = p[pos] == 0xC0 ? -1 : p[pos] == 0xC3;
                    pos++;
                } else {
                    goto fallback;
                }
            }
            if (!(seen_args & 1)) {
                goto fallback;
            }
        } else {
            goto fallback;
        }
    }
    if (pos != n) {
        goto fallback;
    }
    PyObject *flag = storage < 0 ? Py_None : storage ? Py_True : Py_False;
    PyObject *tokens;
    if (as_bytes) {
        tokens = PyBytes_FromStringAndSize(NULL, tokens_len);
        if (tokens != NULL && !copy_no_negative((unsigned char *)PyBytes_AS_STRING(tokens), p + tokens_at, tokens_len)) {
            Py_DECREF(tokens);
            goto fallback;
        }
    } else if (!no_negative(p + tokens_at, tokens_len)) {
        goto fallback;
    } else if ((tokens = PyObject_CallFunction(array_type, "s", "i")) != NULL) {
        PyObject *bytes = PyMemoryView_FromMemory((char *)p + tokens_at, tokens_len, PyBUF_READ);
        PyObject *done = bytes == NULL ? NULL : PyObject_CallMethod(tokens, "frombytes", "O", bytes);
        Py_XDECREF(bytes);
        if (done == NULL) {
            Py_CLEAR(tokens);
        }
        Py_XDECREF(done);
    }
    PyBuffer_Release(&view);
    if (tokens == NULL) {
        return NULL;
    }
    return Py_BuildValue("(KNO)", (unsigned long long)rid, tokens, flag);
fallback:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* match_reply(id, hit_tokens, device_pages, host_pages, storage_pages, device_page_ids) -> bytes: the
frame msgpack.packb gives for {"v": 1, "id": id, "op": "match", "ok": true, "result": {"hit_tokens": ...,
"device_pages": ..., "host_pages": ..., "storage_pages": ..., "device_page_ids": <bin>}} (ints in their
shortest unsigned form, the ids' bytes as one bin), byte for byte (tests hold it equal to
protocol.codec's reference encoding). The ints are u64 and the ids a buffer of int32 the caller
checked. */

static Py_ssize_t put_uint(unsigned char *out, uint64_t v) {
    if (v <= 0x7F) {
        out[0] = (unsigned char)v;
        return 1;
    }
    int size;
    if (v <= 0xFF) {
        out[0] = 0xCC;
        size = 1;
    } else if (v <= 0xFFFF) {
        out[0] = 0xCD;
        size = 2;
    } else if (v <= 0xFFFFFFFFULL) {
        out[0] = 0xCE;
        size = 4;
    } else {
        out[0] = 0xCF;
        size = 8;
    }
    for (int k = 0; k < size; k++) {
        out[1 + k] = (unsigned char)(v >> (8 * (size - 1 - k)));
    }
    return 1 + size;
}

static Py_ssize_t put_key(unsigned char *out, const char *key) {
    size_t len = strlen(key);
    out[0] = (unsigned char)(0xA0 | len);
    memcpy(out + 1, key, len);
    return (Py_ssize_t)(1 + len);
}

static PyObject *match_reply(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long rid, hit, device, host, storage;
    Py_buffer ids;
    if (!PyArg_ParseTuple(args, "KKKKKy*", &rid, &hit, &device, &host, &storage, &ids)) {
        return NULL;
    }
    Py_ssize_t len = ids.len;
    if (len > 0xFFFFFFFFLL) {
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_OverflowError, "more ids than one bin holds");
        return NULL;
    }
    /* The header (at most 150 bytes: the keys, five u64 of at most 9 bytes, a bin header) is
    written first, so that the frame is allocated at its exact size: no resize, no second copy. */
    unsigned char head[160];
    unsigned char *out = head;
    Py_ssize_t i = 0;
    out[i++] = 0x85;
    i += put_key(out + i, "v");
    out[i++] = 0x01;
    i += put_key(out + i, "id");
    i += put_uint(out + i, rid);
    i += put_key(out + i, "op");
    i += put_key(out + i, "match");
    i += put_key(out + i, "ok");
    out[i++] = 0xC3;
    i += put_key(out + i, "result");
    out[i++] = 0x85;
    i += put_key(out + i, "hit_tokens");
    i += put_uint(out + i, hit);
    i += put_key(out + i, "device_pages");
    i += put_uint(out + i, device);
    i += put_key(out + i, "host_pages");
    i += put_uint(out + i, host);
    i += put_key(out + i, "storage_pages");
    i += put_uint(out + i, storage);
    i += put_key(out + i, "device_page_ids");
    if (len <= 0xFF) {
        out[i++] = 0xC4;
        out[i++] = (unsigned char)len;
    } else if (len <= 0xFFFF) {
        out[i++] = 0xC5;
        out[i++] = (unsigned char)(len >> 8);
        out[i++] = (unsigned char)len;
    } else {
        out[i++] = 0xC6;
        for (int k = 3; k >= 0; k--) {
            out[i++] = (unsigned char)(len >> (8 * k));
        }
    }
    PyObject *frame = PyBytes_FromStringAndSize(NULL, i + len);
    if (frame != NULL) {
        memcpy(PyBytes_AS_STRING(frame), head, (size_t)i);
        memcpy(PyBytes_AS_STRING(frame) + i, ids.buf, (size_t)len);
    }
    PyBuffer_Release(&ids);
    return frame;
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
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) {
        return NULL;
    }
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (array_type == NULL) {
        return NULL;
    }
    return PyModule_Create(&module);
}
