/* kvflow._pumpc: the socket loop of one tcp payload, in C, for kvflow._pump's worker threads.
 *
 * kvflow._pump calls kvf_move through ctypes, which releases the GIL for the whole call: the
 * thread then moves the payload (non-blocking readv / sendmsg of at most `chunk` bytes, poll while
 * the socket is empty or full) without taking the GIL between syscalls. A worker that held the GIL
 * between two syscalls and lost its core there kept the event loop waiting for it (docs/decisions.md,
 * "tcp payloads: the socket loop in C"). While it receives, the socket's SO_RCVLOWAT is raised to the
 * bytes it waits for (at most 64 KiB), so poll wakes it once per 64 KiB rather than once per segment;
 * kvf_move sets it back to 1 before it returns.
 *
 * Same rules as kvflow._pump._move: every syscall runs under the job's mutex, and kvf_job_stop takes
 * it, so once kvf_job_stop returns no further byte is read or written. The table is a struct iovec
 * array; a partly moved entry is rewritten in place (base forward, length down), as
 * kvflow._iov.IovCursor does. kvf_serve goes on from one of the peer's writes into the writes after it,
 * checking each header and run table before any byte of its payload is read. The module object
 * itself is empty: Python imports it to find the file. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define KVF_IOV_MAX 1024

enum { KVF_DONE = 0, KVF_STOPPED = 1, KVF_QUIET = 2, KVF_CLOSED = 3, KVF_ERROR = 4, KVF_MISMATCH = 5 };

typedef struct {
    pthread_mutex_t lock; /* recursive: the loop thread may stop a job it holds */
    int stopped;
    int want;      /* holds and nudges of the loop thread, which waits to use the socket: the worker
                    * lets it in first */
    int64_t moved; /* bytes moved under this job, all calls together */
    int64_t cut;   /* the loop thread's bound on moved: the job ends there (kvf_job_cut) */
    int64_t passed; /* marks passed: frame headers read and found equal to the ones expected */
} kvf_job;

size_t kvf_job_size(void) { return sizeof(kvf_job); }

/* Initialise a job in caller-owned memory of kvf_job_size() bytes (a default mutex needs no destroy). */
void kvf_job_init(kvf_job *job) {
    memset(job, 0, sizeof *job);
    job->cut = INT64_MAX;
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&job->lock, &attr);
    pthread_mutexattr_destroy(&attr);
}

/* The loop thread takes the socket from the worker between two of its syscalls, and keeps it until
 * kvf_job_release. Both sides' syscalls take the kernel's socket lock, which a worker that loops
 * without a pause takes again before a woken loop thread gets to it: the loop waited for
 * milliseconds to read a request. */
void kvf_job_hold(kvf_job *job) {
    __atomic_add_fetch(&job->want, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&job->lock);
}

void kvf_job_release(kvf_job *job) {
    pthread_mutex_unlock(&job->lock);
    __atomic_sub_fetch(&job->want, 1, __ATOMIC_SEQ_CST);
}

/* The loop thread is about to read (or send) on the socket in the direction the worker does not
 * use: the worker makes no further syscall until kvf_job_unnudge, and the loop's own syscall waits
 * in the kernel for at most the worker's syscall in progress. Unlike kvf_job_hold it does not wait
 * for the worker to run again and unlock: a worker at SCHED_IDLE, put off its core on the way out
 * of its syscall with the job's lock still held, kept the loop waiting for up to 0.6 ms. */
void kvf_job_nudge(kvf_job *job) { __atomic_add_fetch(&job->want, 1, __ATOMIC_SEQ_CST); }

void kvf_job_unnudge(kvf_job *job) { __atomic_sub_fetch(&job->want, 1, __ATOMIC_SEQ_CST); }

/* Stop the job at its next syscall boundary (a syscall in progress is waited out); bytes moved. */
int64_t kvf_job_stop(kvf_job *job) {
    pthread_mutex_lock(&job->lock);
    job->stopped = 1;
    int64_t moved = job->moved;
    pthread_mutex_unlock(&job->lock);
    return moved;
}

/* The job ends once `at` bytes are moved (at least those already moved), as if its limit were `at`. */
void kvf_job_cut(kvf_job *job, int64_t at) {
    pthread_mutex_lock(&job->lock);
    job->cut = at > job->moved ? at : job->moved;
    pthread_mutex_unlock(&job->lock);
}

/* Bytes moved so far, and (in *passed) the marks passed; consistent with each other. */
int64_t kvf_job_moved(kvf_job *job, int64_t *passed) {
    pthread_mutex_lock(&job->lock);
    int64_t moved = job->moved;
    *passed = job->passed;
    pthread_mutex_unlock(&job->lock);
    return moved;
}

