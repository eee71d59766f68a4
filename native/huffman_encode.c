/* The Huffman encoder of esftctl's expert stores, native and multithreaded, and the bf16 split before it.
 *
 * encode writes exactly the stream of esftctl.huffman.encode_reference (tested bit for bit against it): the
 * symbols in chunk_layout's order (chunk c of block b takes values b*LANES*chunk + g*LANES*GROUP + c*GROUP + j),
 * each code MSB-first, chunks back to back with no padding, and the starting bit of every chunk. The numpy
 * reference runs at 7-15 M values/s on one core; DeepSeek-V2-Lite's 14.4 G expert values then take 25 minutes.
 *
 * Two passes over the chunks, each split across threads: (1) every chunk's length in bits, then a prefix sum
 * gives every chunk's starting bit; (2) every thread writes its chunks into the shared output through a 64-bit
 * accumulator, whole words at a time. Only the first and last word of a thread's range can hold another
 * thread's bits, and those two are OR-ed in atomically, so the result does not depend on the thread count.
 *
 *   encode(symbols: buffer of uint8, lengths: buffer of 256 uint8, codes: buffer of 256 uint64, chunk: int,
 *          threads: int) -> (bytes, bytes of uint64 chunk offsets)
 *
 * split_bf16 does esftctl.huffman.split_bf16 and the exponents' histogram in one pass (numpy needs five passes
 * and four temporaries, and np.bincount another):
 *
 *   split_bf16(bits: buffer of uint16, threads: int) -> (exponent bytes, sign-and-mantissa bytes,
 *                                                        bytes of 256 int64 counts)
 */
#include "huffman.h"

#include <string.h>

typedef struct {
    const uint8_t *symbols;
    int64_t count, chunk;
    const uint8_t *lengths;
    const uint64_t *codes;
    uint64_t *offsets;   /* nchunks + 1: starting bits, then the total */
    uint64_t *words;     /* output, big-endian words once written */
    int64_t first, last; /* this thread's chunks [first, last) */
    int missing;         /* a symbol without a code was met */
} EncodeJob;

static void *count_bits(void *arg) {
    EncodeJob *j = (EncodeJob *)arg;
    for (int64_t k = j->first; k < j->last; k++) {
        uint64_t bits = 0;
        int64_t block_end = chunk_block_end(k, j->chunk);
        for (int64_t g = chunk_first(k, j->chunk); g < j->count && g < block_end; g += LANES * GROUP) {
            int64_t end = g + GROUP < j->count ? g + GROUP : j->count;
            for (int64_t i = g; i < end; i++) {
                uint8_t n = j->lengths[j->symbols[i]];
                if (!n) j->missing = 1;
                bits += n;
            }
        }
        j->offsets[k + 1] = bits;
    }
    return NULL;
}

static inline void or_word(uint64_t *words, int64_t w, uint64_t v, int shared) {
    if (!v) return;
    if (shared) __atomic_fetch_or(&words[w], v, __ATOMIC_RELAXED);
    else words[w] |= v;
}

static void *write_bits(void *arg) {
    EncodeJob *j = (EncodeJob *)arg;
    if (j->first >= j->last) return NULL;
    uint64_t pos = j->offsets[j->first], end_bit = j->offsets[j->last];
    int64_t first_word = (int64_t)(pos >> 6), last_word = (int64_t)((end_bit - (end_bit > pos)) >> 6);
    int64_t w = first_word;
    uint64_t acc = 0;
    int used = (int)(pos & 63); /* bits of acc already taken (by the previous thread, for the first word) */
    for (int64_t k = j->first; k < j->last; k++) {
        int64_t block_end = chunk_block_end(k, j->chunk);
        for (int64_t g = chunk_first(k, j->chunk); g < j->count && g < block_end; g += LANES * GROUP) {
            int64_t end = g + GROUP < j->count ? g + GROUP : j->count;
            for (int64_t i = g; i < end; i++) {
                uint8_t s = j->symbols[i];
                int n = j->lengths[s];
                uint64_t code = j->codes[s];
                int room = 64 - used;
                if (n < room) {
                    acc |= code << (room - n);
                    used += n;
                } else { /* fills this word: the high part here, the rest starts the next one */
                    int spill = n - room;
                    acc |= spill ? code >> spill : code;
                    or_word(j->words, w, acc, w == first_word || w == last_word);
                    w++;
                    acc = spill ? code << (64 - spill) : 0;
                    used = spill;
                }
            }
        }
    }
    if (used) or_word(j->words, w, acc, 1);
    return NULL;
}

