"""The compiled merge and finish (``_exact.c``: ``add_digits``, ``finish``) against the
oracle of ``tests.test_exact`` (``fractions`` and ``math.isqrt``) and against the pure
numpy path, which stays the reference: the same states, the same bits.

The cases aim at the C code's branches: sums and means that round into subnormals or to
zero (a tie at half the least subnormal), means of a few digits over counts larger than
their top digit, results past the range, -0.0, NaN and infinities, counts of 1, stds of
equal values (a variance of exactly zero), of values whose variance is tiny beside their
squares (D's bits far below its terms) and of values at both ends of the exponent range
(D of a hundred digits), and groups whose merged sums cancel to an exact zero.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from metric_core.offline.engine import exact
from metric_core.offline.engine.exact import accumulate, combine
from tests.test_exact import COMPILED, NOT_BUILT, TINY, assert_bits, check, generate, kernel_of

MAX = np.finfo(np.float64).max
EDGES = [
    [TINY],  # a subnormal sum, count 1
    [TINY, 0.0, 0.0],  # a mean of a third of the least subnormal: 0.0
    [TINY, -0.0],  # a mean of exactly half the least subnormal: a tie, to the even 0.0
    [-TINY, 0.0, 0.0],  # ... negative: -0.0
    [3 * TINY, 0.0],  # a tie at 1.5 subnormals: to 2
    [TINY] * 3 + [0.0] * 4,  # 3/7 of the least subnormal: 0.0
    [2.0**-1022, -TINY],  # the largest subnormal
    [-0.0],
    [-0.0, 0.0],
    [0.0] * 5,
    [MAX, MAX],  # a sum past the range: inf; mean MAX
    [-MAX, -MAX, -MAX],
    [MAX, -MAX, MAX],
    [1e308, -1e308],  # squares near 1e616, a std of 1e308
    [1e-300, 1e300],
    [TINY, MAX],  # the whole range in one group
    [0.1] * 7,  # equal values: std exactly 0
    [3.0],
    [1e12, 1e12 + 1e-4],  # a variance tiny beside the squares
    [1e12 + 0.25 * k for k in range(40)],
    [1.0, 2.0**-60, -(2.0**-60)],
    [2.0**53, 1.0],  # a tie in the sum: to even
    [2.0**53, 1.0, 2.0**-1000],  # ... broken by a far bit
    [math.nan, 1.0],
    [math.inf, 1.0],
    [math.inf, -math.inf],
    [-math.inf, 2.0],
    [5.0, -5.0],  # a sum of zero, a std of 5
    [1.0, 3.0],  # a std exactly a float
    [TINY, 0.0],  # a std exactly half the least subnormal: a tie, to 0.0
    [TINY, TINY, 0.0, 0.0],  # std of TINY/2 again, from four rows
    [TINY, 2 * TINY, 0.0],
    list(range(1, 3000)),  # many rows: the mean and the std divide by a count of 12 bits
]


def _rows(groups_values: list[list[float]]) -> tuple[np.ndarray, np.ndarray, int]:
    g = np.concatenate([np.full(len(v), i) for i, v in enumerate(groups_values)])
    v = np.concatenate([np.asarray(v, dtype=np.float64) for v in groups_values])
    return g, v, len(groups_values)


def _scaled_pairs() -> list[list[float]]:
    """Pairs and triples of values at every scale: every shift of D, every window of the
    mean's division, results that are subnormal or near the top of the range."""
    rng = np.random.default_rng(7)
    out = []
    for e in range(-1074, 1024, 23):
        if e > -1022:
            a = math.ldexp(float(rng.uniform(1, 2)), e)
        else:
            a = math.ldexp(float(rng.integers(1, 9)), -1074)
        b = math.ldexp(float(rng.uniform(1, 2)), max(e - int(rng.integers(0, 60)), -1074))
        out.append([a, b])
        out.append([a, -b, a])
        out.append([a] * int(rng.integers(2, 9)) + [b])
    return out


@pytest.mark.parametrize("kernel_name", ["compiled", "numpy"])
@pytest.mark.parametrize("cases", ["edges", "scaled"])
def test_every_edge_is_correctly_rounded(kernel_name, cases):
    groups, values, n_groups = _rows(EDGES if cases == "edges" else _scaled_pairs())
    with kernel_of(kernel_name):
        check(accumulate(groups, values, n_groups), groups, values, n_groups)


def _both_ways(state: exact.ExactState) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    found = {}
    for name in ("sum", "mean", "std"):
        with kernel_of("compiled"):
            compiled = getattr(state, name)()
        with kernel_of("numpy"):
            numpy = getattr(state, name)()
        found[name] = compiled, numpy
    return found


@pytest.mark.skipif(COMPILED is None, reason=NOT_BUILT)
@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_finish_gives_the_numpy_bits(seed):
    """The same states finished both ways: every group of every family alike (the
    generator's 18 families, mixes, empty groups)."""
    groups, values, n_groups = generate(300 + seed, n_groups=3000)
    with kernel_of("numpy"):
        state = accumulate(groups, values, n_groups)
    for name, (compiled, numpy) in _both_ways(state).items():
        assert_bits(compiled, numpy, name)


