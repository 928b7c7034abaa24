/* Stored records of the shard layout, written from and checked into strided pages in one pass
 * (tpcache/io/storage/record.py is the specification of the record; the shard layout's Python path,
 * split + encode_header on put and check_value + copy_checksum + assemble on get, is the reference
 * these functions are held equal to).
 *
 * A shard's payload is rows of ``width`` contiguous bytes at byte offsets, from the shard's place in
 * its page, ``a*s0 + b*s1 + c*s2 + d*s3`` for a < n0, b < n1, c < n2, d < n3 (outermost first):
 * ``geometry = (width, n0, s0, n1, s1, n2, s2, n3, s3)``. Shard i lives in page ``places[2i]`` at
 * byte offset ``places[2i + 1]`` (``places``: int64 values in a bytes-like).
 *
 * encode_records(echoes, pages, places, geometry, out=None, out_offsets=None)
 *     Each shard as a whole record (header, key echo, payload gathered from the page), written
 *     without a storage key (seq 0): as a list of bytes, or into the writable buffer ``out`` at
 *     ``out_offsets[i]`` (int64 values; every record must fit) and None is returned.
 * scatter_check(values, echoes, pages, places, geometry, stable) -> bytes of codes
 *     For each store value: CHECK_OK (0) when it is a live record of ``echoes[i]`` holding a payload
 *     of the geometry's size whose header checks, and the payload, copied into the page, hashes to
 *     the header's checksum over the bytes the page now holds; CHECK_CORRUPT (1) when all of that
 *     but the payload checksum holds (the shard's rows are zero-filled); CHECK_OTHER (2) for
 *     anything else (not a bytes-like, short, dead, foreign, other format, damaged header): nothing
 *     was written, the caller's Python check names the reason. The MAC is never checked here: a
 *     reader holding a storage key takes the Python path. ``stable``: the values are memory nothing
 *     else writes (bytes objects), checked where they are; else each payload is first copied into
 *     memory of this call, checked there and copied into the page from there, so that what the page
 *     gets is what was checked even where a late transfer still writes into the value's memory.
 *
 * Every length and offset is checked before anything is written: a page too small for a shard's
 * offsets, or an ``out`` too small for a record, is a ValueError. The copies run with the GIL
 * released; every buffer is held (PyObject_GetBuffer) until the call returns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* XXH3-64 from xxHash's header, inlined as tpcache/core/treecore/_hash.h does: no library to link. */
#define XXH_INLINE_ALL
#include <xxhash.h>

/* The payload checksum: XXH3-64, from _record_avx2.c where the compiler could build it for AVX2 and
 * the CPU has it (``xxh3`` is chosen when the module is imported), else the build's own. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__AVX2__)
uint64_t tpcache_record_xxh3_avx2(const void *data, size_t len);
#endif
static uint64_t xxh3_default(const void *data, size_t len) { return XXH3_64bits(data, len); }
static uint64_t (*xxh3)(const void *, size_t) = xxh3_default;

#define HEADER_SIZE 60
#define MAX_KEY_BYTES 1024
#define RECORD_VERSION 2
#define DIMS 4

enum { CHECK_OK = 0, CHECK_CORRUPT = 1, CHECK_OTHER = 2 };

typedef struct {
    Py_ssize_t width, n[DIMS], s[DIMS];
    Py_ssize_t span;    /* bytes from a shard's offset to past its last row */
    Py_ssize_t payload; /* width * n0 * n1 * n2 * n3 */
} Geometry;

static int parse_geometry(PyObject *t, Geometry *g) {
    if (!PyArg_ParseTuple(t, "nnnnnnnnn;geometry is (width, n0, s0, n1, s1, n2, s2, n3, s3)", &g->width, &g->n[0],
                          &g->s[0], &g->n[1], &g->s[1], &g->n[2], &g->s[2], &g->n[3], &g->s[3])) {
        return -1;
    }
    Py_ssize_t payload = g->width, span = g->width;
    int bad = g->width < 1;
    for (int d = 0; d < DIMS && !bad; d++) {
        Py_ssize_t reach;
        bad = g->n[d] < 1 || g->s[d] < 0 || __builtin_mul_overflow(payload, g->n[d], &payload) ||
              __builtin_mul_overflow(g->n[d] - 1, g->s[d], &reach) || __builtin_add_overflow(span, reach, &span);
    }
    if (bad || payload > PY_SSIZE_T_MAX - HEADER_SIZE - MAX_KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "geometry: width and counts must be >= 1, strides >= 0, sizes in range");
        return -1;
    }
    g->payload = payload;
    g->span = span;
    return 0;
}

static inline uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static inline uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int b = 7; b >= 0; b--) {
        v = (v << 8) | p[b];
    }
    return v;
}

