"""Build script for ``kvflow_shm._native`` (cffi out-of-line API mode); never imported at run time.

The C part is a thin loop over ``process_vm_readv`` / ``process_vm_writev``: it takes flat uint64
arrays of (local address, remote address, length) runs, builds the iovecs itself and issues the
syscalls in chunks of at most ``IOV_MAX`` iovecs and ``max_chunk`` bytes, resuming after a short
transfer. It also checks runs against region bounds so that the Python side needs no per-run loop.
"""

from __future__ import annotations

from cffi import FFI

CDEF = """
struct iovec { void *iov_base; size_t iov_len; };
typedef int... pid_t;

ssize_t process_vm_readv(pid_t pid, const struct iovec *local_iov, unsigned long liovcnt,
                         const struct iovec *remote_iov, unsigned long riovcnt, unsigned long flags);
ssize_t process_vm_writev(pid_t pid, const struct iovec *local_iov, unsigned long liovcnt,
                          const struct iovec *remote_iov, unsigned long riovcnt, unsigned long flags);

#define KVF_IOV_MAX ...
#define KVF_STOPPED ...
#define KVF_BAD_LOCAL ...
#define KVF_BAD_REMOTE ...
#define KVF_DEFERRED ...

int64_t kvf_vm_copy(int pid, int write, const uint64_t *local, const uint64_t *remote,
                    const uint64_t *lens, size_t n, uint64_t max_chunk, const int *stop,
                    uint64_t *done);
int64_t kvf_transfer(int pid, int write, const uint64_t *local, const uint64_t *remote,
                     const uint64_t *lens, const int64_t *ltensor, const int64_t *rtensor, size_t n,
                     const uint64_t *lbases, const uint64_t *lsizes, size_t nl,
                     const uint64_t *rbases, const uint64_t *rsizes, size_t nr,
                     uint64_t inline_limit, uint64_t max_chunk, const int *stop, uint64_t *out);
int64_t kvf_transfer_table(int pid, int write, const uint64_t *table, size_t n,
                           const uint64_t *lbases, const uint64_t *lsizes, size_t nl,
                           const uint64_t *rbases, const uint64_t *rsizes, size_t nr,
                           uint64_t inline_limit, uint64_t *out);
"""

