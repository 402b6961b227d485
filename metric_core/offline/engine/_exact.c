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
 *
 * Two more functions do in C what exact.py does in numpy, with the same results bit for
 * bit (the form of a state is unique, and a correctly rounded float is unique):
 *   add_digits: states' integers added into groups (exact.combine): a group that one part
 *     reaches, in canonical form, is copied as it is; any other, a span of int64 digits
 *     from the lowest to the highest digit reaching it, one more on top, the signed digits
 *     added, carried into the canonical form as above.
 *   finish: each group's sum, mean or std rounded to float64 once (ExactState.sum, mean,
 *     std): a 64-bit window from the leading one and a sticky bit for everything below,
 *     rounded to nearest even in integers (subnormals at 2**-1074, past the range inf).
 *     The mean divides the top digits by the count (under 2**31) digit by digit; the std
 *     forms D = n Q - S**2 exactly in int64 columns of 32-bit pieces, takes D's top bits
 *     (a sticky bit for the rest) shifted by an even amount so that floor(T / n**2) is
 *     about 2**125, and its integer square root (a double's estimate, one Newton step in
 *     integers, then settled by comparing squares): the root and whether it was exact
 *     round as the std does (round to odd with ten bits to spare).
 *
 * And order_stats: the order statistics a median or pNN needs of each group (finish.group_values):
 * the values grouped by hashing (bucket, combo), side by side a group, and each group's one
 * or two ranks found by selection (Wirth's), not by a sort.
 *
 * And a type, Table (engine.grouptable): groups (bucket, combo) in an open-addressing hash
 * table, the combos of a bucket side by side, each group with its counts, min and max and
 * its S and Q as int64 digits in a window of an arena that grows to take each value's
 * pieces (the same pieces as accumulate's); records are added across calls, a group's
 * digits carried every 2**30 of its rows, and drain writes the groups below a bucket in
 * the canonical form, in the order of bucket then combo, and takes them out.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
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

/* A finite nonzero value's significand M (biased: its biased exponent, not 0x7FF) */
static inline uint64_t significand_of(uint64_t bits, int biased) {
    return (bits & ((UINT64_C(1) << 52) - 1)) | ((uint64_t)(biased > 0) << 52);
}

/* A finite nonzero value's pieces of the sum (its bits, M, E = max(biased, 1)): p[0..2],
 * signed, at digits d, d + 1, d + 2 of the sum; returns d. M * 2**(s mod 32) is three
 * pieces under 2**32 (s = E + SUM_SHIFT). */
static inline int64_t sum_pieces(uint64_t bits, uint64_t m, int e, int64_t *p) {
    int s = e + SUM_SHIFT;
    int r = s & 31;
    uint64_t low32 = (m & MASK32) << r;                   /* under 2**63 */
    uint64_t carried = (low32 >> 32) + ((m >> 32) << r); /* under 2**53 */
    int64_t p0 = (int64_t)(low32 & MASK32), p1 = (int64_t)(carried & MASK32), p2 = (int64_t)(carried >> 32);
    int64_t neg = -(int64_t)(bits >> 63); /* 0, or -1 to subtract: (p ^ -1) + 1 == -p */
    p[0] = (p0 ^ neg) - neg;
    p[1] = (p1 ^ neg) - neg;
    p[2] = (p2 ^ neg) - neg;
    return s >> 5;
}

/* Its square's pieces p[0..4] (under 2**32) at digits d .. d + 4 of the squares; returns
 * d. M**2 in four limbs from 32-bit halves of M (never v * v), shifted by the square's
 * even offset. */
static inline int64_t square_pieces(uint64_t m, int e, int64_t *p) {
    uint64_t lo = m & MASK32, hi = m >> 32; /* M**2 in four limbs under 2**32 */
    uint64_t ll = lo * lo;
    uint64_t t = 2 * hi * lo + (ll >> 32); /* under 2**55 */
    uint64_t u = hi * hi + (t >> 32);      /* under 2**43 */
    uint64_t l0 = ll & MASK32, l1 = t & MASK32, l2 = u & MASK32, l3 = u >> 32;
    int qs = 2 * e + SQUARE_SHIFT;
    int qr = qs & 31; /* even, at most 30: a limb shifted stays under 2**62 */
    l0 <<= qr;
    l1 <<= qr;
    l2 <<= qr;
    l3 <<= qr;
    p[0] = (int64_t)(l0 & MASK32);
    p[1] = (int64_t)((l1 & MASK32) | (l0 >> 32));
    p[2] = (int64_t)((l2 & MASK32) | (l1 >> 32));
    p[3] = (int64_t)((l3 & MASK32) | (l2 >> 32));
    p[4] = (int64_t)(l3 >> 32);
    return qs >> 5;
}

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

/* Carry one group's k int64 digits x (digit 0 at position low; the top one has room for
 * what reaches it) into its canonical form: its sign, lowest position and size, its
 * digits written at out; returns how many, or -1 where a top digit would pass 2**32 (the
 * headroom argument failed) or the form cannot hold it (more than 255 digits, a position
 * past int16). */
static int64_t canonical_one(int64_t *x, int64_t k, int64_t low, int8_t *sign, int16_t *low_out, uint8_t *size,
                             uint32_t *out) {
    *sign = 0;
    *low_out = 0;
    *size = 0;
    if (k == 0) return 0;
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
    if (first == k) return 0; /* an exact zero */
    while (x[last] == 0) last--;
    if (last - first + 1 > 255 || low + first < INT16_MIN || low + first > INT16_MAX) return -1;
    *sign = negative ? -1 : 1;
    *low_out = (int16_t)(low + first);
    *size = (uint8_t)(last - first + 1);
    for (int64_t j = first; j <= last; j++) *out++ = (uint32_t)x[j];
    return last - first + 1;
}

/* Carry each group's span into canonical digits: signs, lows and sizes a group, the
 * digits packed from the front of out (which has room for every bin); returns how many
 * digits, or -1 (canonical_one). */
static int64_t spans_canonical(Spans *sp, int8_t *sign, int16_t *low, uint8_t *size, uint32_t *out) {
    int64_t written = 0;
    for (int64_t g = 0; g < sp->n_groups; g++) {
        int64_t k = sp->start[g + 1] - sp->start[g];
        int64_t got = canonical_one(sp->bins + sp->start[g], k, k ? digit_of(sp, sp->e_low[g]) : 0, sign + g,
                                    low + g, size + g, out + written);
        if (got < 0) return -1;
        written += got;
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
            uint64_t m = significand_of(bits, biased);
            int64_t p[SQUARE_PIECES];
            int64_t *x = sb + s_origin[gi] + sum_pieces(bits, m, e, p);
            x[0] += p[0];
            x[1] += p[1];
            x[2] += p[2];
            if (!squares) continue;
            int64_t *y = qb + q_origin[gi] + square_pieces(m, e, p);
            for (int j = 0; j < SQUARE_PIECES; j++) y[j] += p[j];
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

/* ---- add_digits: states' integers added into groups (exact.combine) ------------------ */

enum { NONE = 0, ONE_UP = 1, ONE_DOWN = 2, SEVERAL = 3 }; /* the parts that reach a group */

static PyObject *add_digits(PyObject *self, PyObject *args) {
    Py_buffer sign_b, low_b, size_b, digits_b, target_b, out_sign_b, out_low_b, out_size_b;
    Py_ssize_t n_groups_arg;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*nw*w*w*", &sign_b, &low_b, &size_b, &digits_b, &target_b, &n_groups_arg,
                          &out_sign_b, &out_low_b, &out_size_b))
        return NULL;
    Py_buffer *all[] = {&sign_b, &low_b, &size_b, &digits_b, &target_b, &out_sign_b, &out_low_b, &out_size_b};
    PyObject *result = NULL, *out = NULL;
    int64_t *lo = NULL, *bins = NULL;
    uint8_t *reached = NULL;
    int64_t n_groups = (int64_t)n_groups_arg, m = (int64_t)sign_b.len;
    const int8_t *sign = (const int8_t *)sign_b.buf;
    const int16_t *low = (const int16_t *)low_b.buf;
    const uint8_t *size = (const uint8_t *)size_b.buf;
    const uint32_t *digits = (const uint32_t *)digits_b.buf;
    const int64_t *target = (const int64_t *)target_b.buf;
    if (check_length(&low_b, m, 2, "low") || check_length(&size_b, m, 1, "size") ||
        check_length(&target_b, m, 8, "target") || check_length(&out_sign_b, n_groups, 1, "out sign") ||
        check_length(&out_low_b, n_groups, 2, "out low") || check_length(&out_size_b, n_groups, 1, "out size"))
        goto done;
    int64_t held = 0;
    for (int64_t i = 0; i < m; i++) held += size[i];
    if (digits_b.len != (Py_ssize_t)held * 4) {
        PyErr_Format(PyExc_ValueError, "_exact.add_digits: %zd bytes of digits for sizes adding to %lld",
                     digits_b.len, (long long)held);
        goto done;
    }
    /* each group's lowest and highest position reached; whom it is reached by (REACHED):
     * none, one part (copied as it is, where that part is canonical: the general path's
     * result, without its bins), or several (added in bins, then carried); its start: the
     * one part's digits, or its bins' */
    lo = (int64_t *)malloc(sizeof(int64_t) * (3 * (size_t)n_groups + 1));
    reached = (uint8_t *)calloc((size_t)n_groups + 1, 1);
    if (!lo || !reached) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *hi = lo + n_groups, *start = hi + n_groups;
    int status = OK;
    int64_t total = 0, copied = 0, written = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t g = 0; g < n_groups; g++) {
        lo[g] = INT64_MAX;
        hi[g] = INT64_MIN;
    }
    int64_t at = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t t = target[i];
        if (t < 0 || t >= n_groups) {
            status = BAD_GROUP;
            break;
        }
        at += size[i];
        if (!size[i] || !sign[i]) continue;
        if (reached[t] == NONE) {
            reached[t] = sign[i] > 0 ? ONE_UP : ONE_DOWN;
            start[t] = at - size[i];
        } else {
            reached[t] = SEVERAL;
        }
        if (low[i] < lo[t]) lo[t] = low[i];
        if (low[i] + size[i] - 1 > hi[t]) hi[t] = low[i] + size[i] - 1;
    }
    if (status == OK) {
        for (int64_t g = 0; g < n_groups; g++) {
            if (reached[g] == NONE) continue;
            if (reached[g] != SEVERAL) {
                const uint32_t *d = digits + start[g];
                int64_t k = hi[g] - lo[g] + 1;
                if (d[0] && d[k - 1]) {
                    copied += k;
                    continue;
                }
                reached[g] = SEVERAL; /* not canonical: carried as the sum of several is */
            }
            start[g] = total;
            total += hi[g] - lo[g] + 2; /* one digit on top for carries */
        }
        bins = (int64_t *)calloc((size_t)total + 1, sizeof(int64_t));
        if (!bins) status = NO_MEMORY;
    }
    if (status == OK) {
        at = 0;
        for (int64_t i = 0; i < m; i++) {
            int64_t k = size[i];
            if (!k) continue;
            int64_t t = target[i];
            if (sign[i] && reached[t] == SEVERAL) {
                int64_t *x = bins + start[t] + (low[i] - lo[t]);
                const uint32_t *d = digits + at;
                if (sign[i] > 0)
                    for (int64_t j = 0; j < k; j++) x[j] += d[j];
                else
                    for (int64_t j = 0; j < k; j++) x[j] -= d[j];
            }
            at += k;
        }
    }
    Py_END_ALLOW_THREADS
    if (status == BAD_GROUP) {
        PyErr_Format(PyExc_ValueError, "mappings must be in range(%lld)", (long long)n_groups);
        goto done;
    }
    if (status == NO_MEMORY) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)((total + copied) * 4));
    if (!out) goto done;
    Py_BEGIN_ALLOW_THREADS
    uint32_t *o = (uint32_t *)PyByteArray_AS_STRING(out);
    int8_t *out_sign = (int8_t *)out_sign_b.buf;
    int16_t *out_low = (int16_t *)out_low_b.buf;
    uint8_t *out_size = (uint8_t *)out_size_b.buf;
    for (int64_t g = 0; g < n_groups; g++) {
        if (reached[g] == NONE) {
            out_sign[g] = 0;
            out_low[g] = 0;
            out_size[g] = 0;
            continue;
        }
        int64_t k = hi[g] - lo[g] + 1;
        if (reached[g] != SEVERAL) {
            out_sign[g] = reached[g] == ONE_UP ? 1 : -1;
            out_low[g] = (int16_t)lo[g];
            out_size[g] = (uint8_t)k;
            memcpy(o + written, digits + start[g], sizeof(uint32_t) * (size_t)k);
            written += k;
            continue;
        }
        int64_t got = canonical_one(bins + start[g], k + 1, lo[g], out_sign + g, out_low + g, out_size + g,
                                    o + written);
        if (got < 0) {
            written = -1;
            break;
        }
        written += got;
    }
    Py_END_ALLOW_THREADS
    if (written < 0) {
        PyErr_SetString(PyExc_AssertionError, "digits past the representation's bounds");
        goto done;
    }
    if (PyByteArray_Resize(out, (Py_ssize_t)(written * 4))) goto done;
    result = out;
    out = NULL;