static inline void put64(unsigned char *p, uint64_t v) {
    for (int b = 0; b < 8; b++) {
        p[b] = (unsigned char)(v >> (8 * b));
    }
}

/* The header checksum: xxh3 of header[4:36] + mac + key echo (record.py's _CHECKED, _MAC). */
static uint64_t header_xxh(const unsigned char *h, const unsigned char *echo, Py_ssize_t elen) {
    unsigned char buf[32 + 16 + MAX_KEY_BYTES];
    memcpy(buf, h + 4, 32);
    memcpy(buf + 32, h + 44, 16);
    memcpy(buf + 48, echo, (size_t)elen);
    return XXH3_64bits(buf, (size_t)(48 + elen));
}

/* Whether ``v`` (``have`` bytes) is a whole live record of ``echo`` with ``plen`` payload bytes and
 * a header whose checksum matches; its payload checksum goes to ``*pxh``. */
static int header_ok(const unsigned char *v, Py_ssize_t have, const unsigned char *echo, Py_ssize_t elen,
                     Py_ssize_t plen, uint64_t *pxh) {
    Py_ssize_t end = HEADER_SIZE + elen;
    if (elen > MAX_KEY_BYTES || have < end || have - end != plen) {
        return 0;
    }
    if (memcmp(v, "TPC1", 4) != 0 || le16(v + 4) != RECORD_VERSION || le16(v + 6) != (uint64_t)elen) {
        return 0;
    }
    if (le64(v + 20) != (uint64_t)plen || memcmp(v + HEADER_SIZE, echo, (size_t)elen) != 0) {
        return 0;
    }
    if (header_xxh(v, echo, elen) != le64(v + 36)) {
        return 0;
    }
    *pxh = le64(v + 28);
    return 1;
}

/* The bytes of every row of a shard at ``base``, in payload order: gathered into ``flat``
 * (``to_page`` 0) or scattered from it (1). */
static void move_rows(unsigned char *base, unsigned char *flat, const Geometry *g, int to_page) {
    const size_t w = (size_t)g->width;
    for (Py_ssize_t a = 0; a < g->n[0]; a++) {
        for (Py_ssize_t b = 0; b < g->n[1]; b++) {
            for (Py_ssize_t c = 0; c < g->n[2]; c++) {
                unsigned char *row = base + a * g->s[0] + b * g->s[1] + c * g->s[2];
                for (Py_ssize_t d = 0; d < g->n[3]; d++, row += g->s[3], flat += w) {
                    if (to_page) {
                        memcpy(row, flat, w);
                    } else {
                        memcpy(flat, row, w);
                    }
                }
            }
        }
    }
}

static void zero_rows(unsigned char *base, const Geometry *g) {
    for (Py_ssize_t a = 0; a < g->n[0]; a++) {
        for (Py_ssize_t b = 0; b < g->n[1]; b++) {
            for (Py_ssize_t c = 0; c < g->n[2]; c++) {
                unsigned char *row = base + a * g->s[0] + b * g->s[1] + c * g->s[2];
                for (Py_ssize_t d = 0; d < g->n[3]; d++, row += g->s[3]) {
                    memset(row, 0, (size_t)g->width);
                }
            }
        }
    }
}

/* The arguments both functions share, and the buffers they hold. */
typedef struct {
    Py_ssize_t n, npages;
    Py_buffer *echoes, *pages, places;
    int have_places;
    Geometry g;
} Batch;

static void release(Batch *b) {
    for (Py_ssize_t i = 0; b->echoes != NULL && i < b->n; i++) {
        if (b->echoes[i].obj != NULL) {
            PyBuffer_Release(&b->echoes[i]);
        }
    }
    for (Py_ssize_t i = 0; b->pages != NULL && i < b->npages; i++) {
        if (b->pages[i].obj != NULL) {
            PyBuffer_Release(&b->pages[i]);
        }
    }
    PyMem_Free(b->echoes);
    PyMem_Free(b->pages);
    if (b->have_places) {
        PyBuffer_Release(&b->places);
    }
}

/* Shard i's page index (``part`` 0) or byte offset in it (1). */
static inline int64_t place(const Batch *b, Py_ssize_t i, int part) {
    int64_t v;
    memcpy(&v, (const char *)b->places.buf + 16 * i + 8 * part, 8);
    return v;
}

static inline unsigned char *shard_base(const Batch *b, Py_ssize_t i) {
    return (unsigned char *)b->pages[place(b, i, 0)].buf + place(b, i, 1);
}

/* Take the shared arguments, hold their buffers and check every shard's place; -1 with an
 * exception set (and everything released) on a bad argument. */
