/* The ledger's per-node kernels in C: a node's digest record and counter flags, the pins, stamps
 * and hits of a path (Ledger.touch) and a holding's digest terms (the candidates' kernels are in
 * _candidates.c). accounting.py, ledger.py and holdings.py keep the Python versions as the
 * reference; tests hold the two equal (same records, digests, counters).
 *
 * Records are XXH3-64 (seed 0, default secret) of the same little-endian fields the reference
 * packs, so digests do not depend on which path computed them. Records take inputs of 17-128 bytes
 * (a record is 64 bytes, a holding term 24); the branch for inputs over 240 bytes (with a seed) is
 * here for the page hashes of _chain.c, and ``xxh3_64`` covers lists of ids of any length (_round.c).
 * Both are written from the specification (xxHash's doc/xxhash_spec.md); tests compare them with
 * the xxhash package for every length and seed they take.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_node.h"
#include "_xxh3.h"

#define PRIME32_1 UINT64_C(0x9E3779B1)
#define PRIME32_2 UINT64_C(0x85EBCA77)
#define PRIME32_3 UINT64_C(0xC2B2AE3D)
#define PRIME64_1 UINT64_C(0x9E3779B185EBCA87)
#define PRIME64_2 UINT64_C(0xC2B2AE3D27D4EB4F)
#define PRIME64_3 UINT64_C(0x165667B19E3779F9)
#define PRIME64_4 UINT64_C(0x85EBCA77C2B2AE63)
#define PRIME64_5 UINT64_C(0x27D4EB2F165667C5)
#define PRIME_MX1 UINT64_C(0x165667919E3779F9)

static const uint8_t SECRET[XXH3_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* Little-endian 64-bit loads and stores: one instruction each on a little-endian host (the
 * byte loop the compiler does not always fold otherwise). */
