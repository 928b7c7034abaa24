/* XXH3-64 with a seed, compiled for AVX2 (the same hash, faster on long inputs), for _hash.h's
 * seeded_hash to call only where the CPU has AVX2; tpcache/io/_record_avx2.c does the same for the
 * storage records' checksum. Elsewhere this file is empty. */
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__AVX2__)
#pragma GCC target("avx2")
#include <immintrin.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

__attribute__((visibility("hidden"))) uint64_t tpcache_xxh3_seeded_avx2(const void *data, size_t len, uint64_t seed) {
    uint64_t h = XXH3_64bits_withSeed(data, len, seed);
    _mm256_zeroupper(); /* GCC adds none to a function compiled for AVX2 by a pragma, and SSE code run
                         * while the upper halves are dirty is slow */
    return h;
}
#endif