static int take(Batch *b, PyObject *echoes, PyObject *pages, PyObject *places, PyObject *geometry, int writable) {
    memset(b, 0, sizeof(*b));
    if (!PyList_Check(echoes) || !PyList_Check(pages)) {
        PyErr_SetString(PyExc_TypeError, "echoes and pages must be lists");
        return -1;
    }
    b->n = PyList_GET_SIZE(echoes);
    b->npages = PyList_GET_SIZE(pages);
    if (parse_geometry(geometry, &b->g) < 0 || PyObject_GetBuffer(places, &b->places, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    b->have_places = 1;
    b->echoes = PyMem_Calloc((size_t)(b->n ? b->n : 1), sizeof(Py_buffer));
    b->pages = PyMem_Calloc((size_t)(b->npages ? b->npages : 1), sizeof(Py_buffer));
    if (b->echoes == NULL || b->pages == NULL) {
        release(b);
        PyErr_NoMemory();
        return -1;
    }
    if (b->places.len / 16 != b->n || b->places.len % 16) {
        release(b);
        PyErr_SetString(PyExc_ValueError, "places must hold two int64 (page, offset) per echo");
        return -1;
    }
    for (Py_ssize_t i = 0; i < b->npages; i++) {
        PyObject *page = PyList_GET_ITEM(pages, i);
        if (PyTuple_Check(page)) { /* (address, bytes): a CPU tensor's memory, which its caller keeps */
            Py_ssize_t addr;
            if (!PyArg_ParseTuple(page, "nn;a page is a bytes-like or (address, bytes)", &addr, &b->pages[i].len) ||
                addr <= 0 || b->pages[i].len < 0) {
                if (!PyErr_Occurred()) {
                    PyErr_SetString(PyExc_ValueError, "a page's address and length must be positive");
                }
                release(b);
                return -1;
            }
            b->pages[i].buf = (void *)(uintptr_t)addr; /* obj stays NULL: nothing to release */
        } else if (PyObject_GetBuffer(page, &b->pages[i], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
            b->pages[i].obj = NULL;
            release(b);
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < b->n; i++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(echoes, i), &b->echoes[i], PyBUF_SIMPLE) < 0) {
            b->echoes[i].obj = NULL;
            release(b);
            return -1;
        }
        int64_t page = place(b, i, 0), off = place(b, i, 1);
        Py_ssize_t len = page >= 0 && page < b->npages ? b->pages[page].len : -1;
        if (b->echoes[i].len > MAX_KEY_BYTES || len < 0 || off < 0 || off > len || len - off < b->g.span) {
            release(b);
            PyErr_Format(PyExc_ValueError, "shard %zd: key echo over %d bytes, or rows outside its page", i,
                         MAX_KEY_BYTES);
            return -1;
        }
    }
    return 0;
}

/* Header, key echo and gathered payload of shard i at ``r``. */
static void write_record(const Batch *b, Py_ssize_t i, unsigned char *r) {
    const Py_buffer *e = &b->echoes[i];
    unsigned char *payload = r + HEADER_SIZE + e->len;
    move_rows(shard_base(b, i), payload, &b->g, 0);
    memset(r, 0, HEADER_SIZE);
    memcpy(r, "TPC1", 4);
    r[4] = RECORD_VERSION & 0xff, r[5] = RECORD_VERSION >> 8;
    r[6] = (unsigned char)(e->len & 0xff), r[7] = (unsigned char)(e->len >> 8);
    /* flags (8..12) and seq (12..20) stay 0: no MAC, a key-value store's value */
    put64(r + 20, (uint64_t)b->g.payload);
    put64(r + 28, xxh3(payload, (size_t)b->g.payload));
    memcpy(r + HEADER_SIZE, e->buf, (size_t)e->len);
    put64(r + 36, header_xxh(r, e->buf, e->len));
}

/* Records into ``out`` at ``at`` (int64 offsets): -1 with an exception set if one would not fit. */
static int encode_into(const Batch *b, PyObject *out, PyObject *at) {
    Py_buffer ob, oo;
    if (PyObject_GetBuffer(out, &ob, PyBUF_WRITABLE) < 0) {
        return -1;
    }
    if (PyObject_GetBuffer(at, &oo, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&ob);
        return -1;
    }
    int ok = oo.len / 8 == b->n && oo.len % 8 == 0;
    for (Py_ssize_t i = 0; ok && i < b->n; i++) {
        int64_t off;
        memcpy(&off, (const char *)oo.buf + 8 * i, 8);
        ok = off >= 0 && off <= ob.len && ob.len - off >= HEADER_SIZE + b->echoes[i].len + b->g.payload;
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < b->n; i++) {
            int64_t off;
            memcpy(&off, (const char *)oo.buf + 8 * i, 8);
            write_record(b, i, (unsigned char *)ob.buf + off);
        }
        Py_END_ALLOW_THREADS
    } else {
        PyErr_SetString(PyExc_ValueError, "out_offsets must hold one int64 per shard, each record inside out");
    }
    PyBuffer_Release(&oo);
    PyBuffer_Release(&ob);
    return ok ? 0 : -1;
}

static PyObject *encode_records(PyObject *self, PyObject *args) {
    PyObject *echoes, *pages, *places, *geometry, *out = Py_None, *at = Py_None;
    Batch b;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOO|OO", &echoes, &pages, &places, &geometry, &out, &at) ||
        take(&b, echoes, pages, places, geometry, 0) < 0) {
        return NULL;
    }
    if (out != Py_None) {
        int rc = encode_into(&b, out, at);
        release(&b);
        return rc < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *result = PyList_New(b.n);
    for (Py_ssize_t i = 0; result != NULL && i < b.n; i++) {
        PyObject *r = PyBytes_FromStringAndSize(NULL, HEADER_SIZE + b.echoes[i].len + b.g.payload);
        if (r == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, r);
    }
    if (result != NULL) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < b.n; i++) {
            write_record(&b, i, (unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(result, i)));
        }
        Py_END_ALLOW_THREADS
    }
    release(&b);
    return result;
}