static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void write64(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static inline uint64_t mul_fold(uint64_t a, uint64_t b) {
    __uint128_t m = (__uint128_t)a * b;
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

static inline uint64_t mix16(const uint8_t *data, const uint8_t *secret, uint64_t seed) {
    return mul_fold(read64(data) ^ (read64(secret) + seed), read64(data + 8) ^ (read64(secret + 8) - seed));
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PRIME_MX1;
    return h ^ (h >> 32);
}

uint64_t xxh3_17to128(const uint8_t *input, size_t len, uint64_t seed) {
    uint64_t acc = len * PRIME64_1;
    for (int i = (int)((len - 1) >> 5); i >= 0; i--) {
        acc += mix16(input + 16 * i, SECRET + 32 * i, seed);
        acc += mix16(input + len - 16 * i - 16, SECRET + 32 * i + 16, seed);
    }
    return avalanche(acc);
}

/* XXH3-64 with seed 0 of ``len`` bytes, a multiple of 8 (a list of int64 ids): the branches of the
 * specification for 0, 8, 16, 17-128, 129-240 and longer inputs. */
uint64_t xxh3_64(const uint8_t *input, size_t len) {
    if (len == 0) {
        uint64_t h = read64(SECRET + 56) ^ read64(SECRET + 64); /* XXH64's avalanche of it */
        h ^= h >> 33;
        h *= PRIME64_2;
        h ^= h >> 29;
        h *= PRIME64_3;
        return h ^ (h >> 32);
    }
    if (len <= 8) {
        uint32_t lo, hi;
        memcpy(&lo, input, 4);
        memcpy(&hi, input + len - 4, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        lo = __builtin_bswap32(lo);
        hi = __builtin_bswap32(hi);
#endif
        uint64_t h = ((uint64_t)hi + ((uint64_t)lo << 32)) ^ (read64(SECRET + 8) ^ read64(SECRET + 16));
        h ^= (h << 49 | h >> 15) ^ (h << 24 | h >> 40);
        h *= UINT64_C(0x9FB21C651E98DF25);
        h ^= (h >> 35) + len;
        h *= UINT64_C(0x9FB21C651E98DF25);
        return h ^ (h >> 28);
    }
    if (len <= 16) {
        uint64_t lo = read64(input) ^ (read64(SECRET + 24) ^ read64(SECRET + 32));
        uint64_t hi = read64(input + len - 8) ^ (read64(SECRET + 40) ^ read64(SECRET + 48));
        return avalanche(len + __builtin_bswap64(lo) + hi + mul_fold(lo, hi));
    }
    if (len <= 128)
        return xxh3_17to128(input, len, 0);
    if (len <= 240) {
        uint64_t acc = len * PRIME64_1;
        for (size_t i = 0; i < 8; i++)
            acc += mix16(input + 16 * i, SECRET + 16 * i, 0);
        acc = avalanche(acc);
        for (size_t i = 8; i < len / 16; i++)
            acc += mix16(input + 16 * i, SECRET + 16 * (i - 8) + 3, 0);
        acc += mix16(input + len - 16, SECRET + 136 - 17, 0);
        return avalanche(acc);
    }
    return xxh3_long(input, len, SECRET);
}

void xxh3_secret(uint64_t seed, uint8_t *out) {
    for (int i = 0; i < XXH3_SECRET_SIZE / 16; i++) {
        write64(out + 16 * i, read64(SECRET + 16 * i) + seed);
        write64(out + 16 * i + 8, read64(SECRET + 16 * i + 8) - seed);
    }
}

/* One 64-byte stripe into the eight accumulators, with the secret at ``secret``; and the scramble
 * after each block. With SSE2 (every x86-64) two lanes at a time, the same arithmetic: a lane's
 * 32x32-bit product is _mm_mul_epu32, and a lane gets its neighbour's input by swapping halves. */
#if defined(__SSE2__)
#include <emmintrin.h>

static inline void accumulate(uint64_t *acc, const uint8_t *stripe, const uint8_t *secret) {
    for (int i = 0; i < 4; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(acc + 2 * i));
        __m128i v = _mm_loadu_si128((const __m128i *)(stripe + 16 * i));
        __m128i k = _mm_xor_si128(v, _mm_loadu_si128((const __m128i *)(secret + 16 * i)));
        __m128i product = _mm_mul_epu32(k, _mm_srli_epi64(k, 32));
        a = _mm_add_epi64(a, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
        _mm_storeu_si128((__m128i *)(acc + 2 * i), _mm_add_epi64(a, product));
    }
}

static inline void scramble(uint64_t *acc, const uint8_t *secret) {
    const __m128i prime = _mm_set1_epi32((int)PRIME32_1);
    for (int i = 0; i < 4; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(acc + 2 * i));
        a = _mm_xor_si128(_mm_xor_si128(a, _mm_srli_epi64(a, 47)), _mm_loadu_si128((const __m128i *)(secret + 16 * i)));
        __m128i lo = _mm_mul_epu32(a, prime), hi = _mm_mul_epu32(_mm_srli_epi64(a, 32), prime);
        _mm_storeu_si128((__m128i *)(acc + 2 * i), _mm_add_epi64(lo, _mm_slli_epi64(hi, 32)));
    }
}
#else
static inline void accumulate(uint64_t *acc, const uint8_t *stripe, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = read64(stripe + 8 * i), k = v ^ read64(secret + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFu) * (k >> 32);
    }
}

static inline void scramble(uint64_t *acc, const uint8_t *secret) {
    for (int i = 0; i < 8; i++)
        acc[i] = (acc[i] ^ acc[i] >> 47 ^ read64(secret + 8 * i)) * PRIME32_1;
}
#endif

enum { STRIPE = 64, PER_BLOCK = (XXH3_SECRET_SIZE - STRIPE) / 8, BLOCK = STRIPE * PER_BLOCK };

/* The eight accumulators merged into the hash of ``len`` bytes: the end of every long hash. */
static uint64_t merge_acc(const uint64_t *acc, size_t len, const uint8_t *secret) {
    uint64_t h = len * PRIME64_1;
    for (int i = 0; i < 4; i++)
        h += mul_fold(acc[2 * i] ^ read64(secret + 11 + 16 * i), acc[2 * i + 1] ^ read64(secret + 19 + 16 * i));
    return avalanche(h);
}

#if defined(__x86_64__) && defined(__GNUC__)
/* With AVX2 (checked at run time: the build targets plain x86-64) four lanes at a time, the eight
 * accumulators in two registers; the same arithmetic as ``accumulate`` and ``scramble``. */
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline void accumulate_avx2(__m256i *acc, const uint8_t *stripe, const uint8_t *secret) {
    for (int i = 0; i < 2; i++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(stripe + 32 * i));
        __m256i k = _mm256_xor_si256(v, _mm256_loadu_si256((const __m256i *)(secret + 32 * i)));
        __m256i product = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));
        acc[i] = _mm256_add_epi64(_mm256_add_epi64(acc[i], _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2))), product);
    }
}

