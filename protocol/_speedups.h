/* What the two files of the _speedups extension share (_speedups.c, _match.c). */
#ifndef TPCACHE_SPEEDUPS_H
#define TPCACHE_SPEEDUPS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* whether no little-endian int32 in p[0..n) is negative (n a multiple of 4) */
int no_negative(const unsigned char *p, Py_ssize_t n);
/* no_negative(src, n), copying src[0..n) to dst on the way */
int copy_no_negative(unsigned char *restrict dst, const unsigned char *restrict src, Py_ssize_t n);
/* match_request(buffer, max_bin, max_ids, as_bytes=False) and match_reply(...): see _match.c */
PyObject *match_request(PyObject *self, PyObject *args);
PyObject *match_reply(PyObject *self, PyObject *args);
/* Load what _match.c needs (array.array); 0, or -1 and an exception. */
int match_init(void);

#endif