done:
    Py_XDECREF(out);
    free(lo);
    free(bins);
    free(reached);
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (all[i]->obj) PyBuffer_Release(all[i]);
    return result;
}

/* ---- finish: a group's exact integers rounded to float64 once ----------------------- */

#define SUM_BASE (-1088)    /* exact.SUM_BASE */
#define SQUARE_BASE (-2176) /* exact.SQUARE_BASE */
#define FRACTION_BITS ((UINT64_C(1) << 52) - 1)

static inline int clz32(uint32_t x) { /* x > 0 */
    int n = 0;
    if (x <= 0x0000FFFFu) n += 16, x <<= 16;
    if (x <= 0x00FFFFFFu) n += 8, x <<= 8;
    if (x <= 0x0FFFFFFFu) n += 4, x <<= 4;
    if (x <= 0x3FFFFFFFu) n += 2, x <<= 2;
    if (x <= 0x7FFFFFFFu) n += 1;
    return n;
}

static inline int bit_length64(uint64_t x) {
    return x >> 32 ? 64 - clz32((uint32_t)(x >> 32)) : x ? 32 - clz32((uint32_t)x) : 0;
}

/* The float64 nearest (w + f) 2**e, w's bit 63 set, 0 <= f < 1 and f > 0 exactly where
 * sticky; ties to even; a subnormal rounded once, at 2**-1074; past the range inf. */
