/* XXH3-64 compiled for AVX2 (the same hash, faster on long inputs), for _record.c to call only
 * where the CPU has AVX2 (it checks once, at import). Elsewhere this file is empty. */
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__AVX2__)
#pragma GCC target("avx2")
#include <immintrin.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

__attribute__((visibility("hidden"))) uint64_t tpcache_record_xxh3_avx2(const void *data, size_t len) {
    uint64_t h = XXH3_64bits(data, len);
    _mm256_zeroupper(); /* GCC adds none to a function compiled for AVX2 by a pragma, and SSE code run
                         * while the upper halves are dirty is slow */
    return h;
}
#endif