/* Move up to `limit` bytes between socket `fd` and the `n` entries of `iov` (sending: from them).
 * Returns the job's bytes moved so far; *status says why it returned: all moved, stopped, the
 * socket quiet for `hold_ms` (or for `wait_ms` while *waiting > 0: another payload waits for a
 * thread), the peer closed (receiving), an error (*err = errno), or a header that differs.
 *
 * `nmarks` marks chain frames. Receiving, mark k is the byte count (of this call) at which a frame
 * header of `mark_bytes` ends, read into memory at slots[k]. No read goes past a mark before the
 * header is there and equal to expect[k * mark_bytes ...]; a header that differs ends the call
 * (KVF_MISMATCH) right after it, so the loop thread acts on it as on any frame. job->passed counts
 * the equal ones. Waiting for a header not yet begun, `wait_ms` of quiet ends the call (KVF_QUIET).
 * Sending, mark k is where frame k + 1 starts (`mark_bytes` 0, nothing compared). Either way, no
 * syscall crosses the start of a frame, and at one the call ends (KVF_QUIET) while *waiting > 0. */
static int64_t move(int fd, struct iovec *iov, int64_t n, int64_t limit, int64_t chunk, int sending, kvf_job *job,
                 int wait_ms, int hold_ms, const volatile long *waiting, const int64_t *marks, int64_t nmarks,
                 const uint64_t *slots, const unsigned char *expect, int64_t mark_bytes, int *status, int *err) {
    int64_t i = 0, here = 0;
    int quiet = 0, lowat = 1; /* receiving: SO_RCVLOWAT set on the socket while this call polls */
    struct pollfd p = { fd, sending ? POLLOUT : POLLIN, 0 };
    for (;;) {
        while (__atomic_load_n(&job->want, __ATOMIC_SEQ_CST)) sched_yield(); /* the loop's turn */
        pthread_mutex_lock(&job->lock);
        int64_t cut = job->cut - (job->moved - here); /* the cut in this call's bytes */
        int64_t end = limit < cut ? limit : cut;
        if (job->stopped || here >= end || i >= n) {
            *status = job->stopped ? KVF_STOPPED : KVF_DONE;
            int64_t moved = job->moved;
            pthread_mutex_unlock(&job->lock);
            return moved;
        }
        if (job->passed < nmarks) { /* no call crosses a frame's start or (receiving) its header's end */
            int64_t start = marks[job->passed] - mark_bytes;
            int64_t mark = here < start ? start : marks[job->passed];
            if (mark < end) end = mark;
        }
        size_t want = (size_t)(end - here < chunk ? end - here : chunk), sum = 0;
        int64_t j = i;
        while (j < n && j - i < KVF_IOV_MAX && sum < want) sum += iov[j++].iov_len;
        if (sum == 0) { /* empty entries only: nothing to move in them */
            i = j;
            pthread_mutex_unlock(&job->lock);
            continue;
        }
        size_t full = iov[j - 1].iov_len, over = sum > want ? sum - want : 0;
        iov[j - 1].iov_len = full - over; /* the last entry cut to the chunk for this call */
        ssize_t r;
        if (sending) {
            struct msghdr m;
            memset(&m, 0, sizeof m);
            m.msg_iov = iov + i;
            m.msg_iovlen = (size_t)(j - i);
            r = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        } else {
            r = readv(fd, iov + i, (int)(j - i));
        }
        int e = errno;
        iov[j - 1].iov_len = full;
        if (r > 0) {
            job->moved += r;
            here += r;
            size_t left = (size_t)r;
            while (i < n && left >= iov[i].iov_len) left -= iov[i++].iov_len;
            if (left) {
                iov[i].iov_base = (char *)iov[i].iov_base + left;
                iov[i].iov_len -= left;
            }
            quiet = 0;
            /* at a frame's start: receiving, its header is still to come; sending, its first byte */
            int at_start = job->passed < nmarks && here == marks[job->passed] - mark_bytes;
            if (job->passed < nmarks && here == marks[job->passed]) { /* a header is in: ours, or the loop's */
                if (mark_bytes > 0) {
                    const void *slot = (const void *)(uintptr_t)slots[job->passed];
                    if (memcmp(slot, expect + job->passed * mark_bytes, (size_t)mark_bytes) != 0) {
                        *status = KVF_MISMATCH;
                        int64_t moved = job->moved;
                        pthread_mutex_unlock(&job->lock);
                        return moved;
                    }
                }
                job->passed++;
            }
            /* at a frame's start, with another payload waiting for a thread: give this one back, so
             * that threads shared by links still take turns frame by frame */
            if (at_start && *waiting > 0) {
                *status = KVF_QUIET;
                int64_t moved = job->moved;
                pthread_mutex_unlock(&job->lock);
                return moved;
            }
            pthread_mutex_unlock(&job->lock);
            continue;
        }
        int64_t moved = job->moved;
        pthread_mutex_unlock(&job->lock);
        if (r == 0 && !sending) {
            *status = KVF_CLOSED;
            return moved;
        }
        if (r < 0 && e == EINTR) continue;
        if (r < 0 && e != EAGAIN && e != EWOULDBLOCK) {
            *status = KVF_ERROR;
            *err = e;
            return moved;
        }
        if (!sending) { /* wake once a chunk (or the rest) is there, not for every segment */
            int w = want > 65536 ? 65536 : (int)want;
            if (w != lowat && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &w, sizeof w) == 0) lowat = w;
        }
        if (poll(&p, 1, wait_ms) != 0) continue; /* ready, or EINTR: try again */
        quiet += wait_ms;
        /* between chained frames (the next header not begun), a short quiet ends the job: the reads
         * it completed are then reported now, not once the peer sends again */
        int between = !sending && job->passed < nmarks && here == marks[job->passed] - mark_bytes;
        if (*waiting > 0 || quiet >= hold_ms || between) {
            *status = KVF_QUIET;
            return moved;
        }
    }
}

