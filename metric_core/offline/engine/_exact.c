/* The compiled path of exact.accumulate: the same exact integers, the same canonical digits.
 *
 * exact.py's docstring says what a state is. This file computes, for each group, its count,
 * its counts of NaN, +inf and -inf, and the exact integers S (units of 2**-1088) and Q
 * (units of 2**-2176) of its finite values, and writes them in the canonical form (sign,
 * lowest nonzero digit's position, number of digits, digits in base 2**32 lowest first).
 * That form is unique, so the arrays equal the numpy path's bit for bit whatever way each
 * path adds.
 *
 * Three passes over the rows' groups (plain C99, no compiler extensions):
 *   1. check every group id, count rows and non-finite values, and keep each group's
 *      lowest and highest biased exponent of its nonzero finite values;
 *   2. give each group a span of int64 digits from its lowest piece to its highest (the
 *      exponents fix both; one more on top for carries in groups of many rows), and add each value's pieces into its group's span:
 *      M * 2**(s mod 32) in three pieces under 2**32, M**2 (from 32-bit halves of M in
 *      uint64 products, never v * v) shifted by an even offset in five pieces under 2**32;
 *      a digit takes at most one piece a row, so fewer than 2**31 rows a group stay
 *      under 2**63 in magnitude;
 *   3. carry each group's digits (every digit but the top one into [0, 2**32)), negate
 *      the group if its top digit is negative and carry again, drop the zero digits at
 *      both ends.
 *
 * The GIL is released while the rows are added: the engine's threads accumulate at once.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MASK32 UINT64_C(0xFFFFFFFF)
#define MAX_COUNT ((int64_t)0x7FFFFFFF) /* exact.MAX_COUNT */
/* A value M * 2**(E - 1075) (E = max(biased, 1)) sits at 2**(E + SUM_SHIFT) units of the
 * sum, its square at 2**(2E + SQUARE_SHIFT) units of the squares (exact.SUM_BASE = -1088). */
#define SUM_SHIFT 13
#define SQUARE_SHIFT 26
#define SUM_PIECES 3
#define SQUARE_PIECES 5
/* A group's span is its pieces' digits and, from this many rows on, one digit on top for
 * carries. Below it the pieces' own top digit has room: a value's pieces are under 2**84
 * (M * 2**r, r < 32) in three digits, so fewer than 2**12 of them stay under 2**96; a
 * square's are under 2**136 in five, so fewer than 2**24 stay under 2**160. */
#define SUM_ROOMY ((int64_t)1 << 11)
#define SQUARE_ROOMY ((int64_t)1 << 23)

/* floor(x / 2**32) for any int64 x, without relying on >> of a negative number */
static inline int64_t carry_of(int64_t x) {
    int64_t low = (int64_t)((uint64_t)x & MASK32);
    return (x - low) / ((int64_t)1 << 32);
}

typedef struct {
    int64_t n_groups;
    const int16_t *e_low, *e_high; /* each group's exponent range (e_low > e_high: none) */
    int scale, shift, pieces; /* a value of exponent E lands at digit (scale E + shift) >> 5 */
    int64_t roomy;            /* groups of fewer rows need no digit on top for carries */
    const int64_t *count;
    int64_t *start;  /* where each group's span starts in bins; n_groups + 1 entries */
    int64_t *origin; /* where digit 0 of each group would be in bins: start - lowest digit */
    int64_t *bins;
} Spans;

static inline int64_t digit_of(const Spans *sp, int e) { return ((int64_t)sp->scale * e + sp->shift) >> 5; }

/* Lay out each group's span (start and origin must have n_groups + 1 entries); returns the
 * bins the spans take. */
static int64_t spans_layout(Spans *sp) {
    int64_t total = 0;
    for (int64_t g = 0; g < sp->n_groups; g++) {
        sp->start[g] = total;
        sp->origin[g] = total - digit_of(sp, sp->e_low[g]);
        if (sp->e_low[g] <= sp->e_high[g])
            total += digit_of(sp, sp->e_high[g]) - digit_of(sp, sp->e_low[g]) + sp->pieces +
                     (sp->count[g] >= sp->roomy);
    }
    sp->start[sp->n_groups] = total;
    return total;
}

/* Scratch memory kept between calls: a partition's call after another's would otherwise
 * take fresh pages from the system each time, and touching them costs more than the
 * adding. A few are kept (taken and given back under the GIL), each up to KEEP bytes. */
typedef struct {
    void *p;
    size_t cap;
} Buf;
typedef struct {
    Buf groups, bins;
} Scratch;
#define POOL 4
#define KEEP ((size_t)64 << 20)
static Scratch pool[POOL];
static int pooled = 0;

