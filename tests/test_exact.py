"""The exact kernel (``metric_core.offline.engine.exact``) against ``fractions`` and ``math.isqrt``.

Every sum, mean and std of every group is checked bit for bit (0 ulp) against an oracle
that never looks at the kernel's digits: the values as ``Fraction``s, rounded by CPython's
correctly rounded ``float(Fraction)``, and the square root found from ``math.isqrt`` and
settled by comparing the squares of the midpoints between neighbouring floats with the
exact variance. The same rows split into parts, accumulated apart and merged in any order,
give the same state, bit for bit.

Each test that accumulates runs on both paths: the compiled extension (``_exact.c``;
skipped, with the reason, where it was not built) and pure numpy. Both give the same
state, bit for bit, on every input (a seeded generator and hypothesis check that apart
from the oracle).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pickle
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metric_core.offline.engine import exact
from metric_core.offline.engine.exact import ExactState, accumulate, combine, concat, merge

TINY = 5e-324  # 2**-1074
MAX = np.finfo(np.float64).max

try:  # imported itself: METRICLOG_PURE turns it off in exact, not here
    from metric_core.offline.engine import _exact as COMPILED
except ImportError:
    COMPILED = None
NOT_BUILT = (
    "the C extension metric_core.offline.engine._exact was not built (no C compiler at install): "
    "only the pure numpy path is tested"
)
KERNELS = ("compiled", "numpy")


@contextlib.contextmanager
def kernel_of(name: str):
    """accumulate on the compiled path or the pure numpy one, for the block."""
    if name == "compiled" and COMPILED is None:
        pytest.skip(NOT_BUILT)
    saved = exact._native
    exact._native = COMPILED if name == "compiled" else None
    try:
        yield
    finally:
        exact._native = saved


@pytest.fixture(params=KERNELS)
def kernel(request):
    """accumulate on the compiled path, or on the pure numpy one."""
    with kernel_of(request.param):
        yield request.param


# --- the oracle ------------------------------------------------------------------------


def rounded(x: Fraction) -> float:
    """The float64 nearest x, ties to even, +-inf past the range (CPython's int / int is
    correctly rounded, and raises past the range)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def root(var: Fraction) -> float:
    """The float64 nearest sqrt(var), ties to even."""
    if var == 0:
        return 0.0
    k = 1300 + var.denominator.bit_length()
    guess = rounded(Fraction(math.isqrt(var.numerator * 4**k // var.denominator), 2**k))

    def midpoint_below(f: float, g: float) -> Fraction:  # (f + g) / 2, exactly
        if g == math.inf:  # past MAX: where rounding goes to inf
            return Fraction(2) ** 1024 - Fraction(2) ** 970
        return (Fraction(f) + Fraction(g)) / 2

    f = guess
    for _ in range(8):
        up = math.nextafter(f, math.inf)
        if midpoint_below(f, up) ** 2 < var:
            f = up
            continue
        if f > 0:
            down = math.nextafter(f, 0.0)
            if midpoint_below(down, f) ** 2 > var:
                f = down
                continue
        break
    else:
        raise AssertionError("oracle: no float settles")
    up = math.nextafter(f, math.inf)
    if midpoint_below(f, up) ** 2 == var:  # a tie: the even one
        return f if _even(f) else up
    if f > 0 and midpoint_below(math.nextafter(f, 0.0), f) ** 2 == var:
        return f if _even(f) else math.nextafter(f, 0.0)
    return f


def _even(f: float) -> bool:
    return int(np.float64(f).view(np.int64)) & 1 == 0


def oracle(groups: np.ndarray, values: np.ndarray, n_groups: int) -> dict[str, np.ndarray]:
    """Each group's sum, mean and std the slow, obviously right way."""
    members: list[list[float]] = [[] for _ in range(n_groups)]
    for g, v in zip(groups.tolist(), values.tolist(), strict=True):
        members[g].append(v)
    out = {name: np.zeros(n_groups) for name in ("sum", "mean", "std")}
    for g, vs in enumerate(members):
        n = len(vs)
        if n == 0:
            out["sum"][g], out["mean"][g], out["std"][g] = 0.0, math.nan, math.nan
            continue
        finite = [Fraction(v) for v in vs if math.isfinite(v)]
        pos = any(v == math.inf for v in vs)
        neg = any(v == -math.inf for v in vs)
        if any(math.isnan(v) for v in vs) or (pos and neg):
            out["sum"][g] = out["mean"][g] = out["std"][g] = math.nan
            continue
        if pos or neg:
            out["sum"][g] = out["mean"][g] = math.inf if pos else -math.inf
            out["std"][g] = math.nan
            continue
        s = sum(finite, Fraction(0))
        q = sum((v * v for v in finite), Fraction(0))
        out["sum"][g] = rounded(s)
        out["mean"][g] = rounded(s / n)
        out["std"][g] = root((n * q - s * s) / (n * n))
    return out


def assert_bits(got: np.ndarray, want: np.ndarray, what: str, values_of=None) -> None:
    """Equal bit for bit (every NaN alike; -0.0 is not +0.0)."""
    got_bits = np.where(np.isnan(got), -1, got.view(np.int64))
    want_bits = np.where(np.isnan(want), -1, want.view(np.int64))
    wrong = np.flatnonzero(got_bits != want_bits)
    if len(wrong):
        g = int(wrong[0])
        extra = f"; values {values_of(g)}" if values_of else ""
        raise AssertionError(
            f"{what}: {len(wrong)} of {len(got)} groups differ, first group {g}: "
            f"got {got[g]!r}, want {want[g]!r}{extra}"
        )


# --- the generator ---------------------------------------------------------------------


def _family(rng: np.random.Generator, name: str, n: int) -> np.ndarray:
    if name == "integers":  # token counts
        return rng.integers(0, 10_000, n).astype(np.float64)
    if name == "big_integers":  # sums of integers up to 2**53 and past it
        return rng.integers(2**49, 2**51, n).astype(np.float64)
    if name == "decimals":  # 0.1, 0.2, ... 12.345
        return np.round(rng.integers(0, 100_000, n) / 10.0 ** rng.integers(1, 4, n), 3)
    if name == "offset":  # values on a 1e12 offset
        return 1e12 + np.round(rng.normal(0, 5, n), 2)
    if name == "nano":  # 1e-9 scales
        return rng.normal(3e-9, 1e-9, n)
    if name == "subnormal":
        return rng.integers(-(2**20), 2**20, n) * TINY
    if name == "edge_of_normal":  # about 2**-1022: sums and means cross into subnormals
        return rng.choice([-1.0, 1.0], n) * np.ldexp(
            rng.integers(2**52, 2**53, n).astype(np.float64), -1074 - rng.integers(0, 3, n)
        )
    if name == "huge":  # near 1e300; sums of several near MAX overflow, their means do not
        return rng.choice([1.0, 1.0, -1.0], n) * rng.uniform(0.5, 1.0, n) * MAX
    if name == "mixed_signs":
        return rng.normal(0, 1, n) * 10.0 ** rng.integers(-5, 6, n)
    if name == "zeros":
        return rng.choice([0.0, -0.0], n)
    if name == "span":  # the whole exponent range in one group, cancelling
        base = np.array([1e300, -1e300, 1.0, TINY, -TINY, 1e-300, 3.0, MAX, -MAX, 2.0**-1022, 1e-20])
        return rng.choice(base, n)
    if name == "cancel":  # x and -x beside small values: what is left is exact
        x = rng.normal(0, 1e10, n)
        x[1::2] = -x[::2][: n // 2]
        x[rng.integers(0, n)] = rng.normal()
        return x
    if name == "ties":  # 2**53 + 1 and friends: round-half-even of the sum
        return rng.choice([2.0**53, 1.0, 3.0, 2.0**54, -1.0], n)
    if name == "bits":  # any finite float64
        raw = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64).view(np.float64)
        return np.where(np.isfinite(raw), raw, 1.5)
    if name == "nonfinite":
        v = rng.normal(0, 1, n)
        v[rng.integers(0, n, max(1, n // 3))] = rng.choice([np.nan, np.inf, -np.inf], max(1, n // 3))
        return v
    if name == "one_infinity":
        v = rng.normal(0, 1, n)
        v[rng.integers(0, n)] = rng.choice([np.inf, -np.inf])
        return v
    if name == "near_ties":  # (2A + 1) 2**e, a tie, and a bit far below it that breaks it
        a, e = int(rng.integers(2**51, 2**52)) * 2, int(rng.integers(-1000, 900))
        far = math.ldexp(float(rng.choice([-1.0, 1.0])), e - int(rng.integers(54, 130)))
        return np.array([math.ldexp(2 * a, e), math.ldexp(1.0, e), far, -0.0][: max(n, 3)] * max(1, n // 4))
    if name == "std_ties":  # std exactly between two floats, or exactly a float
        return rng.choice([0.0, TINY], n) if rng.random() < 0.5 else rng.choice([1.0, 3.0], n)
    raise ValueError(name)


FAMILIES = (
    "integers", "big_integers", "decimals", "offset", "nano", "subnormal", "edge_of_normal",
    "huge", "mixed_signs", "zeros", "span", "cancel", "ties", "bits", "nonfinite",
    "one_infinity", "std_ties", "near_ties",
)  # fmt: skip


def generate(seed: int, n_groups: int = 400) -> tuple[np.ndarray, np.ndarray, int]:
    """Rows of ``n_groups`` groups (a few left empty), each of one family or of a mix,
    shuffled: (group ids, values, groups)."""
    rng = np.random.default_rng(seed)
    groups, values = [], []
    for g in range(n_groups):
        if rng.random() < 0.03:
            continue  # an empty group
        n = int(rng.choice([1, 2, 3, rng.integers(4, 60)]))
        if rng.random() < 0.15:  # a mix of families in one group
            names = rng.choice(FAMILIES, 2)
            v = np.concatenate([_family(rng, str(name), n) for name in names])
        else:
            v = _family(rng, FAMILIES[g % len(FAMILIES)], n)
        groups.append(np.full(len(v), g))
        values.append(v)
    g_all, v_all = np.concatenate(groups), np.concatenate(values)
    order = rng.permutation(len(g_all))
    return g_all[order], v_all[order], n_groups


def check(state: ExactState, groups: np.ndarray, values: np.ndarray, n_groups: int) -> None:
    want = oracle(groups, values, n_groups)

    def values_of(g):
        return values[groups == g].tolist()[:12]

    np.testing.assert_array_equal(state.count, np.bincount(groups, minlength=n_groups))
    assert_bits(state.sum(), want["sum"], "sum", values_of)
    assert_bits(state.mean(), want["mean"], "mean", values_of)
    assert_bits(state.std(), want["std"], "std", values_of)


# --- the tests -------------------------------------------------------------------------


def _binned_window(biased: np.ndarray, n_groups: int) -> tuple[int, int] | None:
    """A window over as many exponents as binning takes, whatever the rows a group."""
    fit = biased[biased < exact._BINNED_TOP]
    if not len(fit):
        return None
    first = int(fit.min())
    return first, min(int(fit.max()) - first + 1, exact._WIDEST)


@pytest.fixture(params=["compiled", "auto", "direct", "binned"])
def path(request, monkeypatch):
    """accumulate compiled; or in numpy as it chooses, every row straight into digits, or
    as many rows as possible binned by (group, exponent) first."""
    if request.param == "direct":
        monkeypatch.setattr(exact, "_window", lambda biased, n_groups: None)
    elif request.param == "binned":
        monkeypatch.setattr(exact, "_window", _binned_window)
    with kernel_of("compiled" if request.param == "compiled" else "numpy"):
        yield request.param


@pytest.mark.parametrize("seed", range(6))
def test_every_statistic_of_every_family_is_correctly_rounded(seed, path):
    groups, values, n_groups = generate(seed)
    check(accumulate(groups, values, n_groups), groups, values, n_groups)


@pytest.mark.parametrize("seed", range(4))
def test_every_path_gives_the_same_state(seed, monkeypatch):
    groups, values, n_groups = generate(100 + seed)
    with kernel_of("numpy"):
        auto = accumulate(groups, values, n_groups)
        monkeypatch.setattr(exact, "_window", lambda biased, n_groups: None)
        direct = accumulate(groups, values, n_groups)
        monkeypatch.setattr(exact, "_window", _binned_window)
        binned = accumulate(groups, values, n_groups)
    assert direct.equals(auto) and binned.equals(auto)
    with kernel_of("compiled"):
        assert accumulate(groups, values, n_groups).equals(auto)


def test_the_oracle_is_right_where_the_answer_is_known():
    assert rounded(Fraction(2**53) + 1) == 2.0**53  # a tie, to even
    assert rounded(Fraction(MAX) * 2) == math.inf
    assert root(Fraction(1)) == 1.0
    assert root(Fraction(2)) == math.sqrt(2.0)  # IEEE sqrt is correctly rounded
    assert root(Fraction(TINY) ** 2 / 4) == 0.0  # 2**-1075: a tie between 0 and 2**-1074
    assert root(Fraction(TINY) ** 2 * 9 / 4) == 2 * TINY  # 1.5 * 2**-1074: a tie, to 2
    for x in (0.1, 1e300, 3e-320, 7.0):
        assert root(Fraction(x) ** 2) == x


@pytest.mark.parametrize(
    ("values", "sum_", "mean", "std"),
    [
        ([6738.0, 2812.0, 2136.0], 11686.0, 11686 / 3, None),  # the token counts
        ([2.0**53, 1.0], 2.0**53, 2.0**52, 2.0**52 - 0.5),  # the sum and the mean: ties, to even
        ([2.0**53, 1.0, 1.0], 2.0**53 + 2, None, None),
        ([0.0, TINY], TINY, 0.0, 0.0),  # mean 2**-1075 and std 2**-1075: ties to 0
        ([0.0, 0.0, 3 * TINY], 3 * TINY, TINY, None),
        ([MAX, MAX, -MAX], MAX, MAX / 3, None),
        ([MAX, MAX], math.inf, MAX, 0.0),  # the sum overflows, the mean does not
        ([-MAX, -MAX], -math.inf, -MAX, 0.0),
        ([-0.0, -0.0], 0.0, 0.0, 0.0),  # an exact zero is +0.0
        ([1.0, 3.0], 4.0, 2.0, 1.0),
        ([1e300, 1.0, -1e300], 1.0, None, None),
        ([math.inf, 1.0], math.inf, math.inf, math.nan),
        ([math.inf, -math.inf], math.nan, math.nan, math.nan),
        ([math.nan, math.inf], math.nan, math.nan, math.nan),
    ],
)
def test_known_answers(values, sum_, mean, std, path):
    state = accumulate(np.zeros(len(values), np.int64), np.array(values), 1)
    for name, want in (("sum", sum_), ("mean", mean), ("std", std)):
        if want is not None:
            assert_bits(getattr(state, name)(), np.array([want]), name)
    check(state, np.zeros(len(values), np.int64), np.array(values), 1)


def test_a_mean_whose_only_sign_of_being_past_a_tie_is_the_remainder(kernel):
    """The mean (T + 1/N) 2**-1074, T a 54-bit odd pattern times 2**36: truncated, a tie
    that goes down to even; the remainder 1/N of the long division says it goes up."""
    a, n = 2**52 + 2, 2**20
    x = math.ldexp(2 * a * 2**36, -1074)
    y = math.ldexp((a + n // 4) * 2**38, -1074)
    values = np.array([x] * (n - 2) + [y, TINY])
    exact_mean = ((n - 2) * Fraction(x) + Fraction(y) + Fraction(TINY)) / n
    assert exact_mean == (Fraction((2 * a + 1) * 2**36) + Fraction(1, n)) * Fraction(TINY)
    want = math.ldexp((2 * a + 2) * 2**36, -1074)
    assert float(exact_mean) == want
    assert_bits(accumulate(np.zeros(n, np.int64), values, 1).mean(), np.array([want]), "mean")


def test_ties_broken_by_a_far_bit_at_every_alignment(path):
    """(2A + 1) 2**e is a tie for the sum; 2**(e - s) far below breaks it (up, or down
    when negative). Every alignment of e to the digits and every distance s puts that bit
    in each place the rounding looks: the window, the bits below it, the digits below
    those, the long division's last quotient digit."""
    a = 2**52 + 2
    groups, values = [], []
    for e in range(-40, 40):
        for s in range(40, 110, 3):
            for sign in (1.0, -1.0):
                g = len(groups) // 4
                groups += [g] * 4
                values += [math.ldexp(2 * a, e), math.ldexp(1.0, e), sign * math.ldexp(1.0, e - s), 0.0]
    groups_, values_ = np.array(groups), np.array(values)
    n_groups = len(groups) // 4
    check(accumulate(groups_, values_, n_groups), groups_, values_, n_groups)


def test_an_empty_group_gives_what_the_engine_gives(kernel):
    state = accumulate(np.array([1]), np.array([5.0]), 3)
    assert_bits(state.sum(), np.array([0.0, 5.0, 0.0]), "sum")
    assert_bits(state.mean(), np.array([np.nan, 5.0, np.nan]), "mean")
    assert_bits(state.std(), np.array([np.nan, 0.0, np.nan]), "std")
    empty = ExactState.empty(2)
    assert_bits(empty.sum(), np.zeros(2), "sum")
    assert np.isnan(empty.mean()).all() and np.isnan(empty.std()).all()
    assert combine([], [], 2).equals(empty) and merge(empty, empty).equals(empty)
    assert accumulate(np.zeros(0, np.int64), np.zeros(0), 2).equals(empty)


def test_a_sum_of_integers_is_that_integer(path):
    rng = np.random.default_rng(7)
    groups = rng.integers(0, 2000, 200_000)
    values = rng.integers(0, 2**20, len(groups)).astype(np.float64)
    got = accumulate(groups, values, 2000).sum()
    want = np.bincount(groups, weights=values, minlength=2000)  # below 2**53: exact too
    assert_bits(got, want, "sum")


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_the_same_rows_split_and_merged_in_any_order_give_the_same_bits(parts, kernel):
    groups, values, n_groups = generate(11, n_groups=300)
    whole = accumulate(groups, values, n_groups)
    rng = np.random.default_rng(parts)
    order = rng.permutation(len(groups))
    pieces = np.array_split(order, parts)
    states = []
    for rows in pieces:  # each part numbers its own groups, as a partition does
        mine, local = np.unique(groups[rows], return_inverse=True)
        states.append((mine, accumulate(local, values[rows], len(mine))))
    folded = ExactState.empty(n_groups)
    for i in rng.permutation(parts):
        mine, state = states[i]
        folded = merge(folded, state, mine)
    assert folded.equals(whole)
    for name in ("sum", "mean", "std"):
        assert_bits(getattr(folded, name)(), getattr(whole, name)(), name)
    # all at once, and as a tree, in other orders
    at_once = combine([s for _, s in states][::-1], [m for m, _ in states][::-1], n_groups)
    assert at_once.equals(whole)
    check(whole, groups, values, n_groups)


def test_merge_maps_groups_and_grows_the_group_space(kernel):
    a = accumulate(np.array([0, 1, 1]), np.array([1.0, 2.0, 0.5]), 2)
    b = accumulate(np.array([0, 1, 1]), np.array([10.0, 1e-300, -2.0]), 2)
    merged = merge(a, b, np.array([3, 1]))  # b's 0 is a new group 3, b's 1 is a's 1
    want = accumulate(np.array([0, 1, 1, 3, 1, 1]), np.array([1.0, 2.0, 0.5, 10.0, 1e-300, -2.0]), 4)
    assert merged.equals(want)
    with pytest.raises(ValueError, match="entries for 2 groups"):
        merge(a, b, np.array([0]))


def test_combine_adds_groups_that_map_to_one(kernel):
    groups, values, n_groups = generate(5, n_groups=60)
    whole = accumulate(groups, values, n_groups)
    halves = whole.take(np.arange(n_groups)), whole.take(np.arange(n_groups))
    doubled = combine(list(halves), [np.arange(n_groups) // 2, np.arange(n_groups) // 2], n_groups // 2)
    want = accumulate(np.concatenate([groups // 2] * 2), np.concatenate([values] * 2), n_groups // 2)
    assert doubled.equals(want)


def test_take_concat_and_pickle_keep_the_states(kernel):
    groups, values, n_groups = generate(3, n_groups=50)
    state = accumulate(groups, values, n_groups)
    order = np.random.default_rng(0).permutation(n_groups)
    back = concat([state.take(order[:20]), state.take(order[20:])]).take(np.argsort(order))
    assert back.equals(state)
    assert pickle.loads(pickle.dumps(state)).equals(state)
    assert all(isinstance(getattr(state, f), np.ndarray) for f in ("count", "nan", "pos_inf", "neg_inf"))


def test_the_digits_are_the_exact_integers(kernel):
    groups, values, n_groups = generate(4, n_groups=120)
    state = accumulate(groups, values, n_groups)
    finite = np.isfinite(values)
    for g, (s, q) in enumerate(zip(state.sum_digits.to_ints(), state.squares.to_ints(), strict=True)):
        vs = [Fraction(v) for v in values[(groups == g) & finite].tolist()]
        assert Fraction(s) * Fraction(2) ** exact.SUM_BASE == sum(vs, Fraction(0))
        assert Fraction(q) * Fraction(2) ** exact.SQUARE_BASE == sum((v * v for v in vs), Fraction(0))


def test_counts_past_the_vector_path_take_python_integers(monkeypatch, kernel):
    """Counts of 2**31 and more are finished with Python ints: made to happen here by
    lowering the bound, so the same groups go both ways."""
    groups, values, n_groups = generate(8, n_groups=150)
    state = accumulate(groups, values, n_groups)
    vector = state.mean(), state.std()
    monkeypatch.setattr(exact, "_VECTOR_COUNT", 1)
    assert (state.count > 1).sum() > 100
    check(state, groups, values, n_groups)
    assert_bits(state.mean(), vector[0], "mean")
    assert_bits(state.std(), vector[1], "std")


@pytest.mark.parametrize("seed", range(3))
def test_the_statistics_of_some_groups_are_those_of_all(seed, monkeypatch, kernel):
    """sum, mean and std of the groups a mask picks (the engine's take of a chunk whose
    keys name different statistics): their bits are those of the same groups finished
    with the others, and the oracle's; groups past the vector path's counts and empty
    groups among them."""
    monkeypatch.setattr(exact, "_VECTOR_COUNT", 3)  # groups of 4 rows or more: Python's path
    groups, values, n_groups = generate(900 + seed, n_groups=1500)
    state = accumulate(groups, values, n_groups)
    check(state, groups, values, n_groups)  # every group finished: the oracle's bits
    assert (np.bincount(groups, minlength=n_groups) == 0).any() and (state.count > 3).any()
    where = np.random.default_rng(seed).random(n_groups) < 0.4
    for name in ("sum", "mean", "std"):
        assert_bits(getattr(state, name)(where)[where], getattr(state, name)()[where], name)


def test_many_rows_a_group_cross_the_bincount_limit(monkeypatch, path):
    """More rows than one float64 bincount may add exactly, in one group: pieces near
    2**32 each, a sum near 2**53 in a digit if they were not split."""
    monkeypatch.setattr(exact, "ROWS_PER_BINCOUNT", 1000)
    rng = np.random.default_rng(2)
    values = np.ldexp(rng.integers(2**52, 2**53, 5000).astype(np.float64), -52)  # every bit set
    values[::2] *= -1
    groups = rng.integers(0, 2, len(values))
    check(accumulate(groups, values, 2), groups, values, 2)


def test_a_bin_of_more_rows_than_one_bincount_takes_stays_exact(path):
    """2**21 + 3 rows of a value with all 53 bits set, in one group: each float64 bin and
    int64 digit is at its bound (the sum known exactly without adding them one by one)."""
    n = 2**21 + 3
    x = math.ldexp(2**53 - 1, -20)
    state = accumulate(np.zeros(n, np.int64), np.full(n, x), 1)
    total = Fraction(x) * n
    assert_bits(state.sum(), np.array([float(total)]), "sum")
    assert_bits(state.mean(), np.array([x]), "mean")
    assert_bits(state.std(), np.array([0.0]), "std")
    assert state.squares.to_ints()[0] * Fraction(2) ** exact.SQUARE_BASE == Fraction(x) ** 2 * n


def test_groups_of_far_apart_exponents_get_spans_of_their_own(kernel):
    """A group of 1e-300s beside a group of 1e300s: too many digits for one span a group,
    each gets its own (the same state either way)."""
    rng = np.random.default_rng(3)
    n_groups = 20_000
    groups = np.repeat(np.arange(n_groups), 3)
    values = np.where(groups % 2 == 0, 1e-300, 1e300) * rng.uniform(1, 2, len(groups))
    state = accumulate(groups, values, n_groups)
    assert state.sum_digits.size.max() <= 5
    few = np.arange(0, n_groups, 997)
    rows = np.isin(groups, few)
    local = np.searchsorted(few, groups[rows])
    assert accumulate(local, values[rows], len(few)).equals(state.take(few))
    check(state.take(few), local, values[rows], len(few))


@pytest.mark.parametrize("seed", range(2))
def test_std_by_the_exact_check_alone(seed, monkeypatch, kernel):
    """Every group's std found by the digit comparisons, none by the double-double."""
    original = exact._quick

    def undecided(d, n):
        result, _ = original(d, n)
        return result, np.zeros(len(n), bool)

    monkeypatch.setattr(exact, "_quick", undecided)
    groups, values, n_groups = generate(40 + seed)
    check(accumulate(groups, values, n_groups), groups, values, n_groups)


def test_std_settles_from_candidates_several_floats_off():
    """The exact check alone finds the answer: started from the right float moved up to 4
    floats either way, or from the power of two nearest (where the gap below halves)."""
    groups, values, n_groups = generate(21, n_groups=500)
    state = accumulate(groups, values, n_groups)
    want = oracle(groups, values, n_groups)["std"]
    some = np.flatnonzero(np.isfinite(want) & (want > 0))
    d = exact._spread(state.sum_digits.take(some), state.squares.take(some), state.count[some])
    rng = np.random.default_rng(0)
    for moves in (rng.integers(-4, 5, len(some)), np.full(len(some), 0)):
        start = want[some].copy()
        for i, m in enumerate(moves.tolist()):
            for _ in range(abs(m)):
                start[i] = np.nextafter(start[i], np.inf if m > 0 else 0.0)
        assert_bits(exact._settle(d, state.count[some], start), want[some], "std")
    # std the float just below a power of two, started from that power: the gap below it is
    # half the gap above, and so is the midpoint's distance
    below = np.nextafter(np.ldexp(1.0, np.arange(-1000, 1000, 37)), 0.0)
    pairs = np.stack([np.zeros_like(below), 2 * below], axis=1).ravel()
    ids = np.repeat(np.arange(len(below)), 2)
    state = accumulate(ids, pairs, len(below))
    d = exact._spread(state.sum_digits, state.squares, state.count)
    assert_bits(exact._settle(d, state.count, np.ldexp(1.0, np.arange(-1000, 1000, 37))), below, "std")


@pytest.mark.parametrize("seed", range(3))
def test_compare_orders_the_root_and_a_midpoint_exactly(seed):
    """``_compare``: the sign of sqrt(D 2**SQUARE_BASE) / n - mid 2**exp, against Python
    integers, where D is just above, at, and below (n mid)**2, or far from it."""
    rng = np.random.default_rng(seed)
    rows = 300
    n = rng.integers(1, 2**31, rows)
    mid = rng.integers(1, 2**56, rows)
    exp = rng.integers(-1075, 900, rows)
    ints, wants = [], []
    for i in range(rows):
        z = 2 * int(exp[i]) - exact.SQUARE_BASE
        p = (int(n[i]) * int(mid[i])) ** 2 << z
        kind = i % 7
        delta = [0, 1, -1, 1 << max(0, z - 40), -(1 << max(0, z - 3)), p, 0][kind]
        if kind == 5:  # above, in the digits just past the compared window, or far past
            delta = p << int(rng.integers(40, 300))
        if kind == 6:  # a power of two just past the window: no digit of it in the window
            delta = (1 << (32 * ((z >> 5) + 8) + int(rng.integers(0, 64)))) - p
        ints.append(p + delta)
        wants.append((delta > 0) - (delta < 0))
    d = exact._Dense.from_digits(_digits_of(ints))
    got = exact._compare(d, np.arange(rows), n, mid, exp)
    np.testing.assert_array_equal(got, wants)


def _digits_of(ints: list[int]) -> exact.Digits:
    """Digits of non-negative Python ints, built without the kernel's carrying."""
    sign, low, size, digits = [], [], [], []
    for x in ints:
        limbs = []
        while x:
            limbs.append(x & 0xFFFFFFFF)
            x >>= 32
        start = next((j for j, v in enumerate(limbs) if v), len(limbs))
        limbs = limbs[start:]
        sign.append(1 if limbs else 0)
        low.append(start if limbs else 0)
        size.append(len(limbs))
        digits += limbs
    return exact.Digits(
        np.array(sign, np.int8),
        np.array(low, np.int16),
        np.array(size, np.uint8),
        np.array(digits, np.uint32),
    )


def test_digits_built_by_hand_are_what_the_kernel_makes(kernel):
    groups, values, n_groups = generate(9, n_groups=80)
    state = accumulate(groups, values[:], n_groups)
    magnitudes = [abs(x) for x in state.squares.to_ints()]
    assert _digits_of(magnitudes).equals(state.squares)


def test_std_without_squares_is_refused_and_bad_ids_are_said(kernel):
    state = accumulate(np.array([0]), np.array([1.0]), 1, squares=False)
    assert state.squares is None
    with pytest.raises(ValueError, match="squares=True"):
        state.std()
    with pytest.raises(ValueError, match=r"range\(1\)"):
        accumulate(np.array([1]), np.array([1.0]), 1)
    with pytest.raises(ValueError, match=r"range\(1\)"):
        accumulate(np.array([-1]), np.array([1.0]), 1)


finite_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)


@pytest.mark.parametrize("kernel_name", KERNELS)
@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3), st.one_of(finite_floats, st.sampled_from([math.inf, -math.inf, math.nan]))
        ),
        max_size=40,
    ),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_property_split_anyhow_merge_anyhow(kernel_name, rows, parts, rnd):
    groups = np.array([g for g, _ in rows], dtype=np.int64)
    values = np.array([v for _, v in rows], dtype=np.float64)
    with kernel_of(kernel_name):
        whole = accumulate(groups, values, 4)
        cuts = sorted(rnd.randint(0, len(rows)) for _ in range(parts - 1))
        bounds = [0, *cuts, len(rows)]
        states = [accumulate(groups[a:b], values[a:b], 4) for a, b in itertools.pairwise(bounds)]
    rnd.shuffle(states)
    folded = states[0]
    for s in states[1:]:
        folded = merge(s, folded) if rnd.random() < 0.5 else merge(folded, s)
    assert folded.equals(whole)
    check(whole, groups, values, 4)


# --- the two paths -----------------------------------------------------------------------


def both(groups: np.ndarray, values: np.ndarray, n_groups: int, *, squares: bool = True):
    """The state on the compiled path and on the pure numpy one."""
    with kernel_of("compiled"):
        compiled = accumulate(groups, values, n_groups, squares=squares)
    with kernel_of("numpy"):
        numpy_ = accumulate(groups, values, n_groups, squares=squares)
    return compiled, numpy_


def assert_same_state(a: ExactState, b: ExactState) -> None:
    """Equal arrays, dtypes included (``equals`` compares values only)."""
    assert a.equals(b)
    for name in ("count", "nan", "pos_inf", "neg_inf"):
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    for da, db in ((a.sum_digits, b.sum_digits), (a.squares, b.squares)):
        if da is None or db is None:
            assert da is db
            continue
        for name in ("sign", "low", "size", "digits"):
            assert getattr(da, name).dtype == getattr(db, name).dtype, name


def _shape(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """Rows of one random shape: 0 to 3,000 groups (some empty), 0 to 20,000 rows, groups
    of one row or of most rows, values from any family, sorted or shuffled."""
    n_groups = int(rng.choice([0, 1, 2, 7, 300, 3000]))
    if n_groups == 0:
        return np.zeros(0, np.int64), np.zeros(0), 0
    rows = int(rng.choice([0, 1, 5, 1000, 20_000]))
    kind = rng.integers(0, 3)
    if kind == 0:  # uniform
        groups = rng.integers(0, n_groups, rows)
    elif kind == 1:  # one group holds most rows, the others one each
        groups = np.where(rng.random(rows) < 0.9, 0, rng.integers(0, n_groups, rows))
    else:  # sorted, as a partition's rows often are
        groups = np.sort(rng.integers(0, n_groups, rows))
    if not rows:
        return groups.astype(np.int64), np.zeros(0), n_groups
    names = rng.choice(FAMILIES, int(rng.integers(1, 4)))
    values = np.resize(np.concatenate([_family(rng, str(name), rows) for name in names]), rows)
    return groups.astype(np.int64), rng.permutation(values), n_groups


@pytest.mark.parametrize("seed", range(40))
def test_the_two_paths_give_the_same_state_on_random_shapes(seed):
    if COMPILED is None:
        pytest.skip(NOT_BUILT)
    rng = np.random.default_rng(1000 + seed)
    for _ in range(5):
        groups, values, n_groups = _shape(rng)
        for squares in (True, False):
            assert_same_state(*both(groups, values, n_groups, squares=squares))


def test_the_two_paths_give_the_same_state_on_the_generator():
    if COMPILED is None:
        pytest.skip(NOT_BUILT)
    for seed in range(200, 230):
        groups, values, n_groups = generate(seed, n_groups=200)
        assert_same_state(*both(groups, values, n_groups))


any_float = st.integers(0, 2**64 - 1).map(lambda b: float(np.uint64(b).view(np.float64)))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.one_of(any_float, finite_floats)), max_size=60),
    st.integers(0, 4),
    st.booleans(),
)
def test_property_the_two_paths_give_the_same_state(rows, spare_groups, squares):
    """Any bits (NaNs of any payload, infinities, subnormals, -0.0), any groups."""
    if COMPILED is None:
        pytest.skip(NOT_BUILT)
    groups = np.array([g for g, _ in rows], dtype=np.int64)
    values = np.array([v for _, v in rows], dtype=np.float64)
    n_groups = int(groups.max(initial=-1)) + 1 + spare_groups
    compiled, numpy_ = both(groups, values, n_groups, squares=squares)
    assert_same_state(compiled, numpy_)


def test_millions_of_rows_in_a_group_on_both_paths():
    """3 million rows, most in one group, of every exponent and sign (and cancelling): the
    compiled path's int64 digits take a piece a row each, as numpy's bins do."""
    if COMPILED is None:
        pytest.skip(NOT_BUILT)
    rng = np.random.default_rng(5)
    n = 3_000_000
    bits = rng.integers(0, 2**63 - 1, n, dtype=np.int64) | (rng.integers(0, 2, n) << 63)
    values = bits.view(np.float64)
    values = np.where(np.isfinite(values), values, 2.5)
    values[: n // 2] = rng.normal(0, 1e6, n // 2)
    values[n // 2 : n // 2 + 1000] = -values[:1000]
    groups = np.where(rng.random(n) < 0.95, 0, rng.integers(0, 5, n)).astype(np.int64)
    compiled, numpy_ = both(groups, values, 5)
    assert_same_state(compiled, numpy_)
    big = np.full(n, math.ldexp(2**53 - 1, 970))  # all 53 bits set, near MAX: every digit at its bound
    compiled, numpy_ = both(np.zeros(n, np.int64), big, 1)
    assert_same_state(compiled, numpy_)
    assert compiled.sum_digits.to_ints()[0] * Fraction(2) ** exact.SUM_BASE == Fraction(big[0]) * n


def test_inputs_of_other_layouts_give_the_same_state(kernel):
    """Strided views, int32 ids, float32 and big-endian values: converted, not misread."""
    groups, values, n_groups = generate(12, n_groups=100)
    want = accumulate(groups[::2].copy(), values[::2].copy(), n_groups)
    assert accumulate(groups[::2], values[::2], n_groups).equals(want)
    assert accumulate(groups[::2].astype(np.int32), values[::2].astype(">f8"), n_groups).equals(want)
    with np.errstate(over="ignore"):  # past float32's range: inf, on both sides
        small = values[::2].astype(np.float32)
    assert accumulate(groups[::2], small, n_groups).equals(
        accumulate(groups[::2].copy(), small.astype(np.float64), n_groups)
    )
    with pytest.raises(ValueError, match="one length"):
        accumulate(groups, values[:-1], n_groups)


def test_the_version_says_which_path_is_in_use(tmp_path):
    def version(**env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "metriclog", "--version"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**os.environ, "METRICLOG_PURE": "", **env},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert version(METRICLOG_PURE="1").endswith("(exact sums: pure numpy)")
    built = "compiled" if COMPILED is not None else "pure numpy"
    assert version().endswith(f"(exact sums: {built})")


def test_threads_accumulating_at_once_get_their_own_states(kernel):
    """The compiled path lets go of the GIL while it adds, and keeps scratch memory between
    calls: calls on several threads at once, of different sizes, each give the state a
    call alone gives."""
    from concurrent.futures import ThreadPoolExecutor

    inputs = [generate(300 + i, n_groups=[50, 400, 3000][i % 3]) for i in range(12)]
    alone = [accumulate(g, v, n) for g, v, n in inputs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            together = list(pool.map(lambda args: accumulate(*args), inputs))
            assert all(a.equals(b) for a, b in zip(alone, together, strict=True))


@pytest.mark.parametrize("rows", [2047, 2048, 4096, 4097])
def test_groups_about_the_rows_where_a_carry_digit_is_added(rows, kernel):
    """From 2**11 rows a group's span gains a digit on top for carries (compiled path;
    4097 rows would not fit without it): values whose pieces are widest (53 bits set, every
    alignment to the digits), all of one sign, give the exact sum either side of it."""
    align = np.arange(32)
    base = np.ldexp(np.full(32, float(2**53 - 1)), align + 40)
    values = np.repeat(base, rows)
    groups = np.repeat(align, rows)
    for sign in (1, -1):
        state = accumulate(groups, sign * values, 32)
        for g, s in enumerate(state.sum_digits.to_ints()):
            assert Fraction(s) * Fraction(2) ** exact.SUM_BASE == sign * Fraction(base[g]) * rows
        check(state, groups, sign * values, 32)
