/* XXH3-64 of inputs over 240 bytes, with a seed, for the page hashes, and of any length with seed 0
 * for lists of ids (_account.c, which has the 17-128 byte branch the records use; see there). */
#ifndef TPCACHE_XXH3_H
#define TPCACHE_XXH3_H
#include <stddef.h>
#include <stdint.h>

#define XXH3_SECRET_SIZE 192

/* The secret a seed derives from the default one (``out``: XXH3_SECRET_SIZE bytes). */
void xxh3_secret(uint64_t seed, uint8_t *out);
/* XXH3-64 of ``len`` > 240 bytes with a secret from ``xxh3_secret``. */
uint64_t xxh3_long(const uint8_t *input, size_t len, const uint8_t *secret);
/* XXH3-64 with seed 0 and the default secret of ``len`` bytes, a multiple of 8 (_account.c). */
uint64_t xxh3_64(const uint8_t *input, size_t len);

#endif