static Scratch scratch_take(void) {
    Scratch none = {{NULL, 0}, {NULL, 0}};
    return pooled ? pool[--pooled] : none;
}

static void buf_drop(Buf *b) {
    free(b->p);
    b->p = NULL;
    b->cap = 0;
}

static void scratch_give(Scratch s) {
    if (s.groups.cap > KEEP) buf_drop(&s.groups);
    if (s.bins.cap > KEEP) buf_drop(&s.bins);
    if (pooled < POOL) {
        pool[pooled++] = s;
        return;
    }
    buf_drop(&s.groups);
    buf_drop(&s.bins);
}

/* At least need bytes in b (its contents not kept); 0, or -1 out of memory. */
static int buf_fit(Buf *b, size_t need) {
    if (b->cap >= need && b->p) return 0;
    buf_drop(b);
    need += need / 4; /* room to grow a little before the next call takes it again */
    b->p = malloc(need > 0 ? need : 1);
    if (!b->p) return -1;
    b->cap = need;
    return 0;
}

/* Carry each group's span into canonical digits: signs, lows and sizes a group, the
 * digits packed from the front of out (which has room for every bin); returns how many
 * digits, or -1 where a top digit would pass 2**32 (the headroom argument failed). */
static int64_t spans_canonical(Spans *sp, int8_t *sign, int16_t *low, uint8_t *size, uint32_t *out) {
    int64_t written = 0;
    for (int64_t g = 0; g < sp->n_groups; g++) {
        int64_t *x = sp->bins + sp->start[g];
        int64_t k = sp->start[g + 1] - sp->start[g];
        sign[g] = 0;
        low[g] = 0;
        size[g] = 0;
        if (k == 0) continue;
        for (int64_t j = 0; j + 1 < k; j++) {
            int64_t c = carry_of(x[j]);
            x[j] -= c * ((int64_t)1 << 32);
            x[j + 1] += c;
        }
        int negative = x[k - 1] < 0;
        if (negative) {
            for (int64_t j = 0; j < k; j++) x[j] = -x[j];
            for (int64_t j = 0; j + 1 < k; j++) {
                int64_t c = carry_of(x[j]);
                x[j] -= c * ((int64_t)1 << 32);
                x[j + 1] += c;
            }
        }
        if (x[k - 1] < 0 || x[k - 1] > (int64_t)MASK32) return -1;
        int64_t first = 0, last = k - 1;
        while (first < k && x[first] == 0) first++;
        if (first == k) continue; /* an exact zero */
        while (x[last] == 0) last--;
        if (last - first + 1 > 255) return -1;
        sign[g] = negative ? -1 : 1;
        low[g] = (int16_t)(digit_of(sp, sp->e_low[g]) + first);
        size[g] = (uint8_t)(last - first + 1);
        for (int64_t j = first; j <= last; j++) out[written++] = (uint32_t)x[j];
    }
    return written;
}

typedef struct {
    Py_buffer groups, values, count, nan, pos_inf, neg_inf;
    Py_buffer s_sign, s_low, s_size, q_sign, q_low, q_size;
} Args;

static int check_length(Py_buffer *b, int64_t n, Py_ssize_t itemsize, const char *what) {
    if (b->len != (Py_ssize_t)n * itemsize) {
        PyErr_Format(PyExc_ValueError, "_exact.accumulate: %s has %zd bytes, not %lld", what, b->len,
                     (long long)n * itemsize);
        return -1;
    }
    return 0;
}

enum { OK = 0, BAD_GROUP = 1, TOO_MANY = 2, NO_MEMORY = 3 };