SOURCE = r"""
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define KVF_IOV_MAX 1024
/* Negated return codes beyond errno values. */
#define KVF_STOPPED 0x10000     /* *stop became non-zero between two syscalls */
#define KVF_BAD_LOCAL 0x10001   /* a run leaves its local region: nothing moved */
#define KVF_BAD_REMOTE 0x10002  /* a run leaves its remote region: nothing moved */
#define KVF_DEFERRED 0x10003    /* checked, but more than inline_limit bytes: nothing moved */

/* Copy n runs between this process and `pid`: run i is lens[i] bytes between local[i] and
   remote[i]. write=0 reads remote->local, write=1 writes local->remote. Each syscall carries
   at most KVF_IOV_MAX iovecs and about max_chunk bytes (a run larger than that is split).
   Between syscalls *stop (if not NULL) is polled. Returns the bytes moved (the sum of lens) on
   success, else -errno (or -KVF_STOPPED); *done always holds the bytes moved. A short transfer
   is resumed where it stopped; one that moves nothing yields -EFAULT. */
int64_t kvf_vm_copy(int pid, int write, const uint64_t *local, const uint64_t *remote,
                    const uint64_t *lens, size_t n, uint64_t max_chunk, const int *stop,
                    uint64_t *done)
{
    struct iovec liov[KVF_IOV_MAX], riov[KVF_IOV_MAX];
    size_t i = 0;          /* current run */
    uint64_t off = 0;      /* bytes of run i already moved */
    uint64_t total = 0;
    if (max_chunk == 0)
        max_chunk = (uint64_t)1 << 30;
    *done = 0;
    while (i < n) {
        size_t k = 0, j = i;
        uint64_t joff = off, bytes = 0;
        if (stop != NULL && __atomic_load_n(stop, __ATOMIC_ACQUIRE))
            return -KVF_STOPPED;
        while (j < n && k < KVF_IOV_MAX && bytes < max_chunk) {
            uint64_t len = lens[j] - joff;
            if (len > max_chunk - bytes)
                len = max_chunk - bytes;
            if (len > 0) {
                liov[k].iov_base = (void *)(uintptr_t)(local[j] + joff);
                riov[k].iov_base = (void *)(uintptr_t)(remote[j] + joff);
                liov[k].iov_len = riov[k].iov_len = (size_t)len;
                k++;
                bytes += len;
            }
            if (joff + len < lens[j]) {
                joff += len;  /* chunk full in the middle of run j */
                break;
            }
            j++;
            joff = 0;
        }
        if (k == 0) {      /* only zero-length runs left */
            i = j;
            off = joff;
            continue;
        }
        ssize_t r = write ? process_vm_writev(pid, liov, k, riov, k, 0)
                          : process_vm_readv(pid, liov, k, riov, k, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -(int64_t)errno;
        }
        if (r == 0)
            return -EFAULT;
        total += (uint64_t)r;
        *done = total;
        /* advance (i, off) by r bytes */
        uint64_t left = (uint64_t)r;
        while (left > 0 && i < n) {
            uint64_t rest = lens[i] - off;
            if (left >= rest) {
                left -= rest;
                i++;
                off = 0;
            } else {
                off += left;
                left = 0;
            }
        }
    }
    return (int64_t)total;
}

/* Index of the first run not inside region tensor[i] (bases[t], sizes[t]), or -1. */
static int64_t kvf_check(const uint64_t *addrs, const uint64_t *lens, const int64_t *tensor, size_t n,
                         const uint64_t *bases, const uint64_t *sizes, size_t nregions)
{
    for (size_t i = 0; i < n; i++) {
        int64_t t = tensor[i];
        if (t < 0 || (uint64_t)t >= nregions)
            return (int64_t)i;
        uint64_t a = addrs[i], l = lens[i], b = bases[t], s = sizes[t];
        if (l == 0 || a < b || l > s || a - b > s - l)
            return (int64_t)i;
    }
    return -1;
}

/* Check every run against its region on both sides (a NULL table skips that side), then copy.
   out[0]: bytes moved; out[1]: index of the bad run; out[2]: total bytes of the batch.
   Returns the total on success, -KVF_BAD_LOCAL / -KVF_BAD_REMOTE, -KVF_DEFERRED when the
   total exceeds inline_limit (nothing moved), else as kvf_vm_copy. */
int64_t kvf_transfer(int pid, int write, const uint64_t *local, const uint64_t *remote,
                     const uint64_t *lens, const int64_t *ltensor, const int64_t *rtensor, size_t n,
                     const uint64_t *lbases, const uint64_t *lsizes, size_t nl,
                     const uint64_t *rbases, const uint64_t *rsizes, size_t nr,
                     uint64_t inline_limit, uint64_t max_chunk, const int *stop, uint64_t *out)
{
    int64_t bad;
    uint64_t total = 0;
    out[0] = out[1] = out[2] = 0;
    if (lbases != NULL && (bad = kvf_check(local, lens, ltensor, n, lbases, lsizes, nl)) >= 0) {
        out[1] = (uint64_t)bad;
        return -KVF_BAD_LOCAL;
    }
    if (rbases != NULL && (bad = kvf_check(remote, lens, rtensor, n, rbases, rsizes, nr)) >= 0) {
        out[1] = (uint64_t)bad;
        return -KVF_BAD_REMOTE;
    }
    for (size_t i = 0; i < n; i++)
        total += lens[i];
    out[2] = total;
    if (total > inline_limit)
        return -KVF_DEFERRED;
    return kvf_vm_copy(pid, write, local, remote, lens, n, max_chunk, stop, &out[0]);
}

/* kvf_transfer over one (5, n) table, rows: local, remote, length, local tensor, remote tensor
   (kvflow's RunBatch.table); no stop flag: for batches small enough to copy on the caller's thread. */
int64_t kvf_transfer_table(int pid, int write, const uint64_t *table, size_t n,
                           const uint64_t *lbases, const uint64_t *lsizes, size_t nl,
                           const uint64_t *rbases, const uint64_t *rsizes, size_t nr,
                           uint64_t inline_limit, uint64_t *out)
{
    return kvf_transfer(pid, write, table, table + n, table + 2 * n, (const int64_t *)(table + 3 * n),
                        (const int64_t *)(table + 4 * n), n, lbases, lsizes, nl, rbases, rsizes, nr,
                        inline_limit, 0, NULL, out);
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("kvflow_shm._native", SOURCE, extra_compile_args=["-O2"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
