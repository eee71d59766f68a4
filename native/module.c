/* esftctl._native: the C parts of esftctl's expert stores (esftctl/huffman.py calls them; the numpy functions
 * there are the references they are tested against, bit for bit) and of consolidation's distances
 * (esftctl/consolidate.py, against its torch reference). */
#include "huffman.h"

static PyMethodDef methods[] = {
    {"encode", huffman_encode, METH_VARARGS, "Huffman-encode uint8 symbols in esftctl's chunk layout."},
    {"split_bf16", huffman_split_bf16, METH_VARARGS, "bf16 bits -> exponents, sign-and-mantissa bytes, histogram."},
    {"decode_bf16", huffman_decode_bf16, METH_VARARGS, "Decode exponents and join them into bf16 bits in place."},
    {"pair_squared_distances", pair_squared_distances, METH_VARARGS,
     "Sums of squared differences between bf16 tensors of several variants, per pair."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "esftctl._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
