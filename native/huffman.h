/* Shared by esftctl's native sources: the Huffman chunk layout's constants (esftctl/huffman.py says the format),
 * a helper that runs one function over per-thread jobs, and the functions module.c exports. */
#ifndef ESFTCTL_HUFFMAN_H
#define ESFTCTL_HUFFMAN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define LANES 32 /* chunks that share a block of values */
#define GROUP 16 /* values a chunk takes in turn */
/* The largest chunk (esftctl.huffman.MAX_CHUNK): callers refuse larger ones before any chunk arithmetic, so that
 * LANES * chunk and the indices below stay far from overflow (at 2**59 LANES * chunk wrapped to 0). */
#define MAX_CHUNK (1 << 16)
#define MAX_THREADS 256

/* Whether `chunk` is a chunk size the coders take: a multiple of GROUP from GROUP to MAX_CHUNK. */
static inline int chunk_ok(long long chunk) { return chunk >= GROUP && chunk <= MAX_CHUNK && chunk % GROUP == 0; }

/* The first value of chunk k, and the end of its block: chunk k takes GROUP values every LANES * GROUP from
 * its first, up to the block's end or count. */
static inline int64_t chunk_first(int64_t k, int64_t chunk) { return (k / LANES) * (LANES * chunk) + (k % LANES) * GROUP; }
static inline int64_t chunk_block_end(int64_t k, int64_t chunk) { return (k / LANES + 1) * (LANES * chunk); }

/* How many chunks `count` values make (esftctl.huffman.chunk_count). */
static inline int64_t chunk_total(int64_t count, int64_t chunk) {
    int64_t whole = count / (LANES * chunk), rest = count % (LANES * chunk), tail = (rest + GROUP - 1) / GROUP;
    return whole * LANES + (tail < LANES ? tail : LANES);
}

/* Runs fn on jobs[0..threads) (each `size` bytes), jobs[0] on the calling thread; a thread that fails to start
 * has its job run here. Call with the GIL released. */
static inline void run_threads(void *(*fn)(void *), void *jobs, size_t size, int threads) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, fn, (char *)jobs + t * size) == 0;
    fn(jobs);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else fn((char *)jobs + t * size);
    }
}

static inline int clamp_threads(int threads) { return threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads; }

PyObject *huffman_encode(PyObject *self, PyObject *args);
PyObject *huffman_split_bf16(PyObject *self, PyObject *args);
PyObject *huffman_decode_bf16(PyObject *self, PyObject *args);
PyObject *pair_squared_distances(PyObject *self, PyObject *args);

#endif