AVX2 static uint64_t xxh3_long_avx2(const uint8_t *input, size_t len, const uint8_t *secret) {
    uint64_t init[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)init), _mm256_loadu_si256((const __m256i *)(init + 4))};
    const __m256i prime = _mm256_set1_epi32((int)PRIME32_1);
    size_t blocks = (len - 1) / BLOCK;
    for (size_t b = 0; b < blocks; b++) {
        for (size_t s = 0; s < PER_BLOCK; s++)
            accumulate_avx2(acc, input + b * BLOCK + s * STRIPE, secret + 8 * s);
        for (int i = 0; i < 2; i++) {
            __m256i a = acc[i], key = _mm256_loadu_si256((const __m256i *)(secret + XXH3_SECRET_SIZE - STRIPE + 32 * i));
            a = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)), key);
            __m256i lo = _mm256_mul_epu32(a, prime), hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
            acc[i] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
        }
    }
    size_t stripes = (len - 1 - blocks * BLOCK) / STRIPE;
    for (size_t s = 0; s < stripes; s++)
        accumulate_avx2(acc, input + blocks * BLOCK + s * STRIPE, secret + 8 * s);
    accumulate_avx2(acc, input + len - STRIPE, secret + XXH3_SECRET_SIZE - STRIPE - 7);
    uint64_t out[8];
    _mm256_storeu_si256((__m256i *)out, acc[0]);
    _mm256_storeu_si256((__m256i *)(out + 4), acc[1]);
    return merge_acc(out, len, secret);
}

static int use_avx2 = -1; /* unknown until the first long hash */
#endif

/* Without AVX2: SSE2 on x86-64, else plain C (``accumulate``). */
static uint64_t xxh3_long_portable(const uint8_t *input, size_t len, const uint8_t *secret) {
    uint64_t acc[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    size_t blocks = (len - 1) / BLOCK;
    for (size_t b = 0; b < blocks; b++) {
        for (size_t s = 0; s < PER_BLOCK; s++)
            accumulate(acc, input + b * BLOCK + s * STRIPE, secret + 8 * s);
        scramble(acc, secret + XXH3_SECRET_SIZE - STRIPE);
    }
    size_t stripes = (len - 1 - blocks * BLOCK) / STRIPE;
    for (size_t s = 0; s < stripes; s++)
        accumulate(acc, input + blocks * BLOCK + s * STRIPE, secret + 8 * s);
    accumulate(acc, input + len - STRIPE, secret + XXH3_SECRET_SIZE - STRIPE - 7); /* the last stripe */
    return merge_acc(acc, len, secret);
}

uint64_t xxh3_long(const uint8_t *input, size_t len, const uint8_t *secret) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (use_avx2 < 0)
        use_avx2 = __builtin_cpu_supports("avx2") != 0;
    if (use_avx2)
        return xxh3_long_avx2(input, len, secret);
#endif
    return xxh3_long_portable(input, len, secret);
}

/* The reference record (accounting.reference_record_of), called for what the kernel does not cover: a node with a
 * component record, or a reference node. Set once by accounting.py. */
static PyObject *record_fallback = NULL;

