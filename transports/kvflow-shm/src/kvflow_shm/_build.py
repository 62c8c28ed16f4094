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
#define KVF_DECLINED ...
#define KVF_FAST_MAX_BLOCKS ...

struct kvf_pair {
    int pid;
    size_t ntensors;
    uint64_t stride;
    uint64_t lblocks;
    uint64_t rblocks;
    const uint64_t *lbase;
    const uint64_t *lsize;
    const uint64_t *rbase;
    const uint64_t *rsize;
    uint64_t inline_limit;
    size_t max_runs;
};

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
int64_t kvf_plan_blocks(const struct kvf_pair *p, int write, const int64_t *src, size_t ns,
                        const int64_t *dst, size_t nd, uint64_t *local, uint64_t *remote, uint64_t *lens,
                        uint64_t *tensor, size_t cap);
int64_t kvf_blocks(const struct kvf_pair *p, int write, const int64_t *src, size_t ns,
                   const int64_t *dst, size_t nd, uint64_t *out);
int64_t kvf_block1(const struct kvf_pair *p, int write, int64_t src, int64_t dst, uint64_t *out);
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
#define KVF_DECLINED 0x10004    /* the fast path does not take this request: nothing moved */
#define KVF_FAST_MAX_BLOCKS 64  /* block lists the fast path takes, at most */

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

/* The fast path of a block pull or push over every tensor: one call checks, plans and copies.

   A kvf_pair describes one (local cache, remote cache) pair of one link, built once in Python:
   the peer's pid, the tensor count (equal on both sides; tensor t pairs with tensor t), the block
   size (equal on both sides), each side's block count, and each side's registered (local) or
   described (remote) tensor regions, base and size, in tensor order.

   The planning rules are kvflow._plan.plan_blocks's for ext_param=None, and must stay so
   (tests/test_shm_fastpath.py checks with hypothesis that both map the same bytes): src[i] pairs
   with dst[i]; pairs that advance by one on both sides merge into one run; runs are emitted tensor
   by tensor, then in list order; a run of c blocks starting at block b of tensor t is c * stride
   bytes at base[t] + b * stride.

   Anything else is declined, before a byte moves, with -KVF_DECLINED: lists of unequal or zero
   length or longer than KVF_FAST_MAX_BLOCKS, an index outside 0..blocks-1 on its side, a
   destination block named twice, a run outside its region, more than KVF_IOV_MAX runs or more
   than inline_limit bytes. The caller then takes the Python path, which raises the typed error
   for bad input (one place says what is wrong) or moves a large batch off the caller's thread. */

struct kvf_pair {
    int pid;
    size_t ntensors;
    uint64_t stride;
    uint64_t lblocks;        /* block count of the local cache */
    uint64_t rblocks;        /* block count of the remote cache */
    const uint64_t *lbase;   /* ntensors local regions: base, size */
    const uint64_t *lsize;
    const uint64_t *rbase;   /* ntensors remote regions: base, size */
    const uint64_t *rsize;
    uint64_t inline_limit;   /* more bytes than this: declined */
    size_t max_runs;         /* more runs than this: declined */
};

static int kvf_run(const uint64_t *base, const uint64_t *size, size_t t, uint64_t block, uint64_t count,
                   uint64_t stride, uint64_t *addr, uint64_t *len)
{
    uint64_t off, l, a;
    if (__builtin_mul_overflow(block, stride, &off) || __builtin_mul_overflow(count, stride, &l))
        return -1;
    if (l == 0 || l > size[t] || off > size[t] - l || __builtin_add_overflow(base[t], off, &a))
        return -1;
    *addr = a;
    *len = l;
    return 0;
}

/* Plan into local/remote/lens (and tensor, if not NULL), cap entries each. Returns the number of
   runs; sets nothing outside [0, runs). -KVF_DECLINED as above. */
