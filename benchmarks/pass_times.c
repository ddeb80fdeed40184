/* Times every graph llama.cpp computes in this process: an LD_PRELOAD library for benchmarks/pass_times.py.
 *
 * llama_decode runs each ubatch's graph through ggml_backend_sched_graph_compute_async, a call from
 * libllama into libggml-base; a preloaded definition comes first in the lookup, in llama-server and in
 * a libllama that ctypes loaded alike. Each call appends one line to $PASS_TIMES:
 *     <CLOCK_MONOTONIC start, ms> <duration, ms> <graph nodes> <rows: the first node's ne[1]>
 * The real function is taken from the libggml-base already loaded (RTLD_NOLOAD), which ctypes may
 * have loaded RTLD_LOCAL, out of RTLD_NEXT's reach.
 *
 *     cc -O2 -shared -fPIC -I <dir of ggml.h> pass_times.c -o pass_times.so -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ggml-backend.h"
#include "ggml.h"

typedef enum ggml_status (*compute_fn)(ggml_backend_sched_t, struct ggml_cgraph *);

static FILE *out;
static compute_fn real;
static int (*n_nodes)(struct ggml_cgraph *);
static struct ggml_tensor *(*node)(struct ggml_cgraph *, int);
static pthread_once_t once = PTHREAD_ONCE_INIT;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void init(void) {
    void *h = dlopen("libggml-base.so.0", RTLD_NOLOAD | RTLD_LAZY);
    if (!h) h = dlopen("libggml-base.so", RTLD_NOLOAD | RTLD_LAZY);
    if (!h) { fprintf(stderr, "pass_times.so: libggml-base is not loaded: %s\n", dlerror()); abort(); }
    real = (compute_fn)dlsym(h, "ggml_backend_sched_graph_compute_async");
    n_nodes = (int (*)(struct ggml_cgraph *))dlsym(h, "ggml_graph_n_nodes");
    node = (struct ggml_tensor * (*)(struct ggml_cgraph *, int)) dlsym(h, "ggml_graph_node");
    const char *path = getenv("PASS_TIMES");
    out = fopen(path ? path : "/dev/null", "a");
    if (!real || !n_nodes || !node || !out) { fprintf(stderr, "pass_times.so: cannot start\n"); abort(); }
    setvbuf(out, NULL, _IOLBF, 0);
}

enum ggml_status ggml_backend_sched_graph_compute_async(ggml_backend_sched_t sched, struct ggml_cgraph *graph) {
    pthread_once(&once, init);
    int n = n_nodes(graph);
    long long rows = n > 0 ? (long long)node(graph, 0)->ne[1] : 0;
    double t0 = now_ms();
    enum ggml_status status = real(sched, graph);
    fprintf(out, "%.3f %.3f %d %lld\n", t0, now_ms() - t0, n, rows);
    return status;
}