/* The record of a native node without components: 0 and an exception on a field that is not an int. */
int record_native(Node *n, uint64_t *out) {
    int64_t ds, hs, ss, dp, hp, last, hits, created;
    if (field(n->device_state, &ds) || field(n->host_state, &hs) || field(n->storage_state, &ss) ||
        field(n->device_pins, &dp) || field(n->host_pins, &hp) || field(n->last_access, &last) ||
        field(n->hits, &hits) || field(n->created_at, &created))
        return -1;
    uint8_t buf[64];
    write64(buf, n->hash);
    write64(buf + 8, (uint64_t)(ds | hs << 2 | ss << 4));
    write64(buf + 16, (uint64_t)n->device_page);
    write64(buf + 24, (uint64_t)n->host_slot);
    write64(buf + 32, (uint64_t)dp << 32 | (uint64_t)hp);
    write64(buf + 40, (uint64_t)last);
    write64(buf + 48, (uint64_t)hits);
    write64(buf + 56, (uint64_t)created);
    *out = xxh3_17to128(buf, 64, 0) & DIGEST_MASK;
    return 0;
}

int record_any(PyObject *node, uint64_t *out) {
    if (is_node(node) && ((Node *)node)->comp == Py_None)
        return record_native((Node *)node, out);
    if (record_fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_node.record_of: no reference record for this node");
        return -1;
    }
    PyObject *r = PyObject_CallOneArg(record_fallback, node);
    if (r == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static PyObject *py_record_of(PyObject *mod, PyObject *node) {
    uint64_t r;
    if (record_any(node, &r) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(r);
}

static PyObject *py_set_record_fallback(PyObject *mod, PyObject *fn) {
    Py_INCREF(fn);
    Py_XSETREF(record_fallback, fn);
    Py_RETURN_NONE;
}

/* xxh3_long(data, seed, portable=False) -> XXH3-64 of more than 240 bytes with a seed, through
 * ``xxh3_long`` or (portable) the code it runs without AVX2 (tests). */
static PyObject *py_xxh3_long(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3)
        return PyErr_Format(PyExc_TypeError, "xxh3_long takes data, a seed and an optional portable flag");
    int portable = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (portable < 0)
        return NULL;
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[1]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len <= 240) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "xxh3_long takes more than 240 bytes, not %zd", view.len);
    }
    uint8_t secret[XXH3_SECRET_SIZE];
    xxh3_secret(seed, secret);
    uint64_t h = (portable ? xxh3_long_portable : xxh3_long)(view.buf, (size_t)view.len, secret);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_xxh3(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2)
        return PyErr_Format(PyExc_TypeError, "xxh3_17to128 takes data and an optional seed");
    unsigned long long seed = nargs == 2 ? PyLong_AsUnsignedLongLong(args[1]) : 0;
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len < 17 || view.len > 128) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "xxh3_17to128 takes 17 to 128 bytes, not %zd", view.len);
    }
    uint64_t h = xxh3_17to128(view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *mix_fallback = NULL; /* digest.reference_mix, set once by digest.py */

/* The reference's answer (its value, or what it raises) for fields the kernel does not take. */
static PyObject *mix_by_reference(PyObject *const *args, Py_ssize_t nargs) {
    if (mix_fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_node.mix: no reference mix set");
        return NULL;
    }
    return PyObject_Vectorcall(mix_fallback, args, (size_t)nargs, NULL);
}

/* mix(*fields): digest.mix, XXH3-64 of up to eight fields packed as "<QqqqqqqQ" (the first and
 * last unsigned, the rest signed; unused fields zero), masked to 62 bits. A field that does not
 * fit or is not an int goes to the reference, which raises what it raises. */
static PyObject *py_mix(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 8)
        return mix_by_reference(args, nargs);
    uint8_t buf[64] = {0};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (!PyLong_Check(args[i]))
            return mix_by_reference(args, nargs);
        uint64_t v;
        if (i == 0 || i == 7) {
            v = PyLong_AsUnsignedLongLong(args[i]);
        } else {
            int overflow;
            v = (uint64_t)PyLong_AsLongLongAndOverflow(args[i], &overflow);
            if (overflow)
                return mix_by_reference(args, nargs);
        }
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return mix_by_reference(args, nargs);
        }
        write64(buf + 8 * i, v);
    }
    return PyLong_FromUnsignedLongLong(xxh3_17to128(buf, 64, 0) & DIGEST_MASK);
}

static PyObject *py_set_mix_fallback(PyObject *mod, PyObject *fn) {
    Py_INCREF(fn);
    Py_XSETREF(mix_fallback, fn);
    Py_RETURN_NONE;
}

