/* XXH3-64 from xxHash itself: the header of the xxHash library (Debian's libxxhash-dev,
 * /usr/include/xxhash.h), inlined into each file that hashes, so the extension links no library.
 * Where the header is missing the build skips the extension with a warning (setup.py). */
#ifndef TPCACHE_HASH_H
#define TPCACHE_HASH_H
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif
