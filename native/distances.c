/* Squared L2 distances between the same bf16 tensor of several model variants, for `esftctl consolidate`.
 *
 * consolidate ranks expert positions by the sum over pairs of variants of ||expert_i - expert_j||. Done with
 * torch in float64 (esftctl.consolidate.pair_distances_reference, the reference this is tested against), every
 * pair's difference is a new 8-bytes-a-value tensor: on DeepSeek-V2-Lite's experts (8.65 M values, 4 variants,
 * 6 pairs) about 1 GB of memory traffic per expert, and consolidate ran 4-6x slower than reading its input.
 * Here one pass reads each variant's value once and keeps every pair's sum of squares in registers.
 *
 * bf16 -> double and the differences of doubles are exact; sums are float64, over fixed blocks of BLOCK values
 * added in block order, so the result does not depend on the thread count.
 *
 *   pair_squared_distances(tensors: sequence of M buffers of uint16 bf16 bits, one length, threads: int)
 *       -> bytes of M*(M-1)/2 float64, pairs (0,1), (0,2), ..., (1,2), ...
 */
#include "huffman.h"

#include <string.h>

#define MAX_VARIANTS 16
#define MAX_PAIRS (MAX_VARIANTS * (MAX_VARIANTS - 1) / 2)
#define BLOCK 4096

typedef struct {
    const uint16_t *bits[MAX_VARIANTS];
    int variants;
    int64_t count, first_block, last_block;
    double *block_sums; /* [blocks][pairs] */
} DistanceJob;

static inline double bf16_to_double(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f;
}

static void *sum_blocks(void *arg) {
    DistanceJob *j = (DistanceJob *)arg;
    int m = j->variants, pairs = m * (m - 1) / 2;
    for (int64_t b = j->first_block; b < j->last_block; b++) {
        double sums[MAX_PAIRS] = {0}, v[MAX_VARIANTS];
        int64_t end = (b + 1) * BLOCK < j->count ? (b + 1) * BLOCK : j->count;
        for (int64_t i = b * BLOCK; i < end; i++) {
            for (int k = 0; k < m; k++) v[k] = bf16_to_double(j->bits[k][i]);
            int p = 0;
            for (int x = 0; x < m; x++)
                for (int y = x + 1; y < m; y++, p++) {
                    double d = v[x] - v[y];
                    sums[p] += d * d;
                }
        }
        memcpy(j->block_sums + b * pairs, sums, pairs * sizeof(double));
    }
    return NULL;
}

PyObject *pair_squared_distances(PyObject *self, PyObject *args) {
    PyObject *seq;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi", &seq, &threads)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "tensors must be a sequence of buffers");
    if (!fast) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(fast);
    Py_buffer views[MAX_VARIANTS];
    int held = 0;
    PyObject *result = NULL;
    double *block_sums = NULL;
    DistanceJob *jobs = NULL;
    if (m < 2 || m > MAX_VARIANTS) {
        PyErr_Format(PyExc_ValueError, "need 2 to %d tensors, got %zd", MAX_VARIANTS, m);
        goto done;
    }
    for (; held < m; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), &views[held], PyBUF_SIMPLE) < 0) goto done;
        if (views[held].len != views[0].len || views[held].len % 2) {
            held++;
            PyErr_SetString(PyExc_ValueError, "the tensors must be bf16 bits of one length");
            goto done;
        }
    }
    int pairs = (int)(m * (m - 1) / 2);
    int64_t count = views[0].len / 2, blocks = (count + BLOCK - 1) / BLOCK;
    threads = clamp_threads(threads);
    block_sums = calloc((size_t)(blocks ? blocks : 1) * pairs, sizeof(double));
    jobs = calloc((size_t)threads, sizeof(DistanceJob));
    if (!block_sums || !jobs) { PyErr_NoMemory(); goto done; }
    for (int t = 0; t < threads; t++) {
        for (int k = 0; k < m; k++) jobs[t].bits[k] = views[k].buf;
        jobs[t].variants = (int)m;
        jobs[t].count = count;
        jobs[t].first_block = blocks * t / threads;
        jobs[t].last_block = blocks * (t + 1) / threads;
        jobs[t].block_sums = block_sums;
    }
    Py_BEGIN_ALLOW_THREADS
    run_threads(sum_blocks, jobs, sizeof(DistanceJob), threads);
    Py_END_ALLOW_THREADS
    result = PyBytes_FromStringAndSize(NULL, pairs * sizeof(double));
    if (result) {
        double *total = (double *)PyBytes_AS_STRING(result);
        memset(total, 0, pairs * sizeof(double));
        for (int64_t b = 0; b < blocks; b++)
            for (int p = 0; p < pairs; p++) total[p] += block_sums[b * pairs + p];
    }
done:
    for (int k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    Py_DECREF(fast);
    free(block_sums);
    free(jobs);
    return result;
}