static PyObject *scatter_check(PyObject *self, PyObject *args) {
    PyObject *values, *echoes, *pages, *places, *geometry;
    int stable;
    Batch b;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!OOOOp", &PyList_Type, &values, &echoes, &pages, &places, &geometry, &stable) ||
        take(&b, echoes, pages, places, geometry, 1) < 0) {
        return NULL;
    }
    if (PyList_GET_SIZE(values) != b.n) {
        release(&b);
        PyErr_SetString(PyExc_ValueError, "scatter_check: one value per echo");
        return NULL;
    }
    PyObject *codes = PyBytes_FromStringAndSize(NULL, b.n);
    Py_buffer *vals = PyMem_Calloc((size_t)(b.n ? b.n : 1), sizeof(Py_buffer));
    if (codes == NULL || vals == NULL) {
        Py_XDECREF(codes);
        PyMem_Free(vals);
        release(&b);
        return PyErr_NoMemory();
    }
    char *code = PyBytes_AS_STRING(codes);
    for (Py_ssize_t i = 0; i < b.n; i++) { /* a value that is not a bytes-like is the Python check's */
        PyObject *v = PyList_GET_ITEM(values, i);
        if (!PyObject_CheckBuffer(v) || PyObject_GetBuffer(v, &vals[i], PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            vals[i].obj = NULL;
        }
    }
    unsigned char *scratch = NULL;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    if (!stable) {
        scratch = malloc((size_t)b.g.payload);
        failed = scratch == NULL;
    }
    for (Py_ssize_t i = 0; !failed && i < b.n; i++) {
        uint64_t want;
        code[i] = CHECK_OTHER;
        if (vals[i].obj == NULL ||
            !header_ok(vals[i].buf, vals[i].len, b.echoes[i].buf, b.echoes[i].len, b.g.payload, &want)) {
            continue;
        }
        unsigned char *base = shard_base(&b, i);
        unsigned char *payload = (unsigned char *)vals[i].buf + HEADER_SIZE + b.echoes[i].len;
        if (!stable) {
            memcpy(scratch, payload, (size_t)b.g.payload);
            payload = scratch;
        }
        if (xxh3(payload, (size_t)b.g.payload) == want) {
            move_rows(base, payload, &b.g, 1);
            code[i] = CHECK_OK;
        } else {
            code[i] = CHECK_CORRUPT;
            zero_rows(base, &b.g); /* a shard that fails leaves zeros, as the Python check does */
        }
    }
    free(scratch);
    Py_END_ALLOW_THREADS
    if (failed) {
        Py_DECREF(codes);
        codes = PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        if (vals[i].obj != NULL) {
            PyBuffer_Release(&vals[i]);
        }
    }
    PyMem_Free(vals);
    release(&b);
    return codes;
}

static PyMethodDef methods[] = {
    {"encode_records", encode_records, METH_VARARGS, "Shards gathered from pages as whole records (see the source)."},
    {"scatter_check", scatter_check, METH_VARARGS, "Check records and scatter their payloads into pages."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_record", "Stored records of the shard layout, gathered and checked in one pass.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__record(void) {
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__AVX2__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        xxh3 = tpcache_record_xxh3_avx2;
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "CHECK_OK", CHECK_OK) < 0 ||
        PyModule_AddIntConstant(m, "CHECK_CORRUPT", CHECK_CORRUPT) < 0 ||
        PyModule_AddIntConstant(m, "CHECK_OTHER", CHECK_OTHER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
