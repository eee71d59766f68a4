/* The Huffman decoder of esftctl's expert stores on the CPU, native and multithreaded: bf16 values out.
 *
 * Decodes the stream esftctl.huffman.encode writes (chunk_layout's order, codes MSB-first, each chunk from its
 * recorded starting bit) and joins every exponent with its sign-and-mantissa byte, writing the bf16 bits in
 * place: the output of esftctl.huffman.decode followed by join_bf16, the numpy reference it is tested against.
 * That reference steps all chunks in lockstep at about 33 M values/s; a DeepSeek-V2-Lite store (14.4 G values)
 * would take 7 minutes to decompress.
 *
 * Chunks decode independently, so threads take contiguous ranges of chunks. A symbol is one lookup of the next
 * `width` bits (width >= the longest code) in a table of (symbol, code length). Reads past the stream's end see
 * zero bits; a window that matches no code, or a chunk that runs past its successor's start, is an error.
 * A chunk size outside GROUP..MAX_CHUNK is refused before any arithmetic on it (huffman.h).
 *
 *   decode_bf16(data: buffer, offsets: buffer of uint64 chunk starting bits, count: int, symbols: buffer of
 *               2**width uint8, lengths: buffer of 2**width uint8, chunk: int, sign_mantissa: buffer of count
 *               uint8, out: writable buffer of count uint16, threads: int) -> None
 */
#include "huffman.h"

#include <string.h>

typedef struct {
    const uint8_t *data;
    int64_t nbytes;
    const uint64_t *offsets;
    int64_t nchunks, count, chunk;
    const uint8_t *table_symbol, *table_length;
    int width;
    const uint8_t *sign_mantissa;
    uint16_t *out;
    int64_t first, last; /* this thread's chunks */
    int corrupt;
} DecodeJob;

/* The 32 bits from byte b on, big-endian, zero past the end. */
static inline uint32_t load32(const uint8_t *data, int64_t nbytes, int64_t b) {
    uint32_t v = 0;
    if (b + 4 <= nbytes) {
        memcpy(&v, data + b, 4); /* any alignment: one load once compiled */
        return __builtin_bswap32(v);
    }
    for (int i = 0; i < 4; i++) v = (v << 8) | (b + i < nbytes ? data[b + i] : 0);
    return v;
}

static void *decode_chunks(void *arg) {
    DecodeJob *j = (DecodeJob *)arg;
    const uint32_t mask = (1u << j->width) - 1;
    for (int64_t k = j->first; k < j->last; k++) {
        uint64_t pos = j->offsets[k];
        uint64_t limit = k + 1 < j->nchunks ? j->offsets[k + 1] : (uint64_t)j->nbytes * 8;
        int64_t block_end = chunk_block_end(k, j->chunk);
        for (int64_t g = chunk_first(k, j->chunk); g < j->count && g < block_end; g += LANES * GROUP) {
            int64_t end = g + GROUP < j->count ? g + GROUP : j->count;
            for (int64_t i = g; i < end; i++) {
                /* 32 bits from pos's byte hold the window: width (<= 25) + pos's 7 bits at most */
                uint32_t window = load32(j->data, j->nbytes, (int64_t)(pos >> 3)) << (pos & 7);
                uint32_t peek = (window >> (32 - j->width)) & mask;
                uint8_t n = j->table_length[peek];
                if (!n) { j->corrupt = 1; return NULL; }
                uint16_t e = j->table_symbol[peek], sm = j->sign_mantissa[i];
                j->out[i] = (uint16_t)(((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F));
                pos += n;
            }
        }
        if (pos > limit) { j->corrupt = 1; return NULL; }
    }
    return NULL;
}

PyObject *huffman_decode_bf16(PyObject *self, PyObject *args) {
    Py_buffer data, offsets, symbols, lengths, sm, out;
    long long count, chunk;
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*Ly*y*Ly*w*i", &data, &offsets, &count, &symbols, &lengths, &chunk, &sm, &out,
                          &threads))
        return NULL;
    PyObject *result = NULL;
    DecodeJob *jobs = NULL;
    int width = 0;
    while (((Py_ssize_t)1 << width) < symbols.len) width++;
    int64_t nchunks = chunk_ok(chunk) && count > 0 ? chunk_total(count, chunk) : 0; /* only for a chunk size in range */
    if (!chunk_ok(chunk) || count < 0) {
        PyErr_Format(PyExc_ValueError, "the chunk size must be a multiple of %d from %d to %d", GROUP, GROUP, MAX_CHUNK);
    } else if (((Py_ssize_t)1 << width) != symbols.len || symbols.len != lengths.len || width < 1 || width > 25) {
        PyErr_SetString(PyExc_ValueError, "decode tables must be two tables of 2**width entries, width 1 to 25");
    } else if (offsets.len != nchunks * 8) {
        PyErr_Format(PyExc_ValueError, "%zd chunk offsets for %lld chunks", offsets.len / 8, (long long)nchunks);
    } else if (sm.len != count || out.len != 2 * count) {
        PyErr_SetString(PyExc_ValueError, "need one sign-and-mantissa byte and one uint16 of output per value");
    } else if (!(jobs = calloc((size_t)(threads = clamp_threads(threads)), sizeof(DecodeJob)))) {
        PyErr_NoMemory();
    } else {
        for (int t = 0; t < threads; t++)
            jobs[t] = (DecodeJob){data.buf, data.len, offsets.buf, nchunks, count, chunk, symbols.buf, lengths.buf,
                                  width, sm.buf, out.buf, nchunks * t / threads, nchunks * (t + 1) / threads, 0};
        Py_BEGIN_ALLOW_THREADS
        run_threads(decode_chunks, jobs, sizeof(DecodeJob), threads);
        Py_END_ALLOW_THREADS
        int corrupt = 0;
        for (int t = 0; t < threads; t++) corrupt |= jobs[t].corrupt;
        if (corrupt) PyErr_SetString(PyExc_ValueError, "corrupt Huffman stream (a code that does not exist, or a "
                                                       "chunk past its end)");
        else result = Py_NewRef(Py_None);
    }
    free(jobs);
    PyBuffer_Release(&data);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&symbols);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&sm);
    PyBuffer_Release(&out);
    return result;
}