static double round_bits(uint64_t w, int64_t e, int sticky, int negative) {
    int64_t top = e + 63; /* the leading bit's weight */
    int64_t kept = top >= -1022 ? 53 : top + 1075;
    uint64_t bits = 0;
    if (kept >= 0) {
        int drop = (int)(64 - kept); /* 11 .. 64 */
        uint64_t q, rem, half;
        if (drop == 64) {
            q = 0;
            rem = w;
            half = UINT64_C(1) << 63;
        } else {
            q = w >> drop;
            rem = w & ((UINT64_C(1) << drop) - 1);
            half = UINT64_C(1) << (drop - 1);
        }
        if (rem > half || (rem == half && (sticky || (q & 1)))) q++;
        if (kept == 53) { /* q in [2**52, 2**53] */
            if (q >> 53) {
                q >>= 1;
                top++;
            }
            bits = top > 1023 ? UINT64_C(0x7FF) << 52 : ((uint64_t)(top + 1023) << 52) | (q & FRACTION_BITS);
        } else {
            bits = q; /* q 2**-1074, at most 2**52: the least normal */
        }
    }
    bits |= (uint64_t)(negative != 0) << 63;
    double out;
    memcpy(&out, &bits, sizeof(out));
    return out;
}

/* The float64 nearest (a2 2**64 + a1 2**32 + a0 + f) 2**e0 (digits under 2**32, a2 > 0,
 * 0 <= f < 1, f > 0 exactly where sticky). */
static double round_window(uint64_t a2, uint64_t a1, uint64_t a0, int sticky, int64_t e0, int negative) {
    int z = clz32((uint32_t)a2);
    uint64_t high = (a2 << 32) | a1;
    uint64_t w = z ? (high << z) | (a0 >> (32 - z)) : high;
    sticky |= ((a0 << z) & MASK32) != 0;
    return round_bits(w, e0 + 32 - z, sticky, negative);
}

static double sum_one(const uint32_t *d, int64_t k, int64_t low, int negative) {
    uint64_t a2 = d[k - 1], a1 = k > 1 ? d[k - 2] : 0, a0 = k > 2 ? d[k - 3] : 0;
    return round_window(a2, a1, a0, k > 3, 32 * (low + k - 3) + SUM_BASE, negative);
}

static double mean_one(const uint32_t *d, int64_t k, int64_t low, uint64_t n, int negative) {
    uint64_t r = 0, q[3];
    int got = 0;
    int64_t i = k - 1;
    while (got < 3) { /* quotient digits from the top, until three from the first nonzero one */
        uint64_t x = (r << 32) | (i >= 0 ? d[i] : 0);
        uint64_t qd = x / n;
        r = x - qd * n;
        if (got || qd) q[got++] = qd;
        i--;
    }
    /* q[2] came from digit i + 1; any digit left (the lowest is nonzero) or remainder is below */
    return round_window(q[0], q[1], q[2], r != 0 || i >= 0, 32 * (low + i + 1) + SUM_BASE, negative);
}

/* 32 bits of the non-negative integer sum of x[c] 2**(32 c) (x[c] in [0, 2**32), c <
 * width) from bit pos up (pos may be negative: zeros below bit 0). */
static inline uint64_t bits32(const int64_t *x, int64_t width, int64_t pos) {
    int64_t c = pos >= 0 ? pos / 32 : -((-pos + 31) / 32);
    int r = (int)(pos - 32 * c);
    uint64_t lowpart = c >= 0 && c < width ? (uint64_t)x[c] : 0;
    uint64_t highpart = c + 1 >= 0 && c + 1 < width ? (uint64_t)x[c + 1] : 0;
    return ((lowpart >> r) | (r ? highpart << (32 - r) : 0)) & MASK32;
}

/* (hi, lo) = a * b, 128 bits */
static inline void mul64(uint64_t a, uint64_t b, uint64_t *hi, uint64_t *lo) {
    uint64_t a0 = a & MASK32, a1 = a >> 32, b0 = b & MASK32, b1 = b >> 32;
    uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
    uint64_t mid = (p00 >> 32) + (p01 & MASK32) + (p10 & MASK32);
    *lo = (mid << 32) | (p00 & MASK32);
    *hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}

/* whether r**2 > (hi, lo) */
static inline int square_above(uint64_t r, uint64_t hi, uint64_t lo) {
    uint64_t sh, sl;
    mul64(r, r, &sh, &sl);
    return sh > hi || (sh == hi && sl > lo);
}

/* floor(sqrt(hi 2**64 + lo)) for a value in [2**124, 2**127): in [2**62, 2**64) */
static uint64_t isqrt128(uint64_t hi, uint64_t lo) {
    double v = (double)hi * 18446744073709551616.0 + (double)lo;
    double root = sqrt(v);
    uint64_t r = root >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)root;
    /* one Newton step from the estimate (within about 2**11 of the root), in integers
     * for the residual and a double for its quotient, then settled by squares */
    uint64_t sh, sl;
    mul64(r, r, &sh, &sl);
    double residual; /* (hi, lo) - r**2 */
    if (sh > hi || (sh == hi && sl > lo)) {
        uint64_t dl = sl - lo, dh = sh - hi - (sl < lo);
        residual = -((double)dh * 18446744073709551616.0 + (double)dl);
    } else {
        uint64_t dl = lo - sl, dh = hi - sh - (lo < sl);
        residual = (double)dh * 18446744073709551616.0 + (double)dl;
    }
    double step = residual / (2.0 * (double)r);
    if (step > 4096.0) step = 4096.0;
    if (step < -4096.0) step = -4096.0;
    r = (uint64_t)((int64_t)r + (int64_t)step); /* truncated: the squares settle it */
    while (square_above(r, hi, lo)) r--;
    while (r < UINT64_MAX && !square_above(r + 1, hi, lo)) r++;
    return r;
}

/* sqrt(n Q - S**2) / n (scaled by the units) correctly rounded, into *out; -1 where the
 * variance is negative (x: scratch of at least the columns _std_width says). */