static PyObject *accumulate(PyObject *self, PyObject *args) {
    Args a;
    Py_ssize_t n_groups_arg;
    int squares;
    (void)self;
    memset(&a, 0, sizeof(a));
    if (!PyArg_ParseTuple(args, "y*y*npw*w*w*w*w*w*w*w*w*w*", &a.groups, &a.values, &n_groups_arg, &squares,
                          &a.count, &a.nan, &a.pos_inf, &a.neg_inf, &a.s_sign, &a.s_low, &a.s_size, &a.q_sign,
                          &a.q_low, &a.q_size))
        return NULL;
    Py_buffer *all[] = {&a.groups, &a.values, &a.count,  &a.nan,    &a.pos_inf, &a.neg_inf,
                        &a.s_sign, &a.s_low,  &a.s_size, &a.q_sign, &a.q_low,   &a.q_size};
    PyObject *result = NULL, *s_out = NULL, *q_out = NULL;
    int16_t *e_low = NULL, *e_high = NULL;
    Spans sums = {0}, sq = {0};
    Scratch scratch = scratch_take();
    int64_t n_groups = (int64_t)n_groups_arg;
    int64_t rows = (int64_t)(a.groups.len / 8);
    int64_t q_groups = squares ? n_groups : 0;
    if (a.values.len != a.groups.len || check_length(&a.count, n_groups, 8, "count") ||
        check_length(&a.nan, n_groups, 8, "nan") || check_length(&a.pos_inf, n_groups, 8, "pos_inf") ||
        check_length(&a.neg_inf, n_groups, 8, "neg_inf") || check_length(&a.s_sign, n_groups, 1, "s_sign") ||
        check_length(&a.s_low, n_groups, 2, "s_low") || check_length(&a.s_size, n_groups, 1, "s_size") ||
        check_length(&a.q_sign, q_groups, 1, "q_sign") || check_length(&a.q_low, q_groups, 2, "q_low") ||
        check_length(&a.q_size, q_groups, 1, "q_size")) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "_exact.accumulate: groups and values differ");
        goto done;
    }
    const int64_t *g = (const int64_t *)a.groups.buf;
    const uint64_t *v = (const uint64_t *)a.values.buf;
    int64_t *count = (int64_t *)a.count.buf, *nan = (int64_t *)a.nan.buf;
    int64_t *pos_inf = (int64_t *)a.pos_inf.buf, *neg_inf = (int64_t *)a.neg_inf.buf;
    /* the groups' scratch: four int64 arrays of n_groups + 1 (spans' starts and origins),
     * then e_low and e_high */
    size_t longs = 4 * (size_t)(n_groups + 1);
    if (buf_fit(&scratch.groups, longs * 8 + 4 * (size_t)n_groups)) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *longs_at = (int64_t *)scratch.groups.p;
    e_low = (int16_t *)(longs_at + longs);
    e_high = e_low + n_groups;
    int status = OK;
    int64_t n_sum = 0, n_sq = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n_groups; i++) {
        e_low[i] = 2047;
        e_high[i] = 0;
    }
    memset(count, 0, (size_t)n_groups * 8);
    memset(nan, 0, (size_t)n_groups * 8);
    memset(pos_inf, 0, (size_t)n_groups * 8);
    memset(neg_inf, 0, (size_t)n_groups * 8);
    for (int64_t i = 0; i < rows; i++) { /* pass 1 */
        int64_t gi = g[i];
        if (gi < 0 || gi >= n_groups) {
            status = BAD_GROUP;
            break;
        }
        count[gi]++;
        uint64_t bits = v[i];
        int biased = (int)((bits >> 52) & 0x7FF);
        if (biased == 0x7FF) {
            if (bits & ((UINT64_C(1) << 52) - 1)) nan[gi]++;
            else if (bits >> 63) neg_inf[gi]++;
            else pos_inf[gi]++;
            continue;
        }
        if ((bits << 1) == 0) continue; /* +-0.0 adds nothing */
        int e = biased > 0 ? biased : 1;
        if (e < e_low[gi]) e_low[gi] = (int16_t)e;
        if (e > e_high[gi]) e_high[gi] = (int16_t)e;
    }
    if (status == OK)
        for (int64_t i = 0; i < n_groups; i++)
            if (count[i] > MAX_COUNT) status = TOO_MANY;
    if (status == OK) {
        int64_t k = n_groups + 1;
        sums = (Spans){n_groups, e_low, e_high, 1, SUM_SHIFT, SUM_PIECES, SUM_ROOMY, count,
                       longs_at, longs_at + k, NULL};
        sq = (Spans){squares ? n_groups : 0, e_low, e_high, 2, SQUARE_SHIFT, SQUARE_PIECES, SQUARE_ROOMY, count,
                     longs_at + 2 * k, longs_at + 3 * k, NULL};
        int64_t s_total = spans_layout(&sums), q_total = spans_layout(&sq);
        if (buf_fit(&scratch.bins, 8 * (size_t)(s_total + q_total))) {
            status = NO_MEMORY;
        } else {
            sums.bins = (int64_t *)scratch.bins.p;
            sq.bins = sums.bins + s_total;
            memset(sums.bins, 0, 8 * (size_t)(s_total + q_total));
        }
    }
    if (status == OK) {
        int64_t *sb = sums.bins, *qb = sq.bins, *s_origin = sums.origin, *q_origin = sq.origin;
        for (int64_t i = 0; i < rows; i++) { /* pass 2 */
            uint64_t bits = v[i];
            int biased = (int)((bits >> 52) & 0x7FF);
            if (biased == 0x7FF || (bits << 1) == 0) continue;
            int64_t gi = g[i];
            int e = biased > 0 ? biased : 1;
            uint64_t m = (bits & ((UINT64_C(1) << 52) - 1)) | ((uint64_t)(biased > 0) << 52);
            int s = e + SUM_SHIFT;
            int64_t *x = sb + s_origin[gi] + (s >> 5);
            int r = s & 31;
            uint64_t low32 = (m & MASK32) << r;                   /* under 2**63 */
            uint64_t carried = (low32 >> 32) + ((m >> 32) << r); /* under 2**53 */
            int64_t p0 = (int64_t)(low32 & MASK32), p1 = (int64_t)(carried & MASK32), p2 = (int64_t)(carried >> 32);
            int64_t neg = -(int64_t)(bits >> 63); /* 0, or -1 to subtract: (p ^ -1) + 1 == -p */
            x[0] += (p0 ^ neg) - neg;
            x[1] += (p1 ^ neg) - neg;
            x[2] += (p2 ^ neg) - neg;
            if (!squares) continue;
            uint64_t lo = m & MASK32, hi = m >> 32; /* M**2 in four limbs under 2**32 */
            uint64_t ll = lo * lo;
            uint64_t t = 2 * hi * lo + (ll >> 32); /* under 2**55 */
            uint64_t u = hi * hi + (t >> 32);      /* under 2**43 */
            uint64_t l0 = ll & MASK32, l1 = t & MASK32, l2 = u & MASK32, l3 = u >> 32;
            int qs = 2 * e + SQUARE_SHIFT;
            int qr = qs & 31; /* even, at most 30: a limb shifted stays under 2**62 */
            int64_t *y = qb + q_origin[gi] + (qs >> 5);
            l0 <<= qr;
            l1 <<= qr;
            l2 <<= qr;
            l3 <<= qr;
            y[0] += (int64_t)(l0 & MASK32);
            y[1] += (int64_t)((l1 & MASK32) | (l0 >> 32));
            y[2] += (int64_t)((l2 & MASK32) | (l1 >> 32));
            y[3] += (int64_t)((l3 & MASK32) | (l2 >> 32));
            y[4] += (int64_t)(l3 >> 32);
        }
    }
    Py_END_ALLOW_THREADS
    if (status == BAD_GROUP) {
        PyErr_Format(PyExc_ValueError, "group ids must be in range(%lld)", (long long)n_groups);
        goto done;
    }
    if (status == TOO_MANY) {
        PyErr_Format(PyExc_ValueError,
                     "a group holds more than %lld rows: accumulate them in parts and merge", (long long)MAX_COUNT);
        goto done;
    }
    if (status == NO_MEMORY) {
        PyErr_NoMemory();
        goto done;
    }
    s_out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(sums.start[n_groups] * 4));
    if (!s_out) goto done;
    if (squares) {
        q_out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(sq.start[n_groups] * 4));
        if (!q_out) goto done;
    }
    Py_BEGIN_ALLOW_THREADS /* pass 3 */
    n_sum = spans_canonical(&sums, (int8_t *)a.s_sign.buf, (int16_t *)a.s_low.buf, (uint8_t *)a.s_size.buf,
                            (uint32_t *)PyByteArray_AS_STRING(s_out));
    if (squares && n_sum >= 0)
        n_sq = spans_canonical(&sq, (int8_t *)a.q_sign.buf, (int16_t *)a.q_low.buf, (uint8_t *)a.q_size.buf,
                               (uint32_t *)PyByteArray_AS_STRING(q_out));
    Py_END_ALLOW_THREADS
    if (n_sum < 0 || n_sq < 0) {
        PyErr_SetString(PyExc_AssertionError, "a digit past the top of its group: the headroom argument failed");
        goto done;
    }
    if (PyByteArray_Resize(s_out, (Py_ssize_t)(n_sum * 4))) goto done;
    if (squares && PyByteArray_Resize(q_out, (Py_ssize_t)(n_sq * 4))) goto done;
    result = Py_BuildValue("(OO)", s_out, squares ? q_out : Py_None);
done:
    Py_XDECREF(s_out);
    Py_XDECREF(q_out);
    scratch_give(scratch);
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (all[i]->obj) PyBuffer_Release(all[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"accumulate", accumulate, METH_VARARGS,
     "accumulate(groups, values, n_groups, squares, count, nan, pos_inf, neg_inf, s_sign, s_low, s_size, "
     "q_sign, q_low, q_size) -> (sum digits, square digits or None): fills the per-group arrays, "
     "returns the digits as bytearrays of uint32 (exact.accumulate calls it)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_exact", "The compiled path of metric_core.offline.engine.exact.accumulate.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__exact(void) { return PyModule_Create(&module); }