int64_t kvf_plan_blocks(const struct kvf_pair *p, int write, const int64_t *src, size_t ns,
                        const int64_t *dst, size_t nd, uint64_t *local, uint64_t *remote, uint64_t *lens,
                        uint64_t *tensor, size_t cap)
{
    /* pull (write=0): source remote, destination local; push (write=1): the other way round */
    uint64_t snum = write ? p->lblocks : p->rblocks, dnum = write ? p->rblocks : p->lblocks;
    uint64_t rs[KVF_FAST_MAX_BLOCKS], rd[KVF_FAST_MAX_BLOCKS], rc[KVF_FAST_MAX_BLOCKS];
    size_t n = ns, nruns = 0, t, r, k = 0;
    if (ns != nd || n == 0 || n > KVF_FAST_MAX_BLOCKS || p->stride == 0 || p->ntensors == 0)
        return -KVF_DECLINED;
    for (size_t i = 0; i < n; i++) {
        if (src[i] < 0 || (uint64_t)src[i] >= snum || dst[i] < 0 || (uint64_t)dst[i] >= dnum)
            return -KVF_DECLINED;
        for (size_t j = 0; j < i; j++)
            if (dst[j] == dst[i])
                return -KVF_DECLINED;
        if (nruns > 0 && (uint64_t)src[i] == rs[nruns - 1] + rc[nruns - 1]
                && (uint64_t)dst[i] == rd[nruns - 1] + rc[nruns - 1]) {
            rc[nruns - 1]++;
        } else {
            rs[nruns] = (uint64_t)src[i];
            rd[nruns] = (uint64_t)dst[i];
            rc[nruns] = 1;
            nruns++;
        }
    }
    if (p->ntensors > cap / nruns)
        return -KVF_DECLINED;
    for (t = 0; t < p->ntensors; t++) {
        for (r = 0; r < nruns; r++, k++) {
            uint64_t lb = write ? rs[r] : rd[r], rb = write ? rd[r] : rs[r], ll, rl;
            if (kvf_run(p->lbase, p->lsize, t, lb, rc[r], p->stride, &local[k], &ll) != 0
                    || kvf_run(p->rbase, p->rsize, t, rb, rc[r], p->stride, &remote[k], &rl) != 0)
                return -KVF_DECLINED;
            lens[k] = ll;
            if (tensor != NULL)
                tensor[k] = t;
        }
    }
    return (int64_t)k;
}

/* Check, plan and copy a block transfer (see above). out[0]: bytes moved; out[1]: runs;
   out[2]: total bytes. Returns the total, -KVF_DECLINED (nothing moved), else as kvf_vm_copy. */
int64_t kvf_blocks(const struct kvf_pair *p, int write, const int64_t *src, size_t ns,
                   const int64_t *dst, size_t nd, uint64_t *out)
{
    uint64_t local[KVF_IOV_MAX], remote[KVF_IOV_MAX], lens[KVF_IOV_MAX], total = 0;
    size_t cap = p->max_runs < KVF_IOV_MAX ? p->max_runs : KVF_IOV_MAX;
    int64_t n = kvf_plan_blocks(p, write, src, ns, dst, nd, local, remote, lens, NULL, cap);
    out[0] = out[1] = out[2] = 0;
    if (n < 0)
        return n;
    for (int64_t i = 0; i < n; i++) {
        if (__builtin_add_overflow(total, lens[i], &total) || total > p->inline_limit)
            return -KVF_DECLINED;
    }
    out[1] = (uint64_t)n;
    out[2] = total;
    return kvf_vm_copy(p->pid, write, local, remote, lens, (size_t)n, 0, NULL, &out[0]);
}

/* kvf_blocks of one block: the indices as plain arguments (no lists for Python to convert). */
int64_t kvf_block1(const struct kvf_pair *p, int write, int64_t src, int64_t dst, uint64_t *out)
{
    return kvf_blocks(p, write, &src, 1, &dst, 1, out);
}
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source("kvflow_shm._native", SOURCE, extra_compile_args=["-O2"])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
