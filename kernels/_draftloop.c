/* specrun.kernels._draftloop: a model drafter's greedy draft loop in C.
 *
 * chain() runs the steps of kernels/drafters/base.py's Python loop (DraftTokens over
 * Context.decode_chained / Context.decode and logits_rows) without returning to Python between two
 * llama_decode calls: after a decode has swept the caches, the interpreter's own work around each
 * call costs 30-40 us a step, a tenth of a small draft graph's (an EAGLE-3 decoder row, 0.25 ms).
 * Same tokens as the Python loop: the first index of the largest logit. Only without p_min: its
 * test needs the softmax over the vocabulary at every step, which numpy's vectorized exp computes
 * twice as fast as a scalar loop of libm's exp (0.36 vs 0.76 ms over 151,936 logits, Xeon), so
 * drafts with a p_min stay in Python.
 *
 * It calls llama.cpp through the addresses Python hands it (kernels/llama.py binds the functions
 * with ctypes), so it links against nothing, and the batch is the context's own
 * llama_batch (its seq ids already set for every row). The GIL is released for the whole loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {            /* llama.h's llama_batch (llama-cpp-python 0.3.36) */
    int32_t n_tokens;
    int32_t *token;
    float *embd;
    int32_t *pos;
    int32_t *n_seq_id;
    int32_t **seq_id;
    int8_t *logits;
} batch_t;

typedef int32_t (*decode_fn)(void *ctx, batch_t batch);
typedef float *(*row_fn)(void *ctx, int32_t i);

enum { ERR_NONE = 0, ERR_NO_HIDDEN = -1001, ERR_NO_LOGITS = -1002 };

/* Steps i = 0..n_max-1. Step i > 0 first decodes out[i-1] at position pos0 + i (with the hidden
 * row of the last decode's row `row` when nextn_ith is set: a chained MTP/EAGLE-3 step); every
 * step then drafts the argmax of the logits of batch row `row` of the last decode. Returns the
 * tokens drafted; *n_decoded = the decodes done; *err = llama_decode's code or ERR_*. */
static int32_t draft_chain(void *ctx, batch_t *b, decode_fn decode, row_fn logits_ith, row_fn nextn_ith,
                           int32_t row, int32_t pos0, int32_t n_max, int32_t n_vocab,
                           int32_t *out, int32_t *n_decoded, int32_t *err) {
    *n_decoded = 0;
    *err = ERR_NONE;
    for (int32_t i = 0; i < n_max; i++) {
        if (i > 0) {
            float *h = NULL;
            if (nextn_ith) {
                h = nextn_ith(ctx, row);
                if (!h) { *err = ERR_NO_HIDDEN; return i; }
            }
            b->n_tokens = 1;
            b->token[0] = out[i - 1];
            b->pos[0] = pos0 + i;
            b->logits[0] = 1;
            b->embd = h;
            int32_t rc = decode(ctx, *b);
            b->embd = NULL;
            if (rc != 0) { *err = rc; return i; }
            *n_decoded += 1;
            row = 0;
        }
        const float *l = logits_ith(ctx, row);
        if (!l) { *err = ERR_NO_LOGITS; return i; }
        int32_t best = 0;
        float m = l[0];
        for (int32_t j = 1; j < n_vocab; j++) {
            if (l[j] > m) { m = l[j]; best = j; }
        }
        out[i] = best;
    }
    return n_max;
}

/* chain(ctx, batch, decode, logits_ith, nextn_ith, row, pos0, n_max, n_vocab, out)
 *   -> (n_drafted, n_decoded, err); every pointer an int address (nextn_ith 0: plain tokens),
 *   out an int32 buffer of at least n_max. */
static PyObject *chain(PyObject *self, PyObject *args) {
    unsigned long long ctx, batch, decode, logits_ith, nextn_ith, out;
    int row, pos0, n_max, n_vocab;
    if (!PyArg_ParseTuple(args, "KKKKKiiiiK", &ctx, &batch, &decode, &logits_ith, &nextn_ith,
                          &row, &pos0, &n_max, &n_vocab, &out))
        return NULL;
    if (!ctx || !batch || !decode || !logits_ith || !out || n_vocab <= 0) {
        PyErr_SetString(PyExc_ValueError, "chain: a NULL address or an empty vocabulary");
        return NULL;
    }
    int32_t n, n_decoded, err;
    Py_BEGIN_ALLOW_THREADS
    n = draft_chain((void *)(uintptr_t)ctx, (batch_t *)(uintptr_t)batch, (decode_fn)(uintptr_t)decode,
                    (row_fn)(uintptr_t)logits_ith, (row_fn)(uintptr_t)nextn_ith, row, pos0, n_max, n_vocab,
                    (int32_t *)(uintptr_t)out, &n_decoded, &err);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(iii)", n, n_decoded, err);
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "A model drafter's greedy draft loop (see kernels/_draftloop.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_draftloop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__draftloop(void) { return PyModule_Create(&module); }
