"""Build-time only: the cffi (API, out-of-line) definition of ``kvflow_ucx._native``.

Never imported at run time. UCX headers and libraries come from, in order:

1. ``KVFLOW_UCX_PREFIX`` (a UCX install prefix: ``<prefix>/include/ucp/api/ucp.h`` and
   ``libucp.so`` in ``<prefix>/lib``, ``lib64`` or ``lib/<multiarch>``); the library directory
   is baked in as the run path;
2. the ``libucx`` package of the ``libucx-cu12`` wheel; the run path is ``$ORIGIN/../libucx/lib``
   (both installed in one site-packages) and the package preloads the wheel's libraries if that
   fails (editable installs).

The C shim below keeps every UCP parameter struct, macro and callback on the C side: Python sees
plain functions on opaque handles, and completions arrive as an array of events it drains after
each progress call.
"""

from __future__ import annotations

import glob
import os
import sys

from cffi import FFI

CDEF = r"""
typedef struct kvf_worker kvf_worker;
typedef struct kvf_ep kvf_ep;
typedef struct kvf_op kvf_op;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;

typedef struct {
    uint64_t id;
    int32_t kind;
    int32_t status;
} kvf_event;

#define KVF_EV_OP ...
#define KVF_EV_EP_ERROR ...

static const int UCS_OK;
static const int UCS_INPROGRESS;
static const int UCS_ERR_NO_MESSAGE;
static const int UCS_ERR_NO_RESOURCE;
static const int UCS_ERR_IO_ERROR;
static const int UCS_ERR_NO_MEMORY;
static const int UCS_ERR_INVALID_PARAM;
static const int UCS_ERR_UNREACHABLE;
static const int UCS_ERR_INVALID_ADDR;
static const int UCS_ERR_NOT_IMPLEMENTED;
static const int UCS_ERR_MESSAGE_TRUNCATED;
static const int UCS_ERR_NO_PROGRESS;
static const int UCS_ERR_BUFFER_TOO_SMALL;
static const int UCS_ERR_NO_ELEM;
static const int UCS_ERR_SOME_CONNECTS_FAILED;
static const int UCS_ERR_NO_DEVICE;
static const int UCS_ERR_BUSY;
static const int UCS_ERR_CANCELED;
static const int UCS_ERR_SHMEM_SEGMENT;
static const int UCS_ERR_ALREADY_EXISTS;
static const int UCS_ERR_OUT_OF_RANGE;
static const int UCS_ERR_TIMED_OUT;
static const int UCS_ERR_EXCEEDS_LIMIT;
static const int UCS_ERR_UNSUPPORTED;
static const int UCS_ERR_REJECTED;
static const int UCS_ERR_NOT_CONNECTED;
static const int UCS_ERR_CONNECTION_RESET;
static const int UCS_ERR_FIRST_LINK_FAILURE;
static const int UCS_ERR_LAST_LINK_FAILURE;
static const int UCS_ERR_FIRST_ENDPOINT_FAILURE;
static const int UCS_ERR_ENDPOINT_TIMEOUT;
static const int UCS_ERR_LAST_ENDPOINT_FAILURE;

static const int KVF_MEM_HOST;
static const int KVF_MEM_AUTO;

const char *kvf_status_string(int status);
const char *kvf_origin(void);
void kvf_versions(unsigned *hdr_major, unsigned *hdr_minor,
                  unsigned *lib_major, unsigned *lib_minor, unsigned *lib_release);
void kvf_free(void *p);

int kvf_worker_create(const char **keys, const char **values, size_t n, kvf_worker **out);
int kvf_worker_sibling(kvf_worker *parent, kvf_worker **out);
void kvf_worker_destroy(kvf_worker *w);
int kvf_worker_efd(kvf_worker *w);
int kvf_worker_arm(kvf_worker *w);
int kvf_worker_notify_fd(kvf_worker *w);
int kvf_helper_start(kvf_worker *w, int idle);
int kvf_helper_busy(kvf_worker *w);
unsigned kvf_worker_progress(kvf_worker *w, unsigned max_rounds, uint64_t max_ns, uint64_t spin_ns,
                             int *more);
size_t kvf_worker_events(kvf_worker *w, kvf_event *out, size_t max);
int kvf_worker_address(kvf_worker *w, void **addr, size_t *len);
char *kvf_worker_info(kvf_worker *w);
char *kvf_context_info(kvf_worker *w);

int kvf_mem_map(kvf_worker *w, uint64_t addr, size_t len, int mem_type, ucp_mem_h *out);
int kvf_mem_unmap(kvf_worker *w, ucp_mem_h memh);
int kvf_rkey_pack(kvf_worker *w, ucp_mem_h memh, void **buf, size_t *len);

int kvf_ep_create(kvf_worker *w, const void *addr, uint64_t id, kvf_ep **out);
int kvf_ep_rkey_unpack(kvf_ep *e, const void *buf, ucp_rkey_h *out);
void kvf_rkey_destroy(kvf_worker *w, ucp_rkey_h rkey);
int kvf_ep_close(kvf_ep *e, int force, kvf_op *op);
char *kvf_ep_info(kvf_ep *e);

int64_t kvf_check_runs(size_t n, const uint64_t *laddr, const uint64_t *raddr, const uint64_t *len,
                       const int64_t *lidx, const uint64_t *lbounds, int64_t nl,
                       const int64_t *ridx, const uint64_t *rbounds, int64_t nr);
kvf_op *kvf_op_new(kvf_worker *w, uint64_t id);
size_t kvf_rma(kvf_op *op, kvf_ep *e, int is_put, size_t n,
               const uint64_t *laddr, const uint64_t *raddr, const uint64_t *len,
               const int64_t *lidx, ucp_mem_h *memh_tab,
               const int64_t *ridx, ucp_rkey_h *rkey_tab, uint64_t max_bytes);
int kvf_op_flush(kvf_op *op, kvf_ep *e);
uint64_t kvf_worker_inflight(kvf_worker *w);
void kvf_worker_wake_below(kvf_worker *w, uint64_t bytes);
int kvf_op_status(kvf_op *op);
int kvf_op_finish(kvf_op *op, int *status);
int64_t kvf_rma_now(kvf_ep *e, uint64_t id, int is_put, size_t n, const uint64_t *table,
                    const uint64_t *lbounds, int64_t nl, ucp_mem_h *memh_tab,
                    const uint64_t *rbounds, int64_t nr, ucp_rkey_h *rkey_tab,
                    uint64_t max_bytes, uint64_t max_ns, int *status, int *nev, kvf_op **left);
void kvf_block1_table(size_t nt, const uint64_t *lbase, const uint64_t *rbase, uint64_t stride,
                      uint64_t lblock, uint64_t rblock, uint64_t *table);
int64_t kvf_rma_block1(kvf_ep *e, uint64_t id, int is_put, size_t nt, const uint64_t *lbase,
                       const uint64_t *rbase, uint64_t stride, uint64_t lblock, uint64_t rblock,
                       const uint64_t *lbounds, int64_t nl, ucp_mem_h *memh_tab,
                       const uint64_t *rbounds, int64_t nr, ucp_rkey_h *rkey_tab,
                       uint64_t max_bytes, uint64_t max_ns, int *status, int *nev, kvf_op **left);
"""