int64_t kvf_move(int fd, struct iovec *iov, int64_t n, int64_t limit, int64_t chunk, int sending, kvf_job *job,
                 int wait_ms, int hold_ms, const volatile long *waiting, const int64_t *marks, int64_t nmarks,
                 const uint64_t *slots, const unsigned char *expect, int64_t mark_bytes, int *status, int *err) {
    int64_t moved = move(fd, iov, n, limit, chunk, sending, job, wait_ms, hold_ms, waiting, marks, nmarks, slots,
                         expect, mark_bytes, status, err);
    if (!sending) { /* the loop's reader gets the socket back as it was */
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    }
    return moved;
}

/* What a receive job needs to go on through the peer's writes into one cache (kvf_serve). The
 * loop thread fills it; the worker only reads it, and writes nothing but socket bytes into `hdrs`
 * and `runs` (so once kvf_job_stop returns, job->moved and those bytes say all there is). */
typedef struct {
    uint64_t cache_id;                  /* every frame must name this cache */
    const uint64_t *starts, *sizes;     /* its host tensors, sorted by start address */
    int64_t ntensors;
    int64_t max_frames, max_runs;       /* frames, and runs in all, this job may take (the serving bounds) */
    int64_t max_bytes;                  /* no further frame once this many payload bytes were taken */
    int64_t min_frame, max_frame;       /* a frame's payload bytes: more than min_frame, at most max_frame */
    int64_t frame_runs;                 /* a frame's runs, at most */
    unsigned char *hdrs;                /* max_frames headers of 32 bytes, end to end, as read */
    unsigned char *runs;                /* max_runs run table entries of 16 bytes, end to end, as read */
    struct iovec *scratch;              /* frame_runs entries: the payload table the worker moves through */
    const volatile int32_t *closing;    /* set by the loop thread once the cache is being unregistered */
} kvf_serve_t;

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvf_serve reads the wire's little-endian fields in place"
#endif
_Static_assert(sizeof(struct iovec) == 16, "kvf_serve moves a payload through its run table as read");

/* Whether the 32-byte header `h` is one this job may take on its own: a write into our cache, within
 * every bound the loop thread applies, large enough that the loop would hand it to a worker. */
static int serve_header_ok(const kvf_serve_t *s, const unsigned char *h, int64_t runs_used, uint32_t *count,
                           uint64_t *total) {
    uint16_t res;
    uint64_t cache_id;
    memcpy(&res, h + 2, 2);
    memcpy(count, h + 4, 4);
    memcpy(&cache_id, h + 16, 8);
    memcpy(total, h + 24, 8);
    return !*s->closing && h[0] == 3 /* WRITE_REQ */ && h[1] == 0 && res == 0 && cache_id == s->cache_id && *count > 0 &&
           (int64_t)*count <= s->frame_runs && runs_used + (int64_t)*count <= s->max_runs &&
           *total > (uint64_t)s->min_frame && *total <= (uint64_t)s->max_frame;
}