/* touch(nodes, device_pins, stamp, hit, clock, digest, candidates) -> (digest, evictable delta,
 * protected delta): Ledger.touch's loop (see there), each node offered to ``candidates`` as
 * Candidates.offer does (``lazy_offer``), its heaps loaded at the first push. */
static PyObject *py_touch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7)
        return PyErr_Format(PyExc_TypeError, "touch takes 7 arguments, not %zd", nargs);
    long long delta = PyLong_AsLongLong(args[1]);
    int stamp = PyObject_IsTrue(args[2]), hit = PyObject_IsTrue(args[3]);
    PyObject *clock = args[4];
    LazyHeaps heaps = {.cands = args[6]};
    unsigned long long value = PyLong_AsUnsignedLongLongMask(args[5]);
    if (PyErr_Occurred() || stamp < 0 || hit < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "touch takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    int64_t evictable = 0, protected_ = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!is_node(item)) {
            PyErr_SetString(PyExc_TypeError, "touch: a native Node");
            goto fail;
        }
        Node *n = (Node *)item;
        int64_t pins, state, hits;
        uint64_t rec, old = n->record;
        if (field(n->device_pins, &pins) || field(n->device_state, &state))
            goto fail;
        int64_t now = pins + delta;
        if (set_int(&n->device_pins, now) < 0)
            goto fail;
        if (state == 2)
            evictable += (now == 0) - (pins == 0);
        if (state != 0)
            protected_ += (now > 0) - (pins > 0);
        if (stamp) {
            Py_INCREF(clock);
            Py_SETREF(n->last_access, clock);
        }
        if (hit && (field(n->hits, &hits) || set_int(&n->hits, hits + 1) < 0))
            goto fail;
        if (record_any(item, &rec) < 0)
            goto fail;
        n->record = rec;
        value += rec - old;
        if (lazy_offer(&heaps, item) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    lazy_clear(&heaps);
    return Py_BuildValue("KLL", value & DIGEST_MASK, (long long)evictable, (long long)protected_);
fail:
    lazy_clear(&heaps);
    Py_DECREF(seq);
    return NULL;
}

/* ------------------------------------------------------------------ lease records */

static PyObject *s_lease_id, *s_device_nodes, *s_host_nodes, *s_pages, *s_ops, *s_releasing, *s_cursor,
    *s_prefetch, *s_admission, *s_parts, *s_hit_pages, *s_record, *s_kept, *s_total, *s_node_id;

static int load_lease_names(void) {
    if (s_node_id != NULL)
        return 0;
    if (INTERN(lease_id) || INTERN(device_nodes) || INTERN(host_nodes) || INTERN(pages) || INTERN(ops) ||
        INTERN(releasing) || INTERN(cursor) || INTERN(prefetch) || INTERN(admission) || INTERN(parts) ||
        INTERN(hit_pages) || INTERN(record) || INTERN(kept) || INTERN(total) || INTERN(node_id))
        return -1;
    return 0;
}

/* An int attribute of ``o`` (``sub`` of it when given: lease.pages.total): 0, or -1 and an exception. */
static int int_attr(PyObject *o, PyObject *name, PyObject *sub, int64_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (sub == s_total && is_holding(v)) { /* a native holding's total, read without an int object */
        *out = (int64_t)((Holding *)v)->total;
        Py_DECREF(v);
        return 0;
    }
    if (v != NULL && sub != NULL)
        Py_SETREF(v, PyObject_GetAttr(v, sub));
    int rc = v == NULL ? -1 : field(v, out);
    Py_XDECREF(v);
    return rc;
}

/* 1: o.name is None or empty (no prefetch, no admission, no ops, no parts), 0: it is not, -1: an error. */
static int attr_empty(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    int empty = v == Py_None ? 1 : PyObject_Not(v);
    Py_DECREF(v);
    return empty;
}

/* The records of a lease with no prefetch, admission, ops, components or protected hit
 * (accounting.lease_record, and the kept record of Leases.records): 1 with them set, 0 for any
 * other lease (the reference's), -1 and an exception. */