static int std_one(const uint32_t *s, int64_t ks, int64_t ls, const uint32_t *q, int64_t kq, int64_t lq, uint64_t n,
                   int64_t *x, int64_t width, int64_t base, double *out) {
    memset(x, 0, sizeof(int64_t) * (size_t)width);
    for (int64_t j = 0; j < kq; j++) { /* n Q: digits under 2**32 times n under 2**31 */
        uint64_t p = (uint64_t)q[j] * n;
        x[lq - base + j] += (int64_t)(p & MASK32);
        x[lq - base + j + 1] += (int64_t)(p >> 32);
    }
    for (int64_t i = 0; i < ks; i++) /* S**2, from 64-bit products of digits */
        for (int64_t j = i; j < ks; j++) {
            uint64_t p = (uint64_t)s[i] * s[j];
            int64_t times = i == j ? 1 : 2, c = 2 * ls - base + i + j;
            x[c] -= times * (int64_t)(p & MASK32);
            x[c + 1] -= times * (int64_t)(p >> 32);
        }
    for (int64_t c = 0; c + 1 < width; c++) {
        int64_t carry = carry_of(x[c]);
        x[c] -= carry * ((int64_t)1 << 32);
        x[c + 1] += carry;
    }
    if (x[width - 1] < 0 || x[width - 1] > (int64_t)MASK32) return -1;
    int64_t top = width - 1;
    while (top >= 0 && x[top] == 0) top--;
    if (top < 0) {
        *out = 0.0;
        return 0;
    }
    int64_t bits = 32 * top + 32 - clz32((uint32_t)x[top]); /* D's bit length */
    int nb = bit_length64(n * n);
    int64_t shift = nb + 125 - bits; /* T = D 2**shift of nb + 125 or nb + 126 bits */
    shift += shift & 1;
    /* T's digits, and whether D has bits below them */
    uint64_t t[6];
    for (int j = 0; j < 6; j++) t[j] = bits32(x, width, 32 * j - shift);
    int sticky = 0;
    if (shift < 0) {
        int64_t below = -shift; /* bits of D under T */
        int64_t c = below / 32;
        for (int64_t j = 0; j < c && j < width && !sticky; j++) sticky = x[j] != 0;
        if (!sticky && c < width && (below & 31)) sticky = ((uint64_t)x[c] & ((UINT64_C(1) << (below & 31)) - 1)) != 0;
    }
    uint64_t rem = 0;
    for (int pass = 0; pass < 2; pass++) { /* floor(floor(T / n) / n) = floor(T / n**2) */
        uint64_t r = 0;
        for (int j = 5; j >= 0; j--) {
            uint64_t v = (r << 32) | t[j];
            t[j] = v / n;
            r = v - t[j] * n;
        }
        rem |= r;
    }
    uint64_t qh = (t[3] << 32) | t[2], ql = (t[1] << 32) | t[0];
    uint64_t root = isqrt128(qh, ql);
    uint64_t sh, sl;
    mul64(root, root, &sh, &sl);
    int inexact = sticky || rem != 0 || sh != qh || sl != ql;
    /* std = (root + f) 2**e, e = (32 base + SQUARE_BASE - shift) / 2 */
    int64_t e = (32 * base + SQUARE_BASE - shift) / 2;
    if (!(root >> 63)) {
        root <<= 1;
        e -= 1;
    }
    *out = round_bits(root, e, inexact, 0);
    return 0;
}

/* finish(kind, s_sign, s_low, s_size, s_digits, count, limit, q_sign, q_low, q_size,
 * q_digits, out): kind 0 sum, 1 mean, 2 std of each group into out; only for groups of
 * count 1 or more (the others are left as they are: a caller finishing some groups gives
 * the others a count of 0), mean and std only for groups of count up to limit, std only
 * for groups whose squares are nonzero. */
