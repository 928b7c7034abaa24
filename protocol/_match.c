/* The codec's fast path for the request a server sees most and its reply (protocol/codec.py):
match_request reads a plain match request, match_reply writes a successful match reply. Part of the
_speedups extension (_speedups.c: the id check and the header scan). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_speedups.h"

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

PyObject *match_request(PyObject *self, PyObject *args) {
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

PyObject *match_reply(PyObject *self, PyObject *args) {
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

int match_init(void) {
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) {
        return -1;
    }
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    return array_type == NULL ? -1 : 0;
}