SOURCE = r"""
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>

#define KVF_EV_OP 1
#define KVF_EV_EP_ERROR 2
static const int KVF_MEM_HOST = UCS_MEMORY_TYPE_HOST;
static const int KVF_MEM_AUTO = -1;

typedef struct {
    uint64_t id;
    int32_t kind;
    int32_t status;
} kvf_event;

/* One lock per UCP context, shared by its workers: every call into UCX and every change to an
 * operation's count holds it, so that the loop thread and a worker's helper thread
 * (kvf_helper_start) never use the context at the same time. Recursive: kvf_rma_now calls
 * kvf_rma. The event queue has its own (evmu); the in-flight count, an op's status and helper_on
 * are written under this lock and read atomically without it. ``want`` counts loop-thread callers
 * waiting for it; the helper steps aside for them between two progress calls. */
typedef struct kvf_lock {
    pthread_mutex_t mu;
    int want;
} kvf_lock;

typedef struct kvf_worker {
    ucp_context_h ctx;
    int owns_ctx;  /* 0 for a sibling: another worker on its parent's context */
    kvf_lock *lk;  /* the context's, owned by the worker that owns the context */
    ucp_worker_h worker;
    int efd;
    /* completion events for the loop to drain: under evmu only, so that the loop drains them
     * without waiting for a progress call of the helper */
    pthread_mutex_t evmu;
    kvf_event *ev;
    size_t nev, cap;
    uint64_t inflight;  /* bytes of RMA issued and not yet completed locally (read without a lock) */
    /* the helper thread: it progresses the worker while helper_on, until no RMA byte is in flight */
    pthread_t helper;
    pthread_cond_t cv;
    int helper_started, helper_on, helper_idle, stop;
    int notify_fd;  /* written when the helper has events or freed window for the loop */
    int notified;   /* the loop has been told and has not drained events since */
    int wake;       /* in-flight bytes went below wake_below since the loop was last told */
    uint64_t wake_below;  /* the helper tells the loop when a chunk leaves fewer bytes in flight */
} kvf_worker;

static void kvf_enter(kvf_worker *w)
{
    __atomic_add_fetch(&w->lk->want, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&w->lk->mu);
    __atomic_sub_fetch(&w->lk->want, 1, __ATOMIC_SEQ_CST);
}

static void kvf_leave(kvf_worker *w) { pthread_mutex_unlock(&w->lk->mu); }

typedef struct kvf_ep {
    kvf_worker *w;
    ucp_ep_h ep;
    uint64_t id;
    int closing;
} kvf_ep;

/* One batch (or one close): the count of outstanding UCX requests plus one while issuing. */
typedef struct kvf_op {
    kvf_worker *w;
    uint64_t id;
    int64_t pending;
    ucs_status_t status;
    kvf_ep *free_ep;  /* a closed endpoint's record, freed with the op */
} kvf_op;

static void kvf_push(kvf_worker *w, uint64_t id, int kind, ucs_status_t status)
{
    pthread_mutex_lock(&w->evmu);
    if (w->nev == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 64;
        kvf_event *ev = realloc(w->ev, cap * sizeof(*ev));
        if (ev == NULL) {
            abort();  /* cannot report a completion: nothing sane left to do */
        }
        w->ev = ev;
        w->cap = cap;
    }
    w->ev[w->nev].id = id;
    w->ev[w->nev].kind = kind;
    w->ev[w->nev].status = status;
    w->nev++;
    pthread_mutex_unlock(&w->evmu);
}

static size_t kvf_nev(kvf_worker *w) { return __atomic_load_n(&w->nev, __ATOMIC_RELAXED); }

static uint64_t kvf_inflight(kvf_worker *w) { return __atomic_load_n(&w->inflight, __ATOMIC_ACQUIRE); }

const char *kvf_status_string(int status) { return ucs_status_string((ucs_status_t)status); }

/* Where the UCX built against came from ("wheel": libucx-cu12; else the prefix). The marker
 * string lets the package decide, before loading this module, whether to preload the wheel. */
static const char kvf_origin_marker[] __attribute__((used)) = "KVFLOW_UCX_ORIGIN=" KVF_ORIGIN;

const char *kvf_origin(void) { return kvf_origin_marker + sizeof("KVFLOW_UCX_ORIGIN=") - 1; }

void kvf_free(void *p) { free(p); }

void kvf_versions(unsigned *hdr_major, unsigned *hdr_minor,
                  unsigned *lib_major, unsigned *lib_minor, unsigned *lib_release)
{
    *hdr_major = UCP_API_MAJOR;
    *hdr_minor = UCP_API_MINOR;
    ucp_get_version(lib_major, lib_minor, lib_release);
}

/* A worker on w->ctx used by one thread at a time (the context's lock), with its event fd and the
 * eventfd its helper thread tells the loop through. */
static ucs_status_t kvf_worker_open(kvf_worker *w)
{
    ucp_worker_params_t wparams;
    ucs_status_t st;

    if (pthread_cond_init(&w->cv, NULL) != 0) {
        return UCS_ERR_NO_RESOURCE;
    }
    if (pthread_mutex_init(&w->evmu, NULL) != 0) {
        pthread_cond_destroy(&w->cv);
        return UCS_ERR_NO_RESOURCE;
    }
    w->wake_below = UINT64_MAX;
    w->notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->notify_fd < 0) {
        pthread_mutex_destroy(&w->evmu);
        pthread_cond_destroy(&w->cv);
        return UCS_ERR_NO_RESOURCE;
    }
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    kvf_enter(w);
    st = ucp_worker_create(w->ctx, &wparams, &w->worker);
    if (st == UCS_OK) {
        st = ucp_worker_get_efd(w->worker, &w->efd);
        if (st != UCS_OK) {
            ucp_worker_destroy(w->worker);
        }
    }
    kvf_leave(w);
    if (st != UCS_OK) {
        close(w->notify_fd);
        pthread_mutex_destroy(&w->evmu);
        pthread_cond_destroy(&w->cv);
    }
    return st;
}

static kvf_lock *kvf_lock_new(void)
{
    pthread_mutexattr_t a;
    kvf_lock *lk = calloc(1, sizeof(*lk));
    if (lk == NULL) {
        return NULL;
    }
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    if (pthread_mutex_init(&lk->mu, &a) != 0) {
        free(lk);
        lk = NULL;
    }
    pthread_mutexattr_destroy(&a);
    return lk;
}

int kvf_worker_create(const char **keys, const char **values, size_t n, kvf_worker **out)
{
    ucp_config_t *config;
    ucp_params_t params;
    ucs_status_t st;
    size_t i;
    kvf_worker *w = calloc(1, sizeof(*w));

    if (w == NULL || (w->lk = kvf_lock_new()) == NULL) {
        free(w);
        return UCS_ERR_NO_MEMORY;
    }
    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        goto fail;
    }
    for (i = 0; i < n; i++) {
        st = ucp_config_modify(config, keys[i], values[i]);
        if (st != UCS_OK) {
            ucp_config_release(config);
            goto fail;
        }
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                        UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    params.name = "kvflow";
    st = ucp_init(&params, config, &w->ctx);
    ucp_config_release(config);
    if (st != UCS_OK) {
        goto fail;
    }
    w->owns_ctx = 1;
    st = kvf_worker_open(w);
    if (st != UCS_OK) {
        ucp_cleanup(w->ctx);
        goto fail;
    }
    *out = w;
    return UCS_OK;
fail:
    pthread_mutex_destroy(&w->lk->mu);
    free(w->lk);
    free(w);
    return st;
}

/* Another worker on the parent's context: memory maps and packed rkeys are the context's, so
 * they serve both. Destroy it before the parent. */
int kvf_worker_sibling(kvf_worker *parent, kvf_worker **out)
{
    ucs_status_t st;
    kvf_worker *w = calloc(1, sizeof(*w));

    if (w == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    w->ctx = parent->ctx;
    w->lk = parent->lk;
    st = kvf_worker_open(w);
    if (st != UCS_OK) {
        free(w);
        return st;
    }
    *out = w;
    return UCS_OK;
}

/* Stops and joins the helper thread first. */
void kvf_worker_destroy(kvf_worker *w)
{
    kvf_enter(w);
    w->stop = 1;
    pthread_cond_signal(&w->cv);
    kvf_leave(w);
    if (w->helper_started) {
        pthread_join(w->helper, NULL);
    }
    kvf_enter(w);
    ucp_worker_destroy(w->worker);
    if (w->owns_ctx) {
        ucp_cleanup(w->ctx);
    }
    kvf_leave(w);
    if (w->owns_ctx) {
        pthread_mutex_destroy(&w->lk->mu);
        free(w->lk);
    }
    close(w->notify_fd);
    pthread_mutex_destroy(&w->evmu);
    pthread_cond_destroy(&w->cv);
    free(w->ev);
    free(w);
}

int kvf_worker_efd(kvf_worker *w) { return w->efd; }

int kvf_worker_notify_fd(kvf_worker *w) { return w->notify_fd; }

int kvf_worker_arm(kvf_worker *w)
{
    int st;
    kvf_enter(w);
    st = ucp_worker_arm(w->worker);
    kvf_leave(w);
    return st;
}

static uint64_t kvf_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ucp_worker_progress until it reports no work (while RMA bytes are in flight and no completion
 * is pending: for ``spin_ns``), ``max_rounds`` calls or ``max_ns`` elapse; *more is 1 if it
 * stopped with work left (the worker still made progress). */
unsigned kvf_worker_progress(kvf_worker *w, unsigned max_rounds, uint64_t max_ns, uint64_t spin_ns,
                             int *more)
{
    unsigned total = 0, n, r;
    int idle;
    uint64_t start = kvf_now_ns(), now, last = start;
    *more = 0;
    for (r = 0; r < max_rounds; r++) {
        kvf_enter(w);
        n = ucp_worker_progress(w->worker);
        idle = kvf_inflight(w) == 0 || kvf_nev(w) != 0;
        kvf_leave(w);
        now = (n != 0 || spin_ns != 0) ? kvf_now_ns() : 0;
        if (n == 0) {
            /* spin only while bytes are in flight and no completion waits to be delivered */
            if (spin_ns == 0 || idle || now - last > spin_ns || now - start > max_ns) {
                return total;
            }
            r--;  /* spinning while operations are in flight: bounded by time, not rounds */
            continue;
        }
        total += n;
        last = now;
        if (now - start > max_ns) {
            break;
        }
    }
    *more = 1;
    return total;
}

/* Takes only evmu: draining never waits for a progress call. */
size_t kvf_worker_events(kvf_worker *w, kvf_event *out, size_t max)
{
    size_t n;
    pthread_mutex_lock(&w->evmu);
    n = w->nev < max ? w->nev : max;
    memcpy(out, w->ev, n * sizeof(*out));
    memmove(w->ev, w->ev + n, (w->nev - n) * sizeof(*out));
    w->nev -= n;
    w->notified = 0;
    pthread_mutex_unlock(&w->evmu);
    return n;
}

static int kvf_worker_address_u(kvf_worker *w, void **addr, size_t *len)
{
    ucp_worker_attr_t attr;
    ucs_status_t st;
    void *copy;

    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
    st = ucp_worker_query(w->worker, &attr);
    if (st != UCS_OK) {
        return st;
    }
    copy = malloc(attr.address_length);
    if (copy == NULL) {
        ucp_worker_release_address(w->worker, attr.address);
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(copy, attr.address, attr.address_length);
    *addr = copy;
    *len = attr.address_length;
    ucp_worker_release_address(w->worker, attr.address);
    return UCS_OK;
}

static char *kvf_worker_info_u(kvf_worker *w)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) {
        return NULL;
    }
    ucp_worker_print_info(w->worker, f);
    fclose(f);
    return buf;
}

static char *kvf_context_info_u(kvf_worker *w)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) {
        return NULL;
    }
    ucp_context_print_info(w->ctx, f);
    fclose(f);
    return buf;
}

static int kvf_mem_map_u(kvf_worker *w, uint64_t addr, size_t len, int mem_type, ucp_mem_h *out)
{
    ucp_mem_map_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = (void *)(uintptr_t)addr;
    p.length = len;
    if (mem_type >= 0) {
        p.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        p.memory_type = (ucs_memory_type_t)mem_type;
    }
    return ucp_mem_map(w->ctx, &p, out);
}

static int kvf_mem_unmap_u(kvf_worker *w, ucp_mem_h memh) { return ucp_mem_unmap(w->ctx, memh); }

static int kvf_rkey_pack_u(kvf_worker *w, ucp_mem_h memh, void **buf, size_t *len)
{
    void *rbuf;
    void *copy;
    ucs_status_t st = ucp_rkey_pack(w->ctx, memh, &rbuf, len);
    if (st != UCS_OK) {
        return st;
    }
    copy = malloc(*len);
    if (copy == NULL) {
        ucp_rkey_buffer_release(rbuf);
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(copy, rbuf, *len);
    ucp_rkey_buffer_release(rbuf);
    *buf = copy;
    return UCS_OK;
}

static void kvf_ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kvf_ep *e = arg;
    (void)ep;
    if (!e->closing) {
        kvf_push(e->w, e->id, KVF_EV_EP_ERROR, status);
    }
}

static int kvf_ep_create_u(kvf_worker *w, const void *addr, uint64_t id, kvf_ep **out)
{
    ucp_ep_params_t p;
    ucs_status_t st;
    kvf_ep *e = calloc(1, sizeof(*e));

    if (e == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    e->w = w;
    e->id = id;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = (const ucp_address_t *)addr;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = kvf_ep_err_cb;
    p.err_handler.arg = e;
    st = ucp_ep_create(w->worker, &p, &e->ep);
    if (st != UCS_OK) {
        free(e);
        return st;
    }
    *out = e;
    return UCS_OK;
}

static int kvf_ep_rkey_unpack_u(kvf_ep *e, const void *buf, ucp_rkey_h *out)
{
    return ucp_ep_rkey_unpack(e->ep, buf, out);
}

void kvf_rkey_destroy(kvf_worker *w, ucp_rkey_h rkey)
{
    kvf_enter(w);
    ucp_rkey_destroy(rkey);
    kvf_leave(w);
}

static char *kvf_ep_info_u(kvf_ep *e)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) {
        return NULL;
    }
    ucp_ep_print_info(e->ep, f);
    fclose(f);
    return buf;
}

static int kvf_run_ok(uint64_t addr, uint64_t len, int64_t idx, const uint64_t *bounds, int64_t nb)
{
    uint64_t start, end;
    if (idx < 0 || idx >= nb) {
        return 0;
    }
    start = bounds[2 * idx];
    end = bounds[2 * idx + 1];
    return addr >= start && addr <= end && len <= end - addr;
}

/* Check every run against its region's [start, end) on both sides before anything is issued.
 * Returns -1 if all are inside, else 2*i (local side of run i is outside) or 2*i+1 (remote side). */
int64_t kvf_check_runs(size_t n, const uint64_t *laddr, const uint64_t *raddr, const uint64_t *len,
                       const int64_t *lidx, const uint64_t *lbounds, int64_t nl,
                       const int64_t *ridx, const uint64_t *rbounds, int64_t nr)
{
    size_t i;
    for (i = 0; i < n; i++) {
        if (len[i] == 0 || !kvf_run_ok(laddr[i], len[i], lidx[i], lbounds, nl)) {
            return 2 * (int64_t)i;
        }
        if (!kvf_run_ok(raddr[i], len[i], ridx[i], rbounds, nr)) {
            return 2 * (int64_t)i + 1;
        }
    }
    return -1;
}

kvf_op *kvf_op_new(kvf_worker *w, uint64_t id)
{
    kvf_op *op = calloc(1, sizeof(*op));
    if (op != NULL) {
        op->w = w;
        op->id = id;
        op->pending = 1;
        op->status = UCS_OK;
    }
    return op;
}

static void kvf_op_release(kvf_op *op)
{
    if (--op->pending == 0) {
        kvf_push(op->w, op->id, KVF_EV_OP, op->status);
        free(op->free_ep);
        free(op);
    }
}

static void kvf_op_cb(void *request, ucs_status_t status, void *user_data)
{
    kvf_op *op = user_data;
    if (status != UCS_OK && op->status == UCS_OK) {
        op->status = status;
    }
    ucp_request_free(request);
    kvf_op_release(op);
}

/* Account for what a UCX call returned: an immediate status, or a request whose callback
 * will release the op later. Returns the immediate error, or UCS_OK. */
static ucs_status_t kvf_op_track(kvf_op *op, ucs_status_ptr_t ret)
{
    ucs_status_t st;
    if (UCS_PTR_IS_PTR(ret)) {
        op->pending++;
        return UCS_OK;
    }
    st = UCS_PTR_STATUS(ret);
    if (st != UCS_OK && op->status == UCS_OK) {
        op->status = st;
    }
    return st;
}

/* The requests of one kvf_rma call: their bytes count as in flight on the worker until the
 * last of them completes, which bounds how much work UCX holds (and one progress call does). */
typedef struct kvf_chunk {
    kvf_op *op;
    uint64_t bytes;
    int64_t pending;
} kvf_chunk;

static void kvf_chunk_release(kvf_chunk *c)
{
    if (--c->pending == 0) {
        kvf_worker *w = c->op->w;
        if (__atomic_sub_fetch(&w->inflight, c->bytes, __ATOMIC_SEQ_CST) <
            __atomic_load_n(&w->wake_below, __ATOMIC_SEQ_CST)) {
            w->wake = 1;
        }
        kvf_op_release(c->op);
        free(c);
    }
}

static void kvf_chunk_cb(void *request, ucs_status_t status, void *user_data)
{
    kvf_chunk *c = user_data;
    if (status != UCS_OK && c->op->status == UCS_OK) {
        c->op->status = status;
    }
    ucp_request_free(request);
    kvf_chunk_release(c);
}

uint64_t kvf_worker_inflight(kvf_worker *w) { return kvf_inflight(w); }

/* From now on the helper tells the loop each time a completed chunk leaves fewer than `bytes`
 * in flight (the loop waits for window); 0: only for events and when it stops. */
void kvf_worker_wake_below(kvf_worker *w, uint64_t bytes)
{
    __atomic_store_n(&w->wake_below, bytes, __ATOMIC_SEQ_CST);
}

static size_t kvf_rma_u(kvf_op *op, kvf_ep *e, int is_put, size_t n,
               const uint64_t *laddr, const uint64_t *raddr, const uint64_t *len,
               const int64_t *lidx, ucp_mem_h *memh_tab,
               const int64_t *ridx, ucp_rkey_h *rkey_tab, uint64_t max_bytes)
{
    ucp_request_param_t p;
    ucs_status_ptr_t ret;
    ucs_status_t st;
    uint64_t bytes = 0;
    size_t i;
    kvf_chunk *c;

    if (op->status != UCS_OK || n == 0) {
        return 0;
    }
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        op->status = UCS_ERR_NO_MEMORY;
        return 0;
    }
    c->op = op;
    c->pending = 1;  /* released below, once issuing stops */
    op->pending++;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     (memh_tab != NULL ? UCP_OP_ATTR_FIELD_MEMH : 0);
    p.cb.send = kvf_chunk_cb;
    p.user_data = c;
    for (i = 0; i < n; i++) {
        if (i > 0 && bytes >= max_bytes) {
            break;
        }
        if (memh_tab != NULL) {
            p.memh = memh_tab[lidx[i]];
        }
        if (is_put) {
            ret = ucp_put_nbx(e->ep, (const void *)(uintptr_t)laddr[i], len[i], raddr[i],
                              rkey_tab[ridx[i]], &p);
        } else {
            ret = ucp_get_nbx(e->ep, (void *)(uintptr_t)laddr[i], len[i], raddr[i],
                              rkey_tab[ridx[i]], &p);
        }
        bytes += len[i];
        if (UCS_PTR_IS_PTR(ret)) {
            c->pending++;
            continue;
        }
        st = UCS_PTR_STATUS(ret);
        if (st != UCS_OK) {
            if (op->status == UCS_OK) {
                op->status = st;
            }
            i++;
            break;
        }
    }
    if (is_put && op->status == UCS_OK) {
        /* count the chunk in flight until the peer has the bytes, not only until they left:
         * a put completes locally once its data is handed to the transport */
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        ret = ucp_ep_flush_nbx(e->ep, &p);
        if (UCS_PTR_IS_PTR(ret)) {
            c->pending++;
        } else if (UCS_PTR_STATUS(ret) != UCS_OK && op->status == UCS_OK) {
            op->status = UCS_PTR_STATUS(ret);
        }
    }
    c->bytes = bytes;
    __atomic_add_fetch(&op->w->inflight, bytes, __ATOMIC_RELEASE);
    kvf_chunk_release(c);
    return i;
}

static int kvf_op_flush_u(kvf_op *op, kvf_ep *e)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = kvf_op_cb;
    p.user_data = op;
    return kvf_op_track(op, ucp_ep_flush_nbx(e->ep, &p));
}

/* Without the lock: callbacks set the status under it, once, from UCS_OK to an error. */
int kvf_op_status(kvf_op *op) { return __atomic_load_n(&op->status, __ATOMIC_RELAXED); }

/* Drop the issuing reference. Returns 1 if the op is complete (and freed; *status is set),
 * 0 if a KVF_EV_OP event with its id will follow. */
static int kvf_op_finish_u(kvf_op *op, int *status)
{
    if (op->pending == 1) {
        *status = op->status;
        free(op->free_ep);
        free(op);
        return 1;
    }
    op->pending--;
    return 0;
}

/* read_now/write_now: the runs of a (5, n) uint64 table (local address, remote address, length,
 * local tensor, remote tensor), if they total at most ``max_bytes``: checked against both sides'
 * regions, issued as one op with id ``id``, and the worker progressed here until they complete or
 * ``max_ns`` pass. Returns -1 when they completed (*status is their status), -3 when the batch is
 * larger (nothing issued), 2*i / 2*i+1 when run i's local / remote side is out of bounds (nothing
 * issued), -4 when out of memory (nothing issued), -2 when they are still in flight after
 * ``max_ns``: *left is then the op, for the caller to finish (its event follows). *nev: completion
 * events of other operations waiting in the worker's queue. */
static int64_t kvf_rma_now_u(kvf_ep *e, uint64_t id, int is_put, size_t n, const uint64_t *table,
                    const uint64_t *lbounds, int64_t nl, ucp_mem_h *memh_tab,
                    const uint64_t *rbounds, int64_t nr, ucp_rkey_h *rkey_tab,
                    uint64_t max_bytes, uint64_t max_ns, int *status, int *nev, kvf_op **left)
{
    kvf_op *op;
    const uint64_t *laddr = table, *raddr = table + n, *len = table + 2 * n;
    const int64_t *lidx = (const int64_t *)(table + 3 * n), *ridx = (const int64_t *)(table + 4 * n);
    uint64_t total = 0, start = 0, now;
    int64_t bad;
    size_t i;

    *nev = 0;
    for (i = 0; i < n; i++) {
        total += len[i];
        if (total > max_bytes || len[i] > max_bytes) {
            return -3;
        }
    }
    bad = kvf_check_runs(n, laddr, raddr, len, lidx, lbounds, nl, ridx, rbounds, nr);
    if (bad >= 0) {
        return bad;
    }
    op = kvf_op_new(e->w, id);
    if (op == NULL) {
        return -4;
    }
    *left = NULL;
    kvf_rma_u(op, e, is_put, n, laddr, raddr, len, lidx, memh_tab, ridx, rkey_tab, UINT64_MAX);
    while (op->pending > 1) {
        ucp_worker_progress(op->w->worker);
        if (op->pending == 1) {
            break;
        }
        now = kvf_now_ns();
        if (start == 0) {
            start = now;
        } else if (now - start > max_ns) {
            *nev = (int)kvf_nev(op->w);
            *left = op;
            return -2;
        }
    }
    *status = op->status;
    *nev = (int)kvf_nev(op->w);
    free(op->free_ep);
    free(op);
    return -1;
}

/* The runs of one block pair over every tensor, as kvflow._plan.plan_blocks makes them with no
   ext_param, equal tensor counts and equal block sizes (both sides' indices already checked): run t
   moves block lblock of local tensor t and block rblock of remote tensor t, in a (5, nt) table like
   RunBatch.table (local address, remote address, length, local tensor, remote tensor). The
   hypothesis test in tests/test_ucx_native.py holds the two planners to the same table. */
void kvf_block1_table(size_t nt, const uint64_t *lbase, const uint64_t *rbase, uint64_t stride,
                      uint64_t lblock, uint64_t rblock, uint64_t *table)
{
    size_t t;
    for (t = 0; t < nt; t++) {
        table[t] = lbase[t] + lblock * stride;
        table[nt + t] = rbase[t] + rblock * stride;
        table[2 * nt + t] = stride;
        table[3 * nt + t] = t;
        table[4 * nt + t] = t;
    }
}

#define KVF_BLOCK1_TENSORS 256

/* kvf_rma_now of one block pair over every tensor, planned here (no table from Python). -3 also
   for more than KVF_BLOCK1_TENSORS tensors. */
int64_t kvf_rma_block1(kvf_ep *e, uint64_t id, int is_put, size_t nt, const uint64_t *lbase,
                       const uint64_t *rbase, uint64_t stride, uint64_t lblock, uint64_t rblock,
                       const uint64_t *lbounds, int64_t nl, ucp_mem_h *memh_tab,
                       const uint64_t *rbounds, int64_t nr, ucp_rkey_h *rkey_tab,
                       uint64_t max_bytes, uint64_t max_ns, int *status, int *nev, kvf_op **left)
{
    uint64_t table[5 * KVF_BLOCK1_TENSORS];
    int64_t r;
    *nev = 0;
    if (nt == 0 || nt > KVF_BLOCK1_TENSORS || stride == 0 || stride > max_bytes / nt) {
        return -3;
    }
    kvf_block1_table(nt, lbase, rbase, stride, lblock, rblock, table);
    kvf_enter(e->w);
    r = kvf_rma_now_u(e, id, is_put, nt, table, lbounds, nl, memh_tab, rbounds, nr, rkey_tab, max_bytes,
                      max_ns, status, nev, left);
    kvf_leave(e->w);
    return r;
}

/* Close an endpoint; its record is freed when ``op`` completes. */
static int kvf_ep_close_u(kvf_ep *e, int force, kvf_op *op)
{
    ucp_request_param_t p;
    e->closing = 1;
    op->free_ep = e;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    p.cb.send = kvf_op_cb;
    p.user_data = op;
    return kvf_op_track(op, ucp_ep_close_nbx(e->ep, &p));
}

/* The helper thread: while helper_on, it progresses the worker (each call under the lock, stepping
 * aside for loop-thread callers in between) and tells the loop through notify_fd when there are
 * events or freed window; once no RMA byte is in flight it tells the loop one last time and waits
 * for the next kvf_helper_start. With nothing to progress it backs off from yielding to sleeping
 * 50 us, so a stalled operation costs little CPU. */
static void *kvf_helper_main(void *arg)
{
    kvf_worker *w = arg;
    unsigned n, quiet = 0;
    int tell;
    uint64_t one = 1;
    struct timespec nap = {0, 50000};

    if (w->helper_idle) {  /* like kvflow's copy threads: only a core no other thread wants */
        struct sched_param sp = {0};
        pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
    }
    pthread_mutex_lock(&w->lk->mu);
    for (;;) {
        while (!w->stop && !w->helper_on) {
            pthread_cond_wait(&w->cv, &w->lk->mu);
        }
        if (w->stop) {
            break;
        }
        n = ucp_worker_progress(w->worker);
        if (kvf_inflight(w) == 0) {
            __atomic_store_n(&w->helper_on, 0, __ATOMIC_RELEASE);
            w->wake = 1;
        }
        pthread_mutex_lock(&w->evmu);
        tell = (w->wake || w->nev != 0) && !w->notified;
        if (tell) {
            w->notified = 1;
            w->wake = 0;
        }
        pthread_mutex_unlock(&w->evmu);
        pthread_mutex_unlock(&w->lk->mu);
        /* Told with no lock held: the write wakes the loop thread, which takes evmu (and then the
           context lock) at once, while this SCHED_IDLE thread may not get a core back for a long
           time on a busy host; holding either lock across the write made the loop wait for it. */
        if (tell && write(w->notify_fd, &one, sizeof(one)) < 0 && errno != EAGAIN) {
            pthread_mutex_lock(&w->evmu);
            w->notified = 0;
            pthread_mutex_unlock(&w->evmu);
        }
        quiet = n != 0 ? 0 : quiet + 1;
        if (quiet > 64) {
            nanosleep(&nap, NULL);
        } else if (quiet > 0 || __atomic_load_n(&w->lk->want, __ATOMIC_SEQ_CST) != 0) {
            sched_yield();
        }
        while (__atomic_load_n(&w->lk->want, __ATOMIC_SEQ_CST) != 0) {
            sched_yield();
        }
        pthread_mutex_lock(&w->lk->mu);
    }
    pthread_mutex_unlock(&w->lk->mu);
    return NULL;
}

/* Have the helper thread progress the worker until no RMA byte is in flight (started on first
 * use; under SCHED_IDLE if ``idle``). Returns UCS_OK, or UCS_ERR_NO_RESOURCE if the thread could
 * not be created. */
int kvf_helper_start(kvf_worker *w, int idle)
{
    int st = UCS_OK;
    sigset_t all, old;
    if (__atomic_load_n(&w->helper_on, __ATOMIC_ACQUIRE)) {
        /* on already, and it turns off only under the lock once nothing is in flight: bytes the
           caller issued before this call keep it on (no wait here for a progress call) */
        return UCS_OK;
    }
    kvf_enter(w);
    if (!w->helper_started) {
        sigfillset(&all);  /* signals stay with the process's other threads */
        pthread_sigmask(SIG_SETMASK, &all, &old);
        w->helper_idle = idle;
        if (pthread_create(&w->helper, NULL, kvf_helper_main, w) == 0) {
            w->helper_started = 1;
        } else {
            st = UCS_ERR_NO_RESOURCE;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    if (st == UCS_OK && !w->helper_on && !w->stop) {
        __atomic_store_n(&w->helper_on, 1, __ATOMIC_RELEASE);
        pthread_cond_signal(&w->cv);
    }
    kvf_leave(w);
    return st;
}

/* Whether the helper thread is progressing the worker (the loop then only drains events). */
int kvf_helper_busy(kvf_worker *w) { return __atomic_load_n(&w->helper_on, __ATOMIC_ACQUIRE); }

/* The entry points above, each under the context's lock: KVF_LOCKED(type, name, (params), (args),
 * worker) defines name() as name_u() between kvf_enter(worker) and kvf_leave(worker). */
#define KVF_LOCKED(type, name, params, args, wk) \
    type name params                             \
    {                                            \
        type r;                                  \
        kvf_enter(wk);                           \
        r = name##_u args;                       \
        kvf_leave(wk);                           \
        return r;                                \
    }

KVF_LOCKED(int, kvf_worker_address, (kvf_worker *w, void **addr, size_t *len), (w, addr, len), w)
KVF_LOCKED(char *, kvf_worker_info, (kvf_worker *w), (w), w)
KVF_LOCKED(char *, kvf_context_info, (kvf_worker *w), (w), w)
KVF_LOCKED(int, kvf_mem_map, (kvf_worker *w, uint64_t addr, size_t len, int mem_type, ucp_mem_h *out),
           (w, addr, len, mem_type, out), w)
KVF_LOCKED(int, kvf_mem_unmap, (kvf_worker *w, ucp_mem_h memh), (w, memh), w)
KVF_LOCKED(int, kvf_rkey_pack, (kvf_worker *w, ucp_mem_h memh, void **buf, size_t *len),
           (w, memh, buf, len), w)
KVF_LOCKED(int, kvf_ep_create, (kvf_worker *w, const void *addr, uint64_t id, kvf_ep **out),
           (w, addr, id, out), w)
KVF_LOCKED(int, kvf_ep_rkey_unpack, (kvf_ep *e, const void *buf, ucp_rkey_h *out), (e, buf, out), e->w)
KVF_LOCKED(char *, kvf_ep_info, (kvf_ep *e), (e), e->w)
KVF_LOCKED(size_t, kvf_rma,
           (kvf_op *op, kvf_ep *e, int is_put, size_t n, const uint64_t *laddr, const uint64_t *raddr,
            const uint64_t *len, const int64_t *lidx, ucp_mem_h *memh_tab, const int64_t *ridx,
            ucp_rkey_h *rkey_tab, uint64_t max_bytes),
           (op, e, is_put, n, laddr, raddr, len, lidx, memh_tab, ridx, rkey_tab, max_bytes), e->w)
KVF_LOCKED(int, kvf_op_flush, (kvf_op *op, kvf_ep *e), (op, e), e->w)
KVF_LOCKED(int64_t, kvf_rma_now,
           (kvf_ep *e, uint64_t id, int is_put, size_t n, const uint64_t *table, const uint64_t *lbounds,
            int64_t nl, ucp_mem_h *memh_tab, const uint64_t *rbounds, int64_t nr, ucp_rkey_h *rkey_tab,
            uint64_t max_bytes, uint64_t max_ns, int *status, int *nev, kvf_op **left),
           (e, id, is_put, n, table, lbounds, nl, memh_tab, rbounds, nr, rkey_tab, max_bytes, max_ns, status,
            nev, left), e->w)
KVF_LOCKED(int, kvf_ep_close, (kvf_ep *e, int force, kvf_op *op), (e, force, op), e->w)

/* The op may be freed inside: its worker is read first. */
int kvf_op_finish(kvf_op *op, int *status)
{
    int r;
    kvf_worker *w = op->w;
    kvf_enter(w);
    r = kvf_op_finish_u(op, status);
    kvf_leave(w);
    return r;
}
"""