static int simple_lease(PyObject *lease, uint64_t tag, uint64_t no_ids, uint64_t *record, uint64_t *kept) {
    int e;
    PyObject *names[4] = {s_prefetch, s_admission, s_ops, s_parts};
    for (int i = 0; i < 4; i++)
        if ((e = attr_empty(lease, names[i])) <= 0)
            return e;
    int64_t id, dn, hn, pages, hit, releasing;
    if (int_attr(lease, s_hit_pages, NULL, &hit) || int_attr(lease, s_lease_id, NULL, &id) ||
        int_attr(lease, s_device_nodes, s_total, &dn) || int_attr(lease, s_host_nodes, s_total, &hn) ||
        int_attr(lease, s_pages, s_total, &pages))
        return -1;
    if (hit != 0)
        return 0;
    PyObject *r = PyObject_GetAttr(lease, s_releasing), *cursor = r ? PyObject_GetAttr(lease, s_cursor) : NULL;
    releasing = r ? PyObject_IsTrue(r) : -1;
    int64_t at = -1;
    int bad = cursor == NULL || releasing < 0 || (cursor != Py_None && int_attr(cursor, s_node_id, NULL, &at));
    Py_XDECREF(r);
    Py_XDECREF(cursor);
    if (bad)
        return -1;
    uint8_t buf[64];
    write64(buf, tag);
    write64(buf + 8, (uint64_t)id);
    write64(buf + 16, (uint64_t)dn);
    write64(buf + 24, (uint64_t)hn);
    write64(buf + 32, (uint64_t)pages);
    write64(buf + 40, no_ids);
    write64(buf + 48, (uint64_t)(releasing | (at + 1) << 1));
    write64(buf + 56, no_ids);
    *record = xxh3_17to128(buf, 64, 0) & DIGEST_MASK;
    *kept = 0;
    if (!releasing) {
        memset(buf, 0, sizeof buf);
        write64(buf, (uint64_t)id);
        write64(buf + 8, (uint64_t)pages);
        *kept = xxh3_17to128(buf, 64, 0) & DIGEST_MASK;
    }
    return 1;
}

/* Replace lease.<name> (an int record) with ``now``; ``*sum`` (mod 2**62) follows. */
static int swap_record(PyObject *lease, PyObject *name, uint64_t now, uint64_t *sum) {
    int64_t old;
    if (int_attr(lease, name, NULL, &old) < 0)
        return -1;
    PyObject *v = PyLong_FromUnsignedLongLong(now);
    int rc = v == NULL ? -1 : PyObject_SetAttr(lease, name, v);
    Py_XDECREF(v);
    *sum = (*sum - (uint64_t)old + now) & DIGEST_MASK;
    return rc;
}

/* fold_leases(leases, digest, kept_digest, tag, no_ids, records) -> (digest, kept_digest): Ledger.record_leases's
 * loop, re-recording each lease in both sums; ``records(lease)`` gives (record, kept) for the leases the kernel
 * does not take. */
static PyObject *py_fold_leases(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6)
        return PyErr_Format(PyExc_TypeError, "fold_leases takes 6 arguments, not %zd", nargs);
    uint64_t value = PyLong_AsUnsignedLongLongMask(args[1]), kept_sum = PyLong_AsUnsignedLongLongMask(args[2]);
    uint64_t tag = PyLong_AsUnsignedLongLongMask(args[3]), no_ids = PyLong_AsUnsignedLongLongMask(args[4]);
    if (PyErr_Occurred() || load_lease_names() < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "fold_leases takes a sequence of leases");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *lease = PySequence_Fast_GET_ITEM(seq, i);
        uint64_t record, kept;
        int simple = simple_lease(lease, tag, no_ids, &record, &kept);
        if (simple == 0) {
            PyObject *both = PyObject_CallOneArg(args[5], lease);
            if (both == NULL || !PyArg_ParseTuple(both, "KK", &record, &kept)) {
                Py_XDECREF(both);
                goto fail;
            }
            Py_DECREF(both);
        } else if (simple < 0)
            goto fail;
        if (swap_record(lease, s_record, record, &value) < 0 || swap_record(lease, s_kept, kept, &kept_sum) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return Py_BuildValue("KK", (unsigned long long)value, (unsigned long long)kept_sum);
fail:
    Py_DECREF(seq);
    return NULL;
}