@pytest.mark.skipif(COMPILED is None, reason=NOT_BUILT)
@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_merge_gives_the_numpy_state(seed):
    """Rows split into parts (each numbering its own groups), the parts' states combined
    both ways, in a shuffled order, several parts to a group and some groups cancelling
    to an exact zero: equal states, and equal to the whole's."""
    rng = np.random.default_rng(seed)
    groups, values, n_groups = generate(400 + seed, n_groups=800)
    cancel = rng.choice(n_groups, 40, replace=False)  # groups whose values come back negated
    extra = np.isin(groups, cancel) & np.isfinite(values)
    groups = np.concatenate([groups, groups[extra]])
    values = np.concatenate([values, -values[extra]])
    with kernel_of("numpy"):
        whole = accumulate(groups, values, n_groups)
    part_of = rng.integers(0, 7, len(groups))
    states, maps = [], []
    for p in rng.permutation(7):
        rows = part_of == p
        mine, local = np.unique(groups[rows], return_inverse=True)
        with kernel_of("numpy"):
            states.append(accumulate(local, values[rows], len(mine)))
        maps.append(mine)
    with kernel_of("compiled"):
        compiled = combine(states, maps, n_groups)
    with kernel_of("numpy"):
        numpy = combine(states, maps, n_groups)
    assert compiled.equals(numpy)
    assert compiled.equals(whole)
    assert (compiled.sum_digits.sign[cancel] == 0).all()  # their finite values cancel: exact zeros
    check(compiled, groups, values, n_groups)


@pytest.mark.skipif(COMPILED is None, reason=NOT_BUILT)
@pytest.mark.parametrize("seed", range(3))
def test_a_group_one_part_reaches_is_copied_and_equals_the_added_one(seed):
    """Groups that one part reaches (copied as they are by the extension), beside groups
    that two reach and groups none reaches, in a shuffled mapping: the state numpy's
    merge gives (it adds every group), and the integers themselves. Parts whose digits
    are not canonical (a zero digit at either end, an exact zero with a digit) are carried
    as the sum of several parts is: the same canonical state."""
    rng = np.random.default_rng(seed)
    groups, values, n_groups = generate(500 + seed, n_groups=600)
    with kernel_of("numpy"):
        state = accumulate(groups, values, n_groups)
    target = rng.permutation(3 * n_groups)[:n_groups]  # a third of the groups reached
    twice = rng.choice(n_groups, 50, replace=False)  # ... these by a second part too
    other = state.take(twice)
    maps = [target, target[twice]]
    with kernel_of("numpy"):
        numpy = combine([state, other], maps, 3 * n_groups)
    expected = [0] * (3 * n_groups)
    for g, value in enumerate(state.sum_digits.to_ints()):
        expected[target[g]] += value
    for g, value in zip(twice.tolist(), other.sum_digits.to_ints(), strict=True):
        expected[target[g]] += value
    padded = exact.ExactState(
        state.count, state.nan, state.pos_inf, state.neg_inf, _padded(state.sum_digits, rng), state.squares
    )
    for first in (state, padded):
        with kernel_of("compiled"):
            compiled = combine([first, other], maps, 3 * n_groups)
        assert compiled.equals(numpy)
        assert compiled.sum_digits.to_ints() == expected


def _padded(d: exact.Digits, rng: np.random.Generator) -> exact.Digits:
    """``d`` with a zero digit added below or above some groups' digits (the same integers,
    not in canonical form), and an exact zero given one zero digit."""
    pad = rng.integers(0, 3, len(d))  # 0: as it is, 1: a zero below, 2: a zero above
    pad[d.size == 0] = 0
    zero = np.flatnonzero(d.size == 0)[:5]
    pieces, start = [], 0
    for g, end in enumerate(d.ends().tolist()):
        mine = d.digits[start:end]
        if pad[g] == 1:
            mine = np.r_[np.uint32(0), mine]
        elif pad[g] == 2:
            mine = np.r_[mine, np.uint32(0)]
        elif g in zero:
            mine = np.zeros(1, np.uint32)
        pieces.append(mine.astype(np.uint32))
        start = end
    size = d.size + (pad > 0)
    size[zero] = 1
    low = d.low - (pad == 1)
    return exact.Digits(d.sign.copy(), low.astype(np.int16), size.astype(np.uint8), np.concatenate(pieces))


@pytest.mark.skipif(COMPILED is None, reason=NOT_BUILT)
def test_the_compiled_merge_refuses_what_numpy_refuses():
    state = accumulate(np.array([0, 1]), np.array([1.0, 2.0]), 2)
    for name in ("compiled", "numpy"):
        with kernel_of(name), pytest.raises(ValueError, match=r"range\(2\)"):
            combine([state], [np.array([0, 2])], 2)


def test_a_range_of_groups_taken_is_those_groups():
    """take of consecutive groups (slices, the accumulator's usual take) against the
    integers themselves; a state whose digit ends were computed pickles without them."""
    import pickle

    groups, values, n_groups = generate(9, n_groups=200)
    state = accumulate(groups, values, n_groups)
    ints = state.sum_digits.to_ints()
    for lo, hi in ((0, 200), (0, 1), (5, 20), (199, 200), (37, 38), (60, 180)):
        part = state.take(np.arange(lo, hi))
        assert part.sum_digits.to_ints() == ints[lo:hi]
        assert part.equals(state.take(np.arange(lo, hi)[::-1]).take(np.arange(hi - lo)[::-1]))
    assert "_ends" in state.sum_digits.__dict__
    back = pickle.loads(pickle.dumps(state))
    assert "_ends" not in back.sum_digits.__dict__ and back.equals(state)