def _lib_dir(prefix: str) -> str:
    cands = [os.path.join(prefix, "lib"), os.path.join(prefix, "lib64")]
    cands += sorted(glob.glob(os.path.join(prefix, "lib", "*-linux-gnu")))
    for d in cands:
        if os.path.exists(os.path.join(d, "libucp.so")):
            return d
    raise RuntimeError(f"KVFLOW_UCX_PREFIX={prefix}: no libucp.so in {', '.join(cands)}")


def _locate() -> tuple[str, str, list[str], str]:
    """(include dir, library dir, run paths, origin) of the UCX to build against; origin is
    ``wheel`` or the prefix."""
    prefix = os.environ.get("KVFLOW_UCX_PREFIX")
    if prefix:
        inc = os.path.join(prefix, "include")
        if not os.path.exists(os.path.join(inc, "ucp", "api", "ucp.h")):
            raise RuntimeError(f"KVFLOW_UCX_PREFIX={prefix}: no include/ucp/api/ucp.h")
        lib = _lib_dir(prefix)
        return inc, lib, [lib], os.path.abspath(prefix)
    try:
        import libucx
    except ImportError as exc:
        raise RuntimeError(
            "kvflow-ucx needs UCX headers: install libucx-cu12 (a build requirement) "
            "or set KVFLOW_UCX_PREFIX to a UCX install prefix"
        ) from exc
    root = os.path.dirname(libucx.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib"), ["$ORIGIN/../libucx/lib"], "wheel"


def make_ffi() -> FFI:
    """The FFI builder for ``kvflow_ucx._native``."""
    inc, lib, rpath, origin = _locate()
    if '"' in origin or "\\" in origin:
        raise RuntimeError(f"KVFLOW_UCX_PREFIX={origin!r}: quotes and backslashes are not supported")
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "kvflow_ucx._native",
        SOURCE,
        include_dirs=[inc],
        library_dirs=[lib],
        libraries=["ucp", "uct", "ucs"],
        define_macros=[("KVF_ORIGIN", f'"{origin}"')],
        extra_link_args=[f"-Wl,-rpath,{p}" for p in rpath] + ["-Wl,--disable-new-dtags"],
        extra_compile_args=["-O2", "-std=gnu99", "-Wall"],
    )
    return ffi


ffibuilder = make_ffi()

if __name__ == "__main__":  # build in place: python src/kvflow_ucx/_build.py
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sys.exit(0 if ffibuilder.compile(tmpdir=out, verbose=True) else 1)