/* Whether every run of `t` lies inside one tensor of the cache, and their lengths add up to `total`. */
static int serve_runs_ok(const kvf_serve_t *s, const uint64_t *t, uint32_t count, uint64_t total) {
    uint64_t sum = 0;
    for (uint32_t k = 0; k < count; k++) {
        uint64_t addr = t[2 * k], len = t[2 * k + 1];
        if (len == 0 || len > total - sum) return 0; /* also: the sum cannot pass total, nor overflow */
        sum += len;
        int64_t lo = 0, hi = s->ntensors; /* the last tensor starting at or before addr */
        while (lo < hi) {
            int64_t mid = lo + (hi - lo) / 2;
            if (s->starts[mid] <= addr) lo = mid + 1;
            else hi = mid;
        }
        if (lo == 0) return 0;
        uint64_t off = addr - s->starts[lo - 1], size = s->sizes[lo - 1];
        if (len > size || off > size - len) return 0;
    }
    return sum == total;
}

/* The rest of one of the peer's writes (`iov`, as kvf_move), then the writes that follow it on the
 * stream, each taken only if its header and runs pass the checks above, all in this call. A frame
 * that does not pass ends the call right after the header or run table that failed (KVF_MISMATCH),
 * for the loop thread to act on as on any frame; so does a frame start once a bound is reached or
 * with no byte of the next header there yet (KVF_DONE), or another payload waiting for a thread. The
 * loop thread works out from the byte count alone (and the bytes in hdrs and runs) which frames
 * landed, which one is partial and where in it the stream stands. */
int64_t kvf_serve(int fd, struct iovec *iov, int64_t n, int64_t limit, int64_t chunk, kvf_job *job, int wait_ms,
                  int hold_ms, const volatile long *waiting, const kvf_serve_t *s, int *status, int *err) {
    int64_t before = 0, moved = move(fd, iov, n, limit, chunk, 0, job, wait_ms, hold_ms, waiting, NULL, 0, NULL,
                                     NULL, 0, status, err);
    int64_t frames = 0, runs_used = 0, bytes = 0;
    while (*status == KVF_DONE && moved - before == limit) {
        if (frames >= s->max_frames || bytes >= s->max_bytes) break; /* KVF_DONE at a frame's start */
        if (*waiting > 0) { /* threads shared by links take turns frame by frame */
            *status = KVF_QUIET;
            break;
        }
        /* no next header on the socket yet: end now, so that the writes that landed are answered now,
         * not after a wait (the last write of a push, or a write on its own, would wait for nothing) */
        int lowat = 1;
        struct pollfd ready = { fd, POLLIN, 0 };
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
        if (poll(&ready, 1, 0) <= 0) break; /* KVF_DONE at a frame's start */
        unsigned char *h = s->hdrs + frames * 32;
        struct iovec one = { h, 32 };
        before = moved;
        limit = 32; /* a header begun but not whole within wait_ms ends the job too */
        moved = move(fd, &one, 1, limit, chunk, 0, job, wait_ms, wait_ms, waiting, NULL, 0, NULL, NULL, 0, status,
                     err);
        if (*status != KVF_DONE || moved - before < limit) break;
        uint32_t count;
        uint64_t total;
        if (!serve_header_ok(s, h, runs_used, &count, &total)) {
            *status = KVF_MISMATCH;
            break;
        }
        unsigned char *t = s->runs + runs_used * 16;
        one.iov_base = t;
        one.iov_len = (size_t)count * 16;
        before = moved;
        limit = (int64_t)count * 16;
        moved = move(fd, &one, 1, limit, chunk, 0, job, wait_ms, hold_ms, waiting, NULL, 0, NULL, NULL, 0, status,
                     err);
        if (*status != KVF_DONE || moved - before < limit) break;
        if (!serve_runs_ok(s, (const uint64_t *)(const void *)t, count, total)) {
            *status = KVF_MISMATCH;
            break;
        }
        /* struct iovec is (address, length) as the wire's runs are; a copy, since move rewrites it */
        memcpy(s->scratch, t, (size_t)count * 16);
        before = moved;
        limit = (int64_t)total;
        moved = move(fd, s->scratch, count, limit, chunk, 0, job, wait_ms, hold_ms, waiting, NULL, 0, NULL, NULL, 0,
                     status, err);
        frames++;
        runs_used += count;
        bytes += (int64_t)total;
    }
    int one = 1; /* the loop's reader gets the socket back as it was */
    setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    return moved;
}

static struct PyModuleDef pumpc_module = {
    PyModuleDef_HEAD_INIT, "_pumpc", "kvflow's tcp socket loop in C (called through ctypes, see kvflow._pump).", -1, NULL,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pumpc(void) { return PyModule_Create(&pumpc_module); }
