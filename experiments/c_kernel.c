/* The simulator's event loop (simulator/_kernel.py, simulate_kernel) translated line by line to C, for
   experiments.c_kernel: how fast the same loop runs as plain C on this machine. Not used by the project
   (numba is its compiler); inputs as simulator.engine passes them (int64, float64), int32 scratch. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef int64_t i64;
typedef int32_t i32;

#define BETTER(pa, a, pb, b) ((pa) > (pb) || ((pa) == (pb) && (a) < (b)))

i64 simulate_kernel(i64 n, const double *duration, const double *lag, const double *priority_in,
                    const i64 *res_ptr, const i64 *res_idx, const i64 *dep_ptr,
                    const i64 *succ_ptr, const i64 *succ_idx, const i64 *mem_ptr,
                    const i64 *mem_res, const i64 *mem_bytes, const i64 *free_ptr,
                    const i64 *free_idx, i64 n_free_idx, const i64 *resident_bytes, i64 n_res,
                    int fifo,
                    double *start, double *finish, double *release_time, double *busy, i64 *peak)
{
    double *prio_own = NULL;
    const double *priority = priority_in;
    double *priority_w = NULL;
    if (fifo) {
        prio_own = (double *)calloc(n ? n : 1, sizeof(double));
        priority = prio_own;
        priority_w = prio_own;
    }
    i32 *pending = (i32 *)malloc(sizeof(i32) * (n + 1));
    i32 *refcount = (i32 *)calloc(n + 1, sizeof(i32));
    for (i64 j = 0; j < n_free_idx; j++) refcount[free_idx[j]] += 1;
    for (i64 r = 0; r < n_res; r++) busy[r] = 0.0;
    for (i64 t = 0; t < n; t++) {
        pending[t] = (i32)(dep_ptr[t + 1] - dep_ptr[t]);
        if (refcount[t] > 0) refcount[t] += 1;
        for (i64 j = res_ptr[t]; j < res_ptr[t + 1]; j++) busy[res_idx[j]] += duration[t];
    }
    for (i64 t = 0; t < n; t++) release_time[t] = INFINITY;
    i64 *allocated = (i64 *)malloc(sizeof(i64) * (n_res + 1));
    memcpy(allocated, resident_bytes, sizeof(i64) * n_res);
    memcpy(peak, resident_bytes, sizeof(i64) * n_res);
    uint8_t *held = (uint8_t *)calloc(n_res + 1, 1);
    i32 *wait_root = (i32 *)malloc(sizeof(i32) * (n_res + 1));
    for (i64 r = 0; r < n_res; r++) wait_root[r] = -1;
    i32 *child = (i32 *)malloc(sizeof(i32) * (n + 1));
    i32 *sib = (i32 *)malloc(sizeof(i32) * (n + 1));
    i32 *pairs = (i32 *)malloc(sizeof(i32) * (n + 1));
    i32 *source = (i32 *)malloc(sizeof(i32) * (n + 1));
    i32 *cand = (i32 *)malloc(sizeof(i32) * (n + 1));
    i64 n_cand = 0;
    i32 *staged = (i32 *)malloc(sizeof(i32) * (n + 1));
    i64 n_staged = 0;
    i64 *promote = (i64 *)malloc(sizeof(i64) * (2 * n_res + 1));
    i64 n_promote = 0;
    i32 *events = (i32 *)malloc(sizeof(i32) * (n + 1));
    i64 n_events = 0;
    uint8_t *sent = (uint8_t *)calloc(n + 1, 1);
    double *sent_at = (double *)malloc(sizeof(double) * (n + 1));

    for (i64 t = 0; t < n; t++) {
        if (pending[t] == 0) {
            source[t] = -1;
            staged[n_staged++] = (i32)t;
        }
    }

    double now = 0.0;
    i64 n_started = 0;
    for (;;) {
        for (;;) {
            while (n_promote > 0) {
                n_promote -= 1;
                i64 r = promote[n_promote];
                i64 w = wait_root[r];
                if (w < 0 || held[r]) continue;
                i64 m = 0;
                i64 c = child[w];
                while (c >= 0) {
                    i64 a = c;
                    i64 b = sib[a];
                    sib[a] = -1;
                    if (b >= 0) {
                        c = sib[b];
                        sib[b] = -1;
                        if (BETTER(priority[b], b, priority[a], a)) { i64 tmp = a; a = b; b = tmp; }
                        sib[b] = child[a];
                        child[a] = (i32)b;
                    } else {
                        c = -1;
                    }
                    pairs[m++] = (i32)a;
                }
                i64 root = -1;
                for (i64 i = m - 1; i > -1; i--) {
                    i64 a = pairs[i];
                    if (root >= 0) {
                        i64 b = root;
                        if (BETTER(priority[b], b, priority[a], a)) { i64 tmp = a; a = b; b = tmp; }
                        sib[b] = child[a];
                        child[a] = (i32)b;
                    }
                    root = a;
                }
                wait_root[r] = (i32)root;
                source[w] = (i32)r;
                staged[n_staged++] = (i32)w;
            }
            while (n_staged > 0) {
                n_staged -= 1;
                i64 x = staged[n_staged];
                i64 i = n_cand;
                n_cand += 1;
                while (i > 0) {
                    i64 p = (i - 1) >> 1;
                    i64 y = cand[p];
                    if (BETTER(priority[x], x, priority[y], y)) {
                        cand[i] = (i32)y;
                        i = p;
                    } else break;
                }
                cand[i] = (i32)x;
            }
            if (n_cand == 0) break;
            i64 c = cand[0];
            n_cand -= 1;
            if (n_cand > 0) {
                i64 x = cand[n_cand];
                i64 i = 0;
                for (;;) {
                    i64 k = 2 * i + 1;
                    if (k >= n_cand) break;
                    if (k + 1 < n_cand) {
                        i64 y = cand[k + 1];
                        i64 z = cand[k];
                        if (BETTER(priority[y], y, priority[z], z)) k += 1;
                    }
                    i64 y = cand[k];
                    if (BETTER(priority[y], y, priority[x], x)) {
                        cand[i] = (i32)y;
                        i = k;
                    } else break;
                }
                cand[i] = (i32)x;
            }
            i64 blocker = -1;
            for (i64 j = res_ptr[c]; j < res_ptr[c + 1]; j++) {
                if (held[res_idx[j]]) { blocker = res_idx[j]; break; }
            }
            if (blocker < 0) {
                for (i64 j = res_ptr[c]; j < res_ptr[c + 1]; j++) held[res_idx[j]] = 1;
                for (i64 j = mem_ptr[c]; j < mem_ptr[c + 1]; j++) {
                    i64 r = mem_res[j];
                    allocated[r] += mem_bytes[j];
                    peak[r] = peak[r] > allocated[r] ? peak[r] : allocated[r];
                }
                start[c] = now;
                double fc = now + duration[c];
                finish[c] = fc;
                n_started += 1;
                i64 i = n_events;
                n_events += 1;
                while (i > 0) {
                    i64 p = (i - 1) >> 1;
                    i64 y = events[p];
                    if (fc < finish[y] || (fc == finish[y] && c < y)) {
                        events[i] = (i32)y;
                        i = p;
                    } else break;
                }
                events[i] = (i32)c;
            } else {
                child[c] = -1;
                sib[c] = -1;
                i64 a = wait_root[blocker];
                if (a < 0) {
                    wait_root[blocker] = (i32)c;
                } else {
                    i64 b = c;
                    if (BETTER(priority[b], b, priority[a], a)) { i64 tmp = a; a = b; b = tmp; }
                    sib[b] = child[a];
                    child[a] = (i32)b;
                    wait_root[blocker] = (i32)a;
                }
            }
            if (source[c] >= 0) promote[n_promote++] = source[c];
        }
        if (n_events == 0) break;
        now = finish[events[0]];
        while (n_events > 0 && finish[events[0]] == now) {
            i64 f = events[0];
            n_events -= 1;
            if (n_events > 0) {
                i64 x = events[n_events];
                double fx = finish[x];
                i64 i = 0;
                for (;;) {
                    i64 k = 2 * i + 1;
                    if (k >= n_events) break;
                    if (k + 1 < n_events) {
                        i64 y = events[k + 1];
                        i64 z = events[k];
                        if (finish[y] < finish[z] || (finish[y] == finish[z] && y < z)) k += 1;
                    }
                    i64 y = events[k];
                    if (finish[y] < fx || (finish[y] == fx && y < x)) {
                        events[i] = (i32)y;
                        i = k;
                    } else break;
                }
                events[i] = (i32)x;
            }
            double lf = lag[f];
            if (lf > 0.0 && sent[f]) {
                finish[f] = sent_at[f];
            } else {
                for (i64 j = res_ptr[f]; j < res_ptr[f + 1]; j++) {
                    i64 r = res_idx[j];
                    held[r] = 0;
                    if (wait_root[r] >= 0) promote[n_promote++] = r;
                }
                for (i64 j = free_ptr[f] - 1; j < free_ptr[f + 1]; j++) {
                    i64 x = j >= free_ptr[f] ? free_idx[j] : f;
                    if (refcount[x] == 0) continue;
                    refcount[x] -= 1;
                    if (refcount[x] == 0) {
                        for (i64 jm = mem_ptr[x]; jm < mem_ptr[x + 1]; jm++)
                            allocated[mem_res[jm]] -= mem_bytes[jm];
                        release_time[x] = now;
                    }
                }
                if (lf > 0.0) {
                    sent[f] = 1;
                    sent_at[f] = now;
                    double ef = now + lf;
                    finish[f] = ef;
                    i64 i = n_events;
                    n_events += 1;
                    while (i > 0) {
                        i64 p = (i - 1) >> 1;
                        i64 y = events[p];
                        if (ef < finish[y] || (ef == finish[y] && f < y)) {
                            events[i] = (i32)y;
                            i = p;
                        } else break;
                    }
                    events[i] = (i32)f;
                    continue;
                }
            }
            for (i64 j = succ_ptr[f]; j < succ_ptr[f + 1]; j++) {
                i64 x = succ_idx[j];
                pending[x] -= 1;
                if (pending[x] == 0) {
                    if (fifo) priority_w[x] = -now;
                    source[x] = -1;
                    staged[n_staged++] = (i32)x;
                }
            }
        }
    }
    free(prio_own); free(pending); free(refcount); free(allocated); free(held); free(wait_root);
    free(child); free(sib); free(pairs); free(source); free(cand); free(staged); free(promote);
    free(events); free(sent); free(sent_at);
    return n_started;
}
