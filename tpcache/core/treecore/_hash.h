/* XXH3-64 from xxHash itself: the header of the xxHash library (Debian's libxxhash-dev,
 * /usr/include/xxhash.h), inlined into each file that hashes, so the extension links no library.
 * Where the header is missing the build skips the extension with a warning (setup.py). */
#ifndef TPCACHE_HASH_H
#define TPCACHE_HASH_H
#include <stdint.h>
#include <stddef.h>
#define XXH_INLINE_ALL
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__AVX2__)
/* The header's AVX2 kernels as well, compiled for AVX2 alone (seeded_hash runs them where the CPU has
 * it); they read and write the accumulator as 32-byte aligned vectors. */
#include <immintrin.h>
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((target("avx2")))
#define XXH_ACC_ALIGN 32
#define TPCACHE_HASH_AVX2 1
#endif
#include <xxhash.h>

/* seeded_hash calls xxHash's own long-input loop with its kernels, which the header declares only
 * inside: their signatures changed in 0.8.2 (a kernel per stripe before, per block of stripes
 * since), so they are named by the header's version, and any other version hashes through the
 * public XXH3_64bits_withSeed (the same values, without the kept secret or AVX2). */
#if XXH_VERSION_NUMBER == 801
#define TPCACHE_ACC XXH3_accumulate_512
#define TPCACHE_ACC_AVX2 XXH3_accumulate_512_avx2
#elif XXH_VERSION_NUMBER >= 802 && XXH_VERSION_NUMBER <= 803
#define TPCACHE_ACC XXH3_accumulate
#define TPCACHE_ACC_AVX2 XXH3_accumulate_avx2
#endif
#if !defined(TPCACHE_ACC) || !defined(TPCACHE_HASH_AVX2)
#undef TPCACHE_ACC_AVX2
#endif

/* The secret XXH3 derives from a seed for inputs past 240 bytes, kept for the seed last used: a
 * call with another seed derives it again (each file that hashes long inputs keeps one). */
typedef struct {
    XXH_ALIGN(64) unsigned char secret[XXH_SECRET_DEFAULT_SIZE];
    uint64_t seed;
    int ready;
} Seeded;

#ifdef TPCACHE_ACC_AVX2
static inline XXH_TARGET_AVX2 uint64_t hash_long_avx2(const void *data, size_t len, const unsigned char *secret) {
    uint64_t h = XXH3_hashLong_64b_internal(data, len, secret, XXH_SECRET_DEFAULT_SIZE, TPCACHE_ACC_AVX2,
                                            XXH3_scrambleAcc_avx2);
    _mm256_zeroupper(); /* (the compiler adds none here: SSE code after dirty upper halves runs slow) */
    return h;
}
#endif

/* XXH3_64bits_withSeed(data, len, seed), the same value bit for bit (xxHash's vector kernels agree,
 * and the secret kept is the one the seeded hash derives on each call), faster for long inputs such
 * as a page of 512 tokens: AVX2 where the CPU has it (the extension is built for any x86-64), and
 * the secret derived once per seed rather than per call. */
static inline uint64_t seeded_hash(Seeded *s, const void *data, size_t len, uint64_t seed) {
#ifndef TPCACHE_ACC
    (void)s;
    return XXH3_64bits_withSeed(data, len, seed);
#else
    if (len <= XXH3_MIDSIZE_MAX)
        return XXH3_64bits_withSeed(data, len, seed); /* short inputs take the seed itself, no secret */
    if (!s->ready || s->seed != seed) {
        XXH3_initCustomSecret(s->secret, seed);
        s->seed = seed;
        s->ready = 1;
    }
#ifdef TPCACHE_ACC_AVX2
    if (__builtin_cpu_supports("avx2"))
        return hash_long_avx2(data, len, s->secret);
#endif
    return XXH3_hashLong_64b_internal(data, len, s->secret, XXH_SECRET_DEFAULT_SIZE, TPCACHE_ACC, XXH3_scrambleAcc);
#endif
}
#endif