int holding_term(int64_t lease, int64_t kind, PyObject *item, uint64_t *out) {
    int64_t key;
    if (is_node(item) || PyLong_Check(item)) {
        if (field(is_node(item) ? ((Node *)item)->node_id : item, &key) < 0)
            return -1;
    } else { /* any other node: its node_id */
        PyObject *id = PyObject_GetAttrString(item, "node_id");
        int bad = id == NULL || field(id, &key) < 0;
        Py_XDECREF(id);
        if (bad)
            return -1;
    }
    uint8_t buf[24];
    write64(buf, (uint64_t)lease);
    write64(buf + 8, (uint64_t)kind);
    write64(buf + 16, (uint64_t)key);
    *out = xxh3_17to128(buf, 24, 0) & DIGEST_MASK;
    return 0;
}

/* flags_of(node): accounting.reference_flags_of, evictable | protected << 1 | mirror << 2. */
static PyObject *py_flags_of(PyObject *mod, PyObject *node) {
    if (!is_node(node))
        return PyErr_Format(PyExc_TypeError, "flags_of takes a native Node, not %.100s", Py_TYPE(node)->tp_name);
    int bits;
    return node_flags((Node *)node, &bits) < 0 ? NULL : PyLong_FromLong(bits);
}

/* unresident(nodes) -> the nodes with no copy on device or host (both states 0), in order: the
 * filter a release runs over its path and a completion over its op's pages (accounting.unresident).
 * Reference nodes are tested as the reference does. */
static PyObject *py_unresident(PyObject *mod, PyObject *nodes) {
    PyObject *seq = PySequence_Fast(nodes, "unresident takes a sequence of nodes");
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t count = out ? PySequence_Fast_GET_SIZE(seq) : 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int keep;
        if (is_node(item)) {
            int64_t ds, hs;
            if (field(((Node *)item)->device_state, &ds) || field(((Node *)item)->host_state, &hs))
                goto fail;
            keep = ds == 0 && hs == 0;
        } else {
            PyObject *d = PyObject_GetAttrString(item, "device_state");
            int on = d ? PyObject_IsTrue(d) : -1;
            Py_XDECREF(d);
            if (on == 0) {
                PyObject *h = PyObject_GetAttrString(item, "host_state");
                on = h ? PyObject_IsTrue(h) : -1;
                Py_XDECREF(h);
            }
            if (on < 0)
                goto fail;
            keep = !on;
        }
        if (keep && PyList_Append(out, item) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

PyMethodDef account_methods[] = {
    {"unresident", (PyCFunction)py_unresident, METH_O, "The nodes with no copy on device or host (accounting.unresident)."},
    {"record_of", (PyCFunction)py_record_of, METH_O, "A node's digest record (accounting.record_of)."},
    {"set_record_fallback", (PyCFunction)py_set_record_fallback, METH_O,
     "The reference record, for nodes with components or reference nodes."},
    {"touch", (PyCFunction)(void (*)(void))py_touch, METH_FASTCALL, "Ledger.touch's loop over a path."},
    {"mix", (PyCFunction)(void (*)(void))py_mix, METH_FASTCALL, "digest.mix (the reference for fields it does not take)."},
    {"fold_leases", (PyCFunction)(void (*)(void))py_fold_leases, METH_FASTCALL,
     "Ledger.record_leases's loop: leases re-recorded in the state and kept digests."},
    {"set_mix_fallback", (PyCFunction)py_set_mix_fallback, METH_O, "The reference mix, for fields the kernel does not take."},
    {"flags_of", (PyCFunction)py_flags_of, METH_O, "accounting.reference_flags_of (see there)."},
    {"xxh3_17to128", (PyCFunction)(void (*)(void))py_xxh3, METH_FASTCALL, "XXH3-64 of 17 to 128 bytes with a seed (for the tests)."},
    {"xxh3_long", (PyCFunction)(void (*)(void))py_xxh3_long, METH_FASTCALL,
     "XXH3-64 of more than 240 bytes with a seed (for the tests)."},
    {NULL, NULL, 0, NULL},
};
