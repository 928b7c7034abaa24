/* XXH3-64 from xxHash itself: the header of the xxHash library (Debian's libxxhash-dev,
 * /usr/include/xxhash.h), inlined into each file that hashes, so the extension links no library.
 * Where the header is missing the build skips the extension with a warning (setup.py). */
#ifndef TPCACHE_HASH_H
#define TPCACHE_HASH_H
#include <stdint.h>
#include <stddef.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__AVX2__)
/* The same hash compiled for AVX2 (_hash_avx2.c). */
uint64_t tpcache_xxh3_seeded_avx2(const void *data, size_t len, uint64_t seed);
#define TPCACHE_HASH_AVX2 1
#endif

/* XXH3_64bits_withSeed(data, len, seed): for inputs past 240 bytes (a page of 59 tokens or more
 * with its parent's hash) from _hash_avx2.c where the CPU has AVX2, about twice as fast on a page
 * of 512 tokens; the extension itself is built for any x86-64. */
static inline uint64_t seeded_hash(const void *data, size_t len, uint64_t seed) {
#ifdef TPCACHE_HASH_AVX2
    if (len > XXH3_MIDSIZE_MAX && __builtin_cpu_supports("avx2"))
        return tpcache_xxh3_seeded_avx2(data, len, seed);
#endif
    return XXH3_64bits_withSeed(data, len, seed);
}
#endif