static PyObject *finish(PyObject *self, PyObject *args) {
    Py_buffer sb[4], qb[4], count_b, out_b;
    int kind;
    long long limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*y*y*y*Ly*y*y*y*w*", &kind, &sb[0], &sb[1], &sb[2], &sb[3], &count_b, &limit,
                          &qb[0], &qb[1], &qb[2], &qb[3], &out_b))
        return NULL;
    Py_buffer *all[] = {&sb[0], &sb[1], &sb[2], &sb[3], &qb[0], &qb[1], &qb[2], &qb[3], &count_b, &out_b};
    PyObject *result = NULL;
    int64_t n_groups = (int64_t)sb[0].len;
    int64_t q_groups = kind == 2 ? n_groups : 0;
    int64_t *x = NULL;
    if (kind < 0 || kind > 2) {
        PyErr_SetString(PyExc_ValueError, "_exact.finish: kind is 0 (sum), 1 (mean) or 2 (std)");
        goto done;
    }
    if (limit > MAX_COUNT) limit = MAX_COUNT;
    if (check_length(&sb[1], n_groups, 2, "low") || check_length(&sb[2], n_groups, 1, "size") ||
        check_length(&count_b, n_groups, 8, "count") || check_length(&out_b, n_groups, 8, "out") ||
        check_length(&qb[0], q_groups, 1, "squares' sign") || check_length(&qb[1], q_groups, 2, "squares' low") ||
        check_length(&qb[2], q_groups, 1, "squares' size"))
        goto done;
    const int8_t *sign = (const int8_t *)sb[0].buf, *q_sign = (const int8_t *)qb[0].buf;
    const int16_t *low = (const int16_t *)sb[1].buf, *q_low = (const int16_t *)qb[1].buf;
    const uint8_t *size = (const uint8_t *)sb[2].buf, *q_size = (const uint8_t *)qb[2].buf;
    const uint32_t *digits = (const uint32_t *)sb[3].buf, *q_digits = (const uint32_t *)qb[3].buf;
    const int64_t *count = (const int64_t *)count_b.buf;
    double *out = (double *)out_b.buf;
    int64_t s_held = 0, q_held = 0;
    for (int64_t g = 0; g < n_groups; g++) s_held += size[g];
    for (int64_t g = 0; g < q_groups; g++) q_held += q_size[g];
    if (sb[3].len != (Py_ssize_t)s_held * 4 || qb[3].len != (Py_ssize_t)q_held * 4) {
        PyErr_SetString(PyExc_ValueError, "_exact.finish: the digits are not what the sizes add to");
        goto done;
    }
    (void)q_sign;
    int64_t cap = 1024;
    x = (int64_t *)malloc(sizeof(int64_t) * (size_t)cap);
    if (!x) {
        PyErr_NoMemory();
        goto done;
    }
    int status = OK;
    Py_BEGIN_ALLOW_THREADS
    int64_t at = 0, q_at = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        int64_t k = size[g], kq = q_groups ? q_size[g] : 0;
        const uint32_t *d = digits + at, *qd = q_digits + q_at;
        at += k;
        q_at += kq;
        if (count[g] < 1) continue;
        if (kind == 0) {
            out[g] = k ? sum_one(d, k, low[g], sign[g] < 0) : 0.0;
            continue;
        }
        if (count[g] > limit) continue;
        uint64_t n = (uint64_t)count[g];
        if (kind == 1) {
            if (k) out[g] = mean_one(d, k, low[g], n, sign[g] < 0);
            continue;
        }
        if (!kq) continue; /* no squares: all zeros (or none kept), std 0.0 as left */
        int64_t ls = low[g], lq = q_low[g];
        int64_t base = k ? (2 * ls < lq ? 2 * ls : lq) : lq;
        int64_t width = lq - base + kq + 1;
        if (k && 2 * (ls + k) - base > width) width = 2 * (ls + k) - base;
        width += 1; /* room for the carries */
        if (width > cap) {
            int64_t *bigger = (int64_t *)realloc(x, sizeof(int64_t) * (size_t)width);
            if (!bigger) {
                status = NO_MEMORY;
                break;
            }
            x = bigger;
            cap = width;
        }
        if (std_one(d, k, ls, qd, kq, lq, n, x, width, base, out + g)) {
            status = TOO_MANY; /* a negative variance */
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (status == NO_MEMORY) {
        PyErr_NoMemory();
        goto done;
    }
    if (status == TOO_MANY) {
        PyErr_SetString(PyExc_AssertionError, "a negative variance, or past its columns");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(x);
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (all[i]->obj) PyBuffer_Release(all[i]);
    return result;
}

/* ---- Table: records added straight into their groups, across calls ------------------ */

/* A group of a Table: its bucket and combo (what identifies it), its counts, min and max
 * (as partials.fold keeps them), and its exact integers S and Q as int64 digits in windows
 * of the arena: digit j of a window weighs 2**(32 (lo + j)) units, unnormalised (each
 * digit takes at most one piece under 2**32 a row, so fewer than 2**31 rows since the last
 * carry stay under 2**63). at < 0: no window yet (nothing nonzero added). */
typedef struct {
    int64_t bucket, combo, n, nan, pos_inf, neg_inf, since;
    double min, max;
    int64_t s_at, q_at;
    int32_t s_lo, q_lo, s_len, q_len;
} Group;

typedef struct {
    PyObject_HEAD
    Group *groups;
    int64_t used, room;
    int32_t *index; /* open addressing on (bucket, combo): a group's number + 1, 0 empty */
    int64_t mask;
    int64_t *arena;
    int64_t arena_used, arena_room;
    int64_t lowest; /* no group's bucket is below it */
    int squares;    /* some group kept squares */
} Table;

#define WINDOW_SLACK 1 /* digits a window gets beyond its first value's, each side */
#define CARRY_EVERY ((int64_t)1 << 30) /* rows of a group between carries of its digits */

static inline uint64_t mix64(uint64_t x) { /* splitmix64's finaliser */
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}

/* Where a group's search in the index starts: a hash of both (the combos of a bucket side
 * by side made long runs of taken places, and long searches where two runs met). */
static inline int64_t slot_of(int64_t bucket, int64_t combo, int64_t mask) {
    return (int64_t)(mix64((uint64_t)bucket ^ ((uint64_t)combo * UINT64_C(0x9E3779B97F4A7C15))) & (uint64_t)mask);
}

static int table_reindex(Table *t, int64_t slots) {
    int32_t *index = (int32_t *)calloc((size_t)slots, sizeof(int32_t));
    if (!index) return -1;
    free(t->index);
    t->index = index;
    t->mask = slots - 1;
    for (int64_t g = 0; g < t->used; g++) {
        int64_t at = slot_of(t->groups[g].bucket, t->groups[g].combo, t->mask);
        while (index[at]) at = (at + 1) & t->mask;
        index[at] = (int32_t)(g + 1);
    }
    return 0;
}

/* The group of (bucket, combo), made where there is none; NULL out of memory. */
static Group *table_group(Table *t, int64_t bucket, int64_t combo) {
    int64_t at = slot_of(bucket, combo, t->mask);
    for (;;) {
        int32_t g = t->index[at];
        if (!g) break;
        Group *x = t->groups + (g - 1);
        if (x->bucket == bucket && x->combo == combo) return x;
        at = (at + 1) & t->mask;
    }
    if (t->used >= INT32_MAX - 1) return NULL;
    if (t->used == t->room) {
        int64_t room = t->room ? 2 * t->room : 1024;
        Group *more = (Group *)realloc(t->groups, sizeof(Group) * (size_t)room);
        if (!more) return NULL;
        t->groups = more;
        t->room = room;
    }
    if (2 * (t->used + 1) > t->mask + 1) { /* at most half full */
        if (table_reindex(t, 2 * (t->mask + 1))) return NULL;
        at = slot_of(bucket, combo, t->mask);
        while (t->index[at]) at = (at + 1) & t->mask;
    }
    if (bucket < t->lowest) t->lowest = bucket;
    Group *x = t->groups + t->used;
    *x = (Group){bucket, combo, 0, 0, 0, 0, 0, INFINITY, -INFINITY, -1, -1, 0, 0, 0, 0};
    t->index[at] = (int32_t)(++t->used);
    return x;
}

/* A window (*at, *lo, *len) that holds digits first .. last, grown (copied to new arena
 * room, its digits kept) where it does not; 0, or -1 out of memory. */
static int window_cover(Table *t, int64_t *at, int32_t *lo, int32_t *len, int64_t first, int64_t last) {
    if (*at >= 0 && first >= *lo && last < (int64_t)*lo + *len) return 0;
    int64_t new_lo = first - WINDOW_SLACK, new_hi = last + WINDOW_SLACK;
    if (*at >= 0) {
        if (*lo < new_lo) new_lo = *lo;
        if ((int64_t)*lo + *len - 1 > new_hi) new_hi = (int64_t)*lo + *len - 1;
    }
    int64_t k = new_hi - new_lo + 1;
    if (t->arena_used + k > t->arena_room) {
        int64_t room = t->arena_room ? 2 * t->arena_room : 4096;
        while (room < t->arena_used + k) room *= 2;
        int64_t *more = (int64_t *)realloc(t->arena, sizeof(int64_t) * (size_t)room);
        if (!more) return -1;
        t->arena = more;
        t->arena_room = room;
    }
    int64_t *x = t->arena + t->arena_used;
    memset(x, 0, sizeof(int64_t) * (size_t)k);
    if (*at >= 0) memcpy(x + (*lo - new_lo), t->arena + *at, sizeof(int64_t) * (size_t)*len);
    *at = t->arena_used;
    *lo = (int32_t)new_lo;
    *len = (int32_t)k;
    t->arena_used += k;
    return 0;
}

/* Carry a window's digits (each but the top into [0, 2**32)), with two digits on top for
 * what reaches them; 0, or -1 out of memory. The integer is the same. */
static int window_carry(Table *t, int64_t *at, int32_t *lo, int32_t *len) {
    if (*at < 0) return 0;
    if (window_cover(t, at, lo, len, *lo, (int64_t)*lo + *len + 1)) return -1;
    int64_t *x = t->arena + *at;
    for (int32_t j = 0; j + 1 < *len; j++) {
        int64_t c = carry_of(x[j]);
        x[j] -= c * ((int64_t)1 << 32);
        x[j + 1] += c;
    }
    return 0;
}

static void table_dealloc(Table *t) {
    free(t->groups);
    free(t->index);
    free(t->arena);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    Table *t = (Table *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    t->lowest = INT64_MAX;
    if (table_reindex(t, 1024)) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

/* What a group keeps of a label's records (add's ``squares``, one a label): its count,
 * min, max and exact sum; with its sum of squares too; or its count alone */
enum { KEEP_SUMS = 0, KEEP_SQUARES = 1, KEEP_COUNT = 2 };

/* add(bucket, label, values, combo_of, squares): each row's value into its group
 * (bucket[i], combo_of[label[i]]), made where there is none, as squares[label[i]] (uint8,
 * a KEEP_ value) says. A label out of combo_of's range is a ValueError, and nothing is
 * added. */
static PyObject *table_add(Table *t, PyObject *args) {
    Py_buffer bucket_b, label_b, values_b, combo_b, squares_b;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*", &bucket_b, &label_b, &values_b, &combo_b, &squares_b)) return NULL;
    Py_buffer *all[] = {&bucket_b, &label_b, &values_b, &combo_b, &squares_b};
    PyObject *result = NULL;
    int64_t rows = (int64_t)(values_b.len / 8), labels = (int64_t)(combo_b.len / 8);
    if (check_length(&bucket_b, rows, 8, "bucket") || check_length(&label_b, rows, 8, "label") ||
        check_length(&squares_b, labels, 1, "squares"))
        goto done;
    const int64_t *bucket = (const int64_t *)bucket_b.buf, *label = (const int64_t *)label_b.buf;
    const int64_t *combo_of = (const int64_t *)combo_b.buf;
    const uint64_t *v = (const uint64_t *)values_b.buf;
    const uint8_t *sq_of = (const uint8_t *)squares_b.buf;
    for (int64_t i = 0; i < rows; i++)
        if (label[i] < 0 || label[i] >= labels) {
            PyErr_Format(PyExc_ValueError, "label %lld of row %lld is not one of the %lld given", (long long)label[i],
                         (long long)i, (long long)labels);
            goto done;
        }
    int status = OK;
    Py_BEGIN_ALLOW_THREADS
    int64_t last = -1; /* the group of the row before: rows of one group, or of the next one made, */
    for (int64_t i = 0; i < rows; i++) { /* often follow each other (steps and keys in order) */
        Group *x = NULL;
        const int64_t combo = combo_of[label[i]];
        for (int64_t g = last; g <= last + 1 && g < t->used; g++)
            if (g >= 0 && t->groups[g].bucket == bucket[i] && t->groups[g].combo == combo) {
                x = t->groups + g;
                break;
            }
        if (!x) x = table_group(t, bucket[i], combo);
        if (x) last = x - t->groups;
        if (!x) {
            status = NO_MEMORY;
            break;
        }
        x->n++;
        if (sq_of[label[i]] == KEEP_COUNT) continue; /* a median's or pNN's: its values are kept apart */
        uint64_t bits = v[i];
        double value;
        memcpy(&value, &bits, 8);
        if (isnan(value) || isnan(x->min)) x->min = NAN;
        else if (value < x->min || (value == 0 && x->min == 0 && signbit(value))) x->min = value;
        if (isnan(value) || isnan(x->max)) x->max = NAN;
        else if (value > x->max || (value == 0 && x->max == 0 && !signbit(value))) x->max = value;
        int biased = (int)((bits >> 52) & 0x7FF);
        if (biased == 0x7FF) {
            if (bits & ((UINT64_C(1) << 52) - 1)) x->nan++;
            else if (bits >> 63) x->neg_inf++;
            else x->pos_inf++;
            continue;
        }
        if ((bits << 1) == 0) continue; /* +-0.0 adds nothing */
        if (++x->since == CARRY_EVERY) {
            x->since = 0;
            if (window_carry(t, &x->s_at, &x->s_lo, &x->s_len) || window_carry(t, &x->q_at, &x->q_lo, &x->q_len)) {
                status = NO_MEMORY;
                break;
            }
        }
        int e = biased > 0 ? biased : 1;
        uint64_t m = significand_of(bits, biased);
        int64_t p[SQUARE_PIECES];
        int64_t d = sum_pieces(bits, m, e, p);
        if ((x->s_at < 0 || d < x->s_lo || d + SUM_PIECES > (int64_t)x->s_lo + x->s_len) &&
            window_cover(t, &x->s_at, &x->s_lo, &x->s_len, d, d + SUM_PIECES - 1)) {
            status = NO_MEMORY;
            break;
        }
        int64_t *y = t->arena + x->s_at + (d - x->s_lo);
        y[0] += p[0];
        y[1] += p[1];
        y[2] += p[2];
        if (sq_of[label[i]] != KEEP_SQUARES) continue;
        d = square_pieces(m, e, p);
        if ((x->q_at < 0 || d < x->q_lo || d + SQUARE_PIECES > (int64_t)x->q_lo + x->q_len) &&
            window_cover(t, &x->q_at, &x->q_lo, &x->q_len, d, d + SQUARE_PIECES - 1)) {
            status = NO_MEMORY;
            break;
        }
        t->squares = 1;
        y = t->arena + x->q_at + (d - x->q_lo);
        for (int j = 0; j < SQUARE_PIECES; j++) y[j] += p[j];
    }
    Py_END_ALLOW_THREADS
    if (status == NO_MEMORY) {
        PyErr_NoMemory();
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (all[i]->obj) PyBuffer_Release(all[i]);
    return result;
}

/* below(upto, every) -> the groups of buckets below upto (every: all of them) */
static PyObject *table_below(Table *t, PyObject *args) {
    long long upto;
    int every;
    if (!PyArg_ParseTuple(args, "Lp", &upto, &every)) return NULL;
    int64_t k = 0;
    if (every) k = t->used;
    else if (upto > t->lowest)
        for (int64_t g = 0; g < t->used; g++) k += t->groups[g].bucket < upto;
    return PyLong_FromLongLong((long long)k);
}

static const Group *sorting; /* qsort's comparator reads the groups here (under the GIL) */

static int by_bucket_combo(const void *a, const void *b) {
    const Group *x = sorting + *(const int64_t *)a, *y = sorting + *(const int64_t *)b;
    if (x->bucket != y->bucket) return x->bucket < y->bucket ? -1 : 1;
    return x->combo < y->combo ? -1 : x->combo > y->combo;
}

/* One window's integer into canonical digits at out (canonical_one, with two digits of
 * room on top); returns how many, or -1. */
static int64_t window_canonical(Table *t, int64_t at, int32_t lo, int32_t len, int64_t *scratch, int8_t *sign,
                                int16_t *low, uint8_t *size, uint32_t *out) {
    if (at < 0) {
        *sign = 0;
        *low = 0;
        *size = 0;
        return 0;
    }
    memcpy(scratch, t->arena + at, sizeof(int64_t) * (size_t)len);
    scratch[len] = scratch[len + 1] = 0;
    return canonical_one(scratch, len + 2, lo, sign, low, size, out);
}

/* drain(upto, every, bucket, combo, count, nan, pos_inf, neg_inf, min, max, s_sign, s_low,
 * s_size, q_sign, q_low, q_size) -> (sum digits, square digits): the groups of buckets
 * below upto (as many as below(upto) says: the arrays' length), in the order of bucket
 * then combo, written out in exact.ExactState's form, and taken out of the table. */
static PyObject *table_drain(Table *t, PyObject *args) {
    long long upto;
    int every;
    Py_buffer b[14];
    if (!PyArg_ParseTuple(args, "Lpw*w*w*w*w*w*w*w*w*w*w*w*w*w*", &upto, &every, &b[0], &b[1], &b[2], &b[3], &b[4], &b[5],
                          &b[6], &b[7], &b[8], &b[9], &b[10], &b[11], &b[12], &b[13]))
        return NULL;
    PyObject *result = NULL, *s_out = NULL, *q_out = NULL;
    int64_t *order = NULL, *scratch = NULL, *kept_arena = NULL;
    int64_t k = 0, s_room = 0, q_room = 0, widest = 0;
    for (int64_t g = 0; g < t->used; g++) {
        const Group *x = t->groups + g;
        if (!every && x->bucket >= upto) continue;
        k++;
        if (x->s_at >= 0) s_room += x->s_len + 2;
        if (x->q_at >= 0) q_room += x->q_len + 2;
        if (x->s_len > widest) widest = x->s_len;
        if (x->q_len > widest) widest = x->q_len;
    }
    static const Py_ssize_t sizes[14] = {8, 8, 8, 8, 8, 8, 8, 8, 1, 2, 1, 1, 2, 1};
    static const char *names[14] = {"bucket", "combo", "count", "nan", "pos_inf", "neg_inf", "min", "max",
                                    "s_sign", "s_low", "s_size", "q_sign", "q_low", "q_size"};
    for (int i = 0; i < 14; i++)
        if (check_length(&b[i], i >= 11 && !t->squares ? 0 : k, sizes[i], names[i])) goto done;
    order = (int64_t *)malloc(sizeof(int64_t) * (size_t)(k + 1));
    scratch = (int64_t *)malloc(sizeof(int64_t) * (size_t)(widest + 2));
    s_out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(s_room * 4));
    q_out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(q_room * 4));
    if (!order || !scratch || !s_out || !q_out) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    int64_t at = 0;
    for (int64_t g = 0; g < t->used; g++)
        if (every || t->groups[g].bucket < upto) order[at++] = g;
    int in_order = 1; /* groups are made as their first records come: often in this order already */
    for (int64_t i = 1; i < k && in_order; i++) {
        const Group *x = t->groups + order[i - 1], *y = t->groups + order[i];
        in_order = x->bucket < y->bucket || (x->bucket == y->bucket && x->combo < y->combo);
    }
    if (!in_order) {
        sorting = t->groups;
        qsort(order, (size_t)k, sizeof(int64_t), by_bucket_combo);
    }
    int64_t s_written = 0, q_written = 0, got = 0;
    for (int64_t i = 0; i < k && got >= 0; i++) {
        const Group *x = t->groups + order[i];
        ((int64_t *)b[0].buf)[i] = x->bucket;
        ((int64_t *)b[1].buf)[i] = x->combo;
        ((int64_t *)b[2].buf)[i] = x->n;
        ((int64_t *)b[3].buf)[i] = x->nan;
        ((int64_t *)b[4].buf)[i] = x->pos_inf;
        ((int64_t *)b[5].buf)[i] = x->neg_inf;
        ((double *)b[6].buf)[i] = x->min;
        ((double *)b[7].buf)[i] = x->max;
        got = window_canonical(t, x->s_at, x->s_lo, x->s_len, scratch, (int8_t *)b[8].buf + i,
                                       (int16_t *)b[9].buf + i, (uint8_t *)b[10].buf + i,
                                       (uint32_t *)PyByteArray_AS_STRING(s_out) + s_written);
        if (got < 0) break;
        s_written += got;
        if (!t->squares) continue;
        got = window_canonical(t, x->q_at, x->q_lo, x->q_len, scratch, (int8_t *)b[11].buf + i,
                               (int16_t *)b[12].buf + i, (uint8_t *)b[13].buf + i,
                               (uint32_t *)PyByteArray_AS_STRING(q_out) + q_written);
        if (got >= 0) q_written += got;
    }
    if (got < 0) goto done;
    /* the groups left, their windows copied into an arena of their own, indexed again */
    int64_t left = 0, kept = 0;
    for (int64_t g = 0; g < t->used; g++) {
        Group *x = t->groups + g;
        if (!every && x->bucket >= upto) kept += (x->s_at >= 0 ? x->s_len : 0) + (x->q_at >= 0 ? x->q_len : 0);
    }
    kept_arena = (int64_t *)malloc(sizeof(int64_t) * (size_t)(kept + 1));
    if (!kept_arena) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t arena_at = 0, lowest = INT64_MAX;
    for (int64_t g = 0; g < t->used; g++) {
        Group x = t->groups[g];
        if (every || x.bucket < upto) continue;
        if (x.s_at >= 0) {
            memcpy(kept_arena + arena_at, t->arena + x.s_at, sizeof(int64_t) * (size_t)x.s_len);
            x.s_at = arena_at;
            arena_at += x.s_len;
        }
        if (x.q_at >= 0) {
            memcpy(kept_arena + arena_at, t->arena + x.q_at, sizeof(int64_t) * (size_t)x.q_len);
            x.q_at = arena_at;
            arena_at += x.q_len;
        }
        t->groups[left++] = x;
        if (x.bucket < lowest) lowest = x.bucket;
    }
    t->lowest = lowest;
    free(t->arena);
    t->arena = kept_arena;
    kept_arena = NULL;
    t->arena_used = t->arena_room = kept;
    t->used = left;
    if (!left) t->squares = 0;
    int64_t slots = 1024;
    while (slots < 2 * left) slots *= 2;
    if (table_reindex(t, slots)) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyByteArray_Resize(s_out, (Py_ssize_t)(s_written * 4)) ||
        PyByteArray_Resize(q_out, (Py_ssize_t)(q_written * 4)))
        goto done;
    result = Py_BuildValue("(OO)", s_out, q_out);
done:
    if (!result && !PyErr_Occurred())
        PyErr_SetString(PyExc_AssertionError, "a digit past the top of its group: the headroom argument failed");
    Py_XDECREF(s_out);
    Py_XDECREF(q_out);
    free(order);
    free(scratch);
    free(kept_arena);
    for (int i = 0; i < 14; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

static Py_ssize_t table_len(Table *t) { return (Py_ssize_t)t->used; }

static PyObject *table_squares(Table *t, void *closure) {
    (void)closure;
    return PyBool_FromLong(t->squares);
}

static PyMethodDef table_methods[] = {
    {"add", (PyCFunction)table_add, METH_VARARGS,
     "add(bucket, combo, values, squares): each row's value into its group (bucket, combo), its square "
     "too where squares (uint8) is set."},
    {"below", (PyCFunction)table_below, METH_VARARGS,
     "below(upto, every) -> the groups of buckets below upto (every: all the groups)."},
    {"drain", (PyCFunction)table_drain, METH_VARARGS,
     "drain(upto, every, bucket, combo, count, nan, pos_inf, neg_inf, min, max, s_sign, s_low, s_size, q_sign, "
     "q_low, q_size) -> (sum digits, square digits): the groups below upto, taken out, in the order of "
     "bucket then combo (the square arrays empty where squares is false)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef table_getset[] = {
    {"squares", (getter)table_squares, NULL, "whether some group kept squares", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods table_sequence = {.sq_length = (lenfunc)table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "metric_core.offline.engine._exact.Table",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Records added straight into their groups (bucket, combo): counts, min, max and exact "
              "sums, kept across calls (not thread-safe: one thread adds and drains).",
    .tp_new = table_new,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_methods = table_methods,
    .tp_getset = table_getset,
    .tp_as_sequence = &table_sequence,
};

/* ---- order_stats: each group's order statistics for median and pNN (finish.group_values) -- */

static int compare_doubles(const void *a, const void *b) { /* no NaN */
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The k-th smallest of x[0 .. n) (from 0), x reordered so that no value before it is larger
 * and none after it smaller; no NaN. Wirth's selection, its bound the median of the values
 * at a quarter, half and three quarters of the range (a run in order with one value out of
 * place, a metric's reset, makes the ends a poor bound); past 2 log2(n) + 4 passes (an
 * input that defeats the bound) the range left is sorted: never more than n log n. */
static double select_kth(double *x, int64_t n, int64_t k) {
    int64_t l = 0, r = n - 1;
    int passes = 2 * bit_length64((uint64_t)n) + 4;
    while (l < r) {
        if (passes-- == 0) {
            qsort(x + l, (size_t)(r - l + 1), sizeof(double), compare_doubles);
            break;
        }
        int64_t quarter = (r - l) / 4;
        double a = x[l + quarter], b = x[l + (r - l) / 2], c = x[r - quarter];
        double pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t i = l, j = r;
        do {
            while (x[i] < pivot) i++;
            while (pivot < x[j]) j--;
            if (i <= j) {
                double t = x[i];
                x[i] = x[j];
                x[j] = t;
                i++;
                j--;
            }
        } while (i <= j);
        if (j < k) l = i;
        if (k < i) r = j;
    }
    return x[k];
}

/* order_stats(bucket, combo, value, q, g_bucket, g_combo, count, lo, hi, nan, below, rank)
 * -> groups: the values grouped by (bucket, combo), each group (in the order first met)
 * with its count, lo and hi (the values of ranks rank and the next one the statistic needs
 * in the ascending order: rank (n - 1) // 2 and n // 2 for a median, q < 0; floor((n - 1)
 * q) and the next but at most n - 1 for pNN), whether it holds NaN (lo and hi then NaN),
 * and its count of values below 0.0, -0.0 counted: what finish.group_values reads from a
 * sort of each group's values, without the sort. Outputs have room for one group a value. */
static PyObject *order_stats(PyObject *self, PyObject *args) {
    Py_buffer bucket_b, combo_b, value_b, out_b[8];
    double q;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*dw*w*w*w*w*w*w*w*", &bucket_b, &combo_b, &value_b, &q, &out_b[0],
                          &out_b[1], &out_b[2], &out_b[3], &out_b[4], &out_b[5], &out_b[6], &out_b[7]))
        return NULL;
    Py_buffer *all[] = {&bucket_b, &combo_b, &value_b, &out_b[0], &out_b[1], &out_b[2],
                        &out_b[3], &out_b[4], &out_b[5], &out_b[6], &out_b[7]};
    PyObject *result = NULL;
    int64_t n = (int64_t)(value_b.len / 8), m = 0, mask = 1023;
    int64_t *index = NULL, *group_of = NULL, *start = NULL;
    double *held = NULL;
    if (check_length(&bucket_b, n, 8, "bucket") || check_length(&combo_b, n, 8, "combo") ||
        check_length(&value_b, n, 8, "value"))
        goto done;
    for (int k = 0; k < 8; k++)
        if (out_b[k].len < (Py_ssize_t)n * 8) {
            PyErr_SetString(PyExc_ValueError, "_exact.order_stats: an output has no room for a group a value");
            goto done;
        }
    const int64_t *bucket = (const int64_t *)bucket_b.buf, *combo = (const int64_t *)combo_b.buf;
    const double *value = (const double *)value_b.buf;
    int64_t *g_bucket = (int64_t *)out_b[0].buf, *g_combo = (int64_t *)out_b[1].buf;
    int64_t *count = (int64_t *)out_b[2].buf;
    double *lo = (double *)out_b[3].buf, *hi = (double *)out_b[4].buf;
    int64_t *nan = (int64_t *)out_b[5].buf, *below = (int64_t *)out_b[6].buf, *rank = (int64_t *)out_b[7].buf;
    index = (int64_t *)calloc((size_t)mask + 1, sizeof(int64_t));
    group_of = (int64_t *)malloc(sizeof(int64_t) * ((size_t)n + 1));
    held = (double *)malloc(sizeof(double) * ((size_t)n + 1));
    if (!index || !group_of || !held) {
        PyErr_NoMemory();
        goto done;
    }
    int status = OK;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n && status == OK; i++) { /* each value's group, made where new */
        int64_t at = slot_of(bucket[i], combo[i], mask), g;
        for (;;) {
            g = index[at] - 1;
            if (g < 0 || (g_bucket[g] == bucket[i] && g_combo[g] == combo[i])) break;
            at = (at + 1) & mask;
        }
        if (g < 0) {
            g = m++;
            g_bucket[g] = bucket[i];
            g_combo[g] = combo[i];
            count[g] = 0;
            index[at] = g + 1;
            if (2 * m > mask + 1) { /* at most half full */
                int64_t *bigger = (int64_t *)calloc(2 * ((size_t)mask + 1), sizeof(int64_t));
                if (!bigger) {
                    status = NO_MEMORY;
                    break;
                }
                mask = 2 * mask + 1;
                for (int64_t h = 0; h < m; h++) {
                    int64_t to = slot_of(g_bucket[h], g_combo[h], mask);
                    while (bigger[to]) to = (to + 1) & mask;
                    bigger[to] = h + 1;
                }
                free(index);
                index = bigger;
            }
        }
        group_of[i] = g;
        count[g]++;
    }
    if (status == OK) {
        start = (int64_t *)malloc(sizeof(int64_t) * ((size_t)m + 1));
        if (!start) status = NO_MEMORY;
    }
    if (status == OK) { /* each group's values side by side */
        int64_t total = 0;
        for (int64_t g = 0; g < m; g++) {
            start[g] = total;
            total += count[g];
        }
        for (int64_t i = 0; i < n; i++) held[start[group_of[i]]++] = value[i];
        for (int64_t g = 0; g < m; g++) { /* start[g] is now its end */
            int64_t k = count[g];
            double *x = held + (start[g] - k);
            int64_t nans = 0, negative = 0;
            for (int64_t j = 0; j < k; j++) {
                nans += isnan(x[j]) != 0;
                negative += x[j] < 0 || (x[j] == 0 && signbit(x[j]));
            }
            int64_t r = q < 0 ? (k - 1) / 2 : (int64_t)floor((double)(k - 1) * q);
            int64_t next = q < 0 ? k / 2 : (r + 1 < k - 1 ? r + 1 : k - 1);
            nan[g] = nans > 0;
            below[g] = negative;
            rank[g] = r;
            if (nans) {
                lo[g] = hi[g] = NAN;
                continue;
            }
            lo[g] = select_kth(x, k, r);
            double up = lo[g];
            if (next > r) { /* the least value after it */
                up = x[r + 1];
                for (int64_t j = r + 2; j < k; j++)
                    if (x[j] < up) up = x[j];
            }
            hi[g] = up;
        }
    }
    Py_END_ALLOW_THREADS
    if (status == NO_MEMORY) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyLong_FromLongLong((long long)m);
done:
    free(index);
    free(group_of);
    free(held);
    free(start);
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (all[i]->obj) PyBuffer_Release(all[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"accumulate", accumulate, METH_VARARGS,
     "accumulate(groups, values, n_groups, squares, count, nan, pos_inf, neg_inf, s_sign, s_low, s_size, "
     "q_sign, q_low, q_size) -> (sum digits, square digits or None): fills the per-group arrays, "
     "returns the digits as bytearrays of uint32 (exact.accumulate calls it)."},
    {"add_digits", add_digits, METH_VARARGS,
     "add_digits(sign, low, size, digits, target, n_groups, out_sign, out_low, out_size) -> digits: the "
     "integers of entries added into groups target[i], canonical (exact.combine calls it)."},
    {"finish", finish, METH_VARARGS,
     "finish(kind, sign, low, size, digits, count, limit, q_sign, q_low, q_size, q_digits, out): each "
     "group's sum (kind 0), mean (1) or std (2) correctly rounded into out (ExactState calls it)."},
    {"order_stats", order_stats, METH_VARARGS,
     "order_stats(bucket, combo, value, q, g_bucket, g_combo, count, lo, hi, nan, below, rank) -> groups: "
     "each group's order statistics for a median (q < 0) or pNN (finish.group_values calls it)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_exact",
    "The compiled paths of metric_core.offline.engine.exact: accumulate, add_digits, finish; of the order "
    "statistics of finish.group_values: order_stats; and the Table of metric_core.offline.engine.grouptable.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__exact(void) {
    if (PyType_Ready(&TableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