PyObject *huffman_encode(PyObject *self, PyObject *args) {
    Py_buffer sym, len, cod;
    long long chunk;
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*y*Li", &sym, &len, &cod, &chunk, &threads)) return NULL;
    PyObject *result = NULL;
    uint64_t *offsets = NULL, *words = NULL;
    EncodeJob *jobs = NULL;
    if (len.len != 256 || cod.len != 256 * 8 || !chunk_ok(chunk)) {
        PyErr_Format(PyExc_ValueError, "need 256 code lengths, 256 uint64 codes and a chunk size that is a multiple "
                                       "of %d from %d to %d", GROUP, GROUP, MAX_CHUNK);
        goto done;
    }
    threads = clamp_threads(threads);
    int64_t count = sym.len, nchunks = chunk_total(count, chunk);
    offsets = calloc((size_t)nchunks + 1, sizeof(uint64_t));
    jobs = calloc((size_t)threads, sizeof(EncodeJob));
    if (!offsets || !jobs) { PyErr_NoMemory(); goto done; }
    for (int t = 0; t < threads; t++) {
        jobs[t] = (EncodeJob){sym.buf, count, chunk, len.buf, cod.buf, offsets, NULL,
                              nchunks * t / threads, nchunks * (t + 1) / threads, 0};
    }
    Py_BEGIN_ALLOW_THREADS
    run_threads(count_bits, jobs, sizeof(EncodeJob), threads);
    Py_END_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        if (jobs[t].missing) { PyErr_SetString(PyExc_ValueError, "a symbol has no code"); goto done; }
    }
    for (int64_t k = 0; k < nchunks; k++) offsets[k + 1] += offsets[k];
    uint64_t total = offsets[nchunks];
    int64_t nwords = (int64_t)(total / 64) + 2;
    words = calloc((size_t)nwords, sizeof(uint64_t));
    if (!words) { PyErr_NoMemory(); goto done; }
    for (int t = 0; t < threads; t++) jobs[t].words = words;
    Py_BEGIN_ALLOW_THREADS
    run_threads(write_bits, jobs, sizeof(EncodeJob), threads);
    for (int64_t w = 0; w < nwords; w++) words[w] = __builtin_bswap64(words[w]);
    Py_END_ALLOW_THREADS
    PyObject *data = PyBytes_FromStringAndSize((const char *)words, (Py_ssize_t)((total + 7) / 8));
    PyObject *starts = PyBytes_FromStringAndSize((const char *)offsets, (Py_ssize_t)(nchunks * 8));
    if (data && starts) result = PyTuple_Pack(2, data, starts);
    Py_XDECREF(data);
    Py_XDECREF(starts);
done:
    free(offsets);
    free(words);
    free(jobs);
    PyBuffer_Release(&sym);
    PyBuffer_Release(&len);
    PyBuffer_Release(&cod);
    return result;
}

typedef struct {
    const uint16_t *bits;
    uint8_t *exponent, *sign_mantissa;
    int64_t first, last;
    int64_t counts[256];
} SplitJob;

static void *split_range(void *arg) {
    SplitJob *j = (SplitJob *)arg;
    for (int64_t i = j->first; i < j->last; i++) {
        uint16_t b = j->bits[i];
        uint8_t e = (uint8_t)(b >> 7);
        j->exponent[i] = e;
        j->sign_mantissa[i] = (uint8_t)(((b >> 8) & 0x80) | (b & 0x7F));
        j->counts[e]++;
    }
    return NULL;
}

PyObject *huffman_split_bf16(PyObject *self, PyObject *args) {
    Py_buffer bits;
    int threads;
    if (!PyArg_ParseTuple(args, "y*i", &bits, &threads)) return NULL;
    PyObject *result = NULL, *exponent = NULL, *sign_mantissa = NULL, *counts = NULL;
    SplitJob *jobs = NULL;
    if (bits.len % 2) {
        PyErr_SetString(PyExc_ValueError, "bf16 bits must be whole uint16 values");
        goto done;
    }
    threads = clamp_threads(threads);
    int64_t n = bits.len / 2;
    exponent = PyBytes_FromStringAndSize(NULL, n);
    sign_mantissa = PyBytes_FromStringAndSize(NULL, n);
    counts = PyBytes_FromStringAndSize(NULL, 256 * sizeof(int64_t));
    jobs = calloc((size_t)threads, sizeof(SplitJob));
    if (!exponent || !sign_mantissa || !counts || !jobs) { if (!PyErr_Occurred()) PyErr_NoMemory(); goto done; }
    for (int t = 0; t < threads; t++) {
        jobs[t].bits = bits.buf;
        jobs[t].exponent = (uint8_t *)PyBytes_AS_STRING(exponent);
        jobs[t].sign_mantissa = (uint8_t *)PyBytes_AS_STRING(sign_mantissa);
        jobs[t].first = n * t / threads;
        jobs[t].last = n * (t + 1) / threads;
    }
    Py_BEGIN_ALLOW_THREADS
    run_threads(split_range, jobs, sizeof(SplitJob), threads);
    Py_END_ALLOW_THREADS
    int64_t *total = (int64_t *)PyBytes_AS_STRING(counts);
    memset(total, 0, 256 * sizeof(int64_t));
    for (int t = 0; t < threads; t++)
        for (int s = 0; s < 256; s++) total[s] += jobs[t].counts[s];
    result = PyTuple_Pack(3, exponent, sign_mantissa, counts);
done:
    Py_XDECREF(exponent);
    Py_XDECREF(sign_mantissa);
    Py_XDECREF(counts);
    free(jobs);
    PyBuffer_Release(&bits);
    return result;
}
