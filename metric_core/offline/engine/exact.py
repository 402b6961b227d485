"""Exact sums and sums of squares of float64 values, per group, rounded once at the end.

A group's state is its count, its counts of NaN, +inf and -inf, and two exact integers:
the sum ``S`` and the sum of squares ``Q`` of its finite values, each a whole number of
units (``S`` of ``2**SUM_BASE``, ``Q`` of ``2**SQUARE_BASE``). Every finite float64 is
``M * 2**E`` with ``M`` an integer below 2**53 and ``E >= -1074``, its square ``M**2 *
2**(2E)`` with ``2E >= -2148``: both are whole numbers of those units, so ``S`` and ``Q``
are exact, and adding two states is adding integers. The result does not depend on how
the values were split into states or in which order the states were added: the same
values give the same state, bit for bit, and the same statistics.

Representation (``Digits``, one integer per group, numpy arrays only so a state pickles
small and crosses threads and Ray tasks): sign and magnitude, the magnitude in base 2**32
digits, only those from its lowest nonzero digit to its highest (``low``: the position of
the lowest, digit ``j`` of a group weighs ``2**(32 * (low + j))`` units; ``size``: how many;
``digits``: the groups' digits one group after another, lowest first). That form is unique,
so equal integers are equal arrays. A group's digits span its values' exponents: two to
four digits for most groups, at most 68 for a sum and 136 for a sum of squares.

How a value enters (``accumulate``), straight into digits: from its bits, ``M`` and ``E``
(subnormals have no hidden bit). ``M * 2**(s mod 32)``, ``s`` the value's offset from the
units, is under 2**85: three pieces under 2**32 at digits ``s // 32`` and the two above.
``M**2`` is four 32-bit limbs from integer products (``M = h * 2**32 + l``, ``l * l`` in
uint64, ``2 h l`` and ``h * h`` under 2**55), never ``v * v``; shifted by the square's even
offset (at most 30 bits: each shifted limb stays under 2**62) it is five pieces under
2**32. Equal (group, digit) pieces are added by ``np.bincount`` over float64 weights,
positive and negative values in separate bins: each bin adds at most
``ROWS_PER_BINCOUNT`` = 2**21 pieces under 2**32, so every partial sum is an integer under
2**53 and float64 holds it exactly. Those bins go to int64 (exact) and add there: a row
gives a digit one piece at most, so a digit of a group of fewer than 2**31 rows
(``MAX_COUNT``) stays under 2**63.

Where many rows share a group and an exponent (``_window``: at least ``_ROWS_A_BIN`` rows
a bin, most rows in a window of exponents), those rows are first added by (group, biased
exponent) bin (``_binned``), and only the bins' sums become digits as above. The sum: a
value is split in ``high`` (its bits but the low 26 of the significand: at most 27
significant bits, a multiple of ``2**(E-1075+26)``) and ``low = v - high`` (exact: the low
26 bits, a multiple of ``2**(E-1075)`` under ``2**(E-1075+26)``). In one bin every
``high`` is a multiple of one quantum and under 2**27 quanta, so the float64 sum of at
most 2**26 of them (``_BINNED_ROWS``) is a whole number of quanta under 2**53: exact, the
same for ``low``; below exponent ``_BINNED_TOP`` such a sum is finite, and it is a float64,
so it enters the digits as a value does. The square: its four limbs, each bin's sums of
at most 2**21 limbs under 2**32 exact in float64, then in int64 (under 2**58), enter as
integers ``L * 2**(2E-2150+32j)`` (``_sum_digits`` splits any ``L`` under 2**63 in three
pieces). Either way the state is the same integers, so the same arrays.

Carries (``_canonical``): each digit but a group's top one keeps its value mod 2**32 and
passes the rest up (an arithmetic shift: floor division, exact on int64); the top digit
takes what reaches it. Every group is given one digit above its highest piece, and a sum
of fewer than 2**31 terms each under 2**(32 t) is under 2**(32 t + 31): the top digit
never needs to pass anything on. Then a group whose top digit is negative is negated and
carried again, which gives its magnitude, and the zero digits at both ends are dropped.

Merging (``merge``, ``combine``): a group that one state's nonzero integer reaches takes
its digits as they are (canonical already: a fold copies the accumulator's untouched
groups, it does not carry them again). Where several reach one group, their digits,
signed, are added as int64 (positions aligned by ``low``, one more digit on top), then
carried as above: fewer than 2**31 digits under 2**32 added stay under 2**63. Counts add
in float64 bins, exact below 2**53.

Rounding (``sum``, ``mean``, ``std``), vectorised over groups, once:

- ``sum``: the magnitude's top three digits, shifted so the leading one is bit 95, give
  a 62-bit window (int64) and a sticky bit for every nonzero bit below it (any lower digit
  at all: the lowest digit of the form is nonzero). int64 to float64 rounds to nearest
  even (53 of the 62 bits; the sticky bit in bit 0 breaks false ties) and ``np.ldexp``
  scales exactly, or to +-inf past the range. Results below 2**-1022 are rounded in
  integers to a multiple of 2**-1074 instead, so nothing is rounded twice.
- ``mean``: long division of the magnitude's top four digits by the count (``r << 32 |
  digit`` stays under 2**63 for counts under 2**31), the remainder and the digits not used
  as the sticky bit, then the same window.
- ``std`` (population): ``D = n Q - S**2`` exactly (``_spread``: groups of like widths
  held dense, groups x digit columns, ``S**2`` from uint64 digit products split in 32-bit
  halves, carried in one pass from the lowest column), ``std = sqrt(D * 2**SQUARE_BASE) /
  n``. ``_quick``: D's top 62 bits (relative error under 2**-61, so under 2**-62 for the
  root) give the root and its quotient by n in double-double (Dekker's exact products;
  their own error is near 2**-100); where that is further than 2**-60 of itself from the
  midpoint between two floats, and the result is normal, it rounds as the exact root does.
  Else ``_settle``: for a candidate float ``c``, the midpoints ``m`` to its neighbours are
  dyadic, and ``std`` vs ``m`` is ``D`` vs ``(n m)**2`` (scaled), compared digit by digit
  (``_compare``); the candidate moves one float at a time until ``std`` lies between its
  midpoints (a tie goes to the even one).

Two paths accumulate, merge and round, with the same result bit for bit (the digits'
form is unique, and so is a correctly rounded float): the numpy one above, and a
compiled one (``_exact.c``, built at install where a C compiler is there) that adds each
value's pieces into int64 digits of its group's span in one pass, adds states' digits
into int64 spans of their target groups and carries them, and rounds each group's sum,
mean or std in integers (a group at a time: the std's root from a 128-bit integer square
root of D's top bits over n**2). ``path()`` says which is in use; ``METRICLOG_PURE=1``
forces numpy, which stays the reference.

Counts of 2**31 or more in one group take Python integers (``_python_mean``,
``_python_std``), as does nothing else. Non-finite: a NaN, or both infinities, gives NaN;
one infinity gives that infinity for the sum and the mean, NaN for std. A group of no
rows: sum 0.0, mean and std NaN. An exact zero is +0.0.

>>> state = accumulate(np.array([0, 0, 1]), np.array([0.1, 0.2, 3.0]), 2)
>>> state.sum().tolist(), state.mean().tolist()
([0.30000000000000004, 3.0], [0.15000000000000002, 3.0])
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from fractions import Fraction
from types import ModuleType

import numpy as np

_native: ModuleType | None
try:  # the compiled path, where the extension was built (setup.py)
    from . import _exact as _native
except ImportError:
    _native = None
if os.environ.get("METRICLOG_PURE", "") not in ("", "0"):
    _native = None

SUM_BASE = -1088  # the sum's unit: 2**SUM_BASE, at or below 2**-1074, a multiple of 32
SQUARE_BASE = 2 * SUM_BASE  # the squares' unit, at or below 2**-2148; S**2 is in it too
ROWS_PER_BINCOUNT = 1 << 21  # pieces under 2**32 a float64 bin adds without rounding
MAX_COUNT = (1 << 31) - 1  # rows of one group in one accumulate call (see the docstring)
_VECTOR_COUNT = MAX_COUNT  # counts above this are finished in Python integers
_MASK = np.int64(0xFFFFFFFF)
_FRACTION = np.int64((1 << 52) - 1)
_HIDDEN = np.int64(1 << 52)
_SPARSE_BINS = 1 << 22  # past this many bins (and 4 a row), each group gets its own span
# Binning by (group, exponent) first: at most this many rows a call (a bin's float64 sum of
# halves under 2**27 stays exact), exponents below _BINNED_TOP (such a sum stays finite),
# at most _WIDEST exponents, and only where there are _ROWS_A_BIN rows a bin or more
_BINNED_ROWS = 1 << 26
_BINNED_TOP = 2019
_WIDEST = 64
_ROWS_A_BIN = 4
_HALF_MASK = (1 << 26) - 1
_STD_BATCH = 1 << 15  # groups whose n Q - S**2 are held dense at once


@dataclass(frozen=True, eq=False)
class Digits:
    """One exact integer a group, sign and magnitude in base 2**32 (the module docstring).

    ``sign`` (int8: -1, 0, 1), ``low`` (int16: the lowest digit's position), ``size``
    (uint8: how many digits), ``digits`` (uint32: the groups' magnitudes, lowest first).
    """

    sign: np.ndarray
    low: np.ndarray
    size: np.ndarray
    digits: np.ndarray

    @classmethod
    def zeros(cls, n_groups: int) -> Digits:
        return cls(
            np.zeros(n_groups, np.int8),
            np.zeros(n_groups, np.int16),
            np.zeros(n_groups, np.uint8),
            np.zeros(0, np.uint32),
        )

    def __len__(self) -> int:
        return len(self.sign)

    def ends(self) -> np.ndarray:
        """Where each group's digits end in ``digits`` (its start is the previous end);
        computed once (a state is taken from many times, a slice of groups at a time)."""
        ends = self.__dict__.get("_ends")
        if ends is None:
            ends = np.cumsum(self.size, dtype=np.int64)
            object.__setattr__(self, "_ends", ends)
        return ends  # type: ignore[no-any-return]

    def __getstate__(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # not the ends: pickled small

    def to_ints(self) -> list[int]:
        """The integers, as Python ints (the slow, obviously right reading)."""
        out, ends = [], self.ends().tolist()
        start = 0
        for g, end in enumerate(ends):
            magnitude = 0
            for d in reversed(self.digits[start:end].tolist()):
                magnitude = (magnitude << 32) | d
            out.append(int(self.sign[g]) * (magnitude << (32 * int(self.low[g]))))
            start = end
        return out

    def equals(self, other: Digits) -> bool:
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    def take(self, groups: np.ndarray) -> Digits:
        groups = np.asarray(groups, dtype=np.int64)
        n = len(groups)
        if n and groups[-1] - groups[0] == n - 1 and (n == 1 or (np.diff(groups) == 1).all()):
            lo, hi = int(groups[0]), int(groups[-1]) + 1  # a range of groups: slices (copied)
            ends = self.ends()
            first = int(ends[lo - 1]) if lo else 0
            return Digits(
                self.sign[lo:hi].copy(), self.low[lo:hi].copy(), self.size[lo:hi].copy(),
                self.digits[first : int(ends[hi - 1])].copy(),
            )  # fmt: skip
        size = self.size[groups]
        starts = self.ends()[groups] - size
        return Digits(self.sign[groups], self.low[groups], size, self.digits[_ranges(starts, size)])

    def signed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each digit as a signed int64, its group and its position."""
        size = self.size.astype(np.int64)
        group = np.repeat(np.arange(len(self), dtype=np.int64), size)
        value = self.digits.astype(np.int64)
        value *= self.sign[group]
        position = self.low[group] + _within(size)
        return value, group, position


@dataclass(frozen=True, eq=False)
class ExactState:
    """The exact states of ``n_groups`` groups (group i is entry i of every array).

    ``count`` counts every row, non-finite ones too; ``nan``, ``pos_inf``, ``neg_inf``
    count those; ``sum_digits`` holds the sum of the finite values in units of
    2**SUM_BASE and ``squares`` the sum of their squares in units of 2**SQUARE_BASE, or
    None where the squares were not kept (``std`` then refuses; merging a state without
    them into one with them counts them as zero, so only a group whose every part kept
    them has a std to read: the engine keeps them for every part of a std group).
    """

    count: np.ndarray
    nan: np.ndarray
    pos_inf: np.ndarray
    neg_inf: np.ndarray
    sum_digits: Digits
    squares: Digits | None

    @classmethod
    def empty(cls, n_groups: int, *, squares: bool = True) -> ExactState:
        zero = np.zeros(n_groups, np.int64)
        return cls(
            zero, zero.copy(), zero.copy(), zero.copy(), Digits.zeros(n_groups),
            Digits.zeros(n_groups) if squares else None,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.count)

    def equals(self, other: ExactState) -> bool:
        """Whether both hold the same groups' states, bit for bit."""
        counts = ("count", "nan", "pos_inf", "neg_inf")
        if not all(np.array_equal(getattr(self, c), getattr(other, c)) for c in counts):
            return False
        if (self.squares is None) != (other.squares is None):
            return False
        if self.squares is not None and not self.squares.equals(other.squares):  # type: ignore[arg-type]
            return False
        return self.sum_digits.equals(other.sum_digits)

    def take(self, groups: np.ndarray) -> ExactState:
        """The states of ``groups`` (indices, in that order)."""
        groups = np.asarray(groups, dtype=np.int64)
        return ExactState(
            self.count[groups], self.nan[groups], self.pos_inf[groups], self.neg_inf[groups],
            self.sum_digits.take(groups), None if self.squares is None else self.squares.take(groups),
        )  # fmt: skip

    def sum(self, where: np.ndarray | None = None) -> np.ndarray:
        """Each group's sum, correctly rounded to float64 (module docstring). ``where``: a
        mask of the groups wanted (the others' entries are then unspecified): only those
        are finished, none copied."""
        s = self.sum_digits
        out = np.zeros(len(self))
        if _native is not None:
            _finish_compiled(0, s, self._counted(where), out)
            return self._nonfinite(out, spread=False)
        if where is not None:
            return self._of_taken("sum", where)
        ends = s.ends()
        some = np.flatnonzero(s.size)
        if len(some):
            k = s.size[some].astype(np.int64)
            top = ends[some] - 1
            a2, a1, a0 = (_digit_at(s.digits, top - j, k > j) for j in range(3))
            exp0 = 32 * (s.low[some].astype(np.int64) + k - 3) + SUM_BASE
            out[some] = _round_window(a2, a1, a0, k > 3, exp0) * s.sign[some]
        return self._nonfinite(out, spread=False)

    def mean(self, where: np.ndarray | None = None) -> np.ndarray:
        """Each group's mean, its exact sum divided by its count, correctly rounded
        (``where``: as ``sum``'s)."""
        if where is not None and _native is None:
            return self._of_taken("mean", where)
        s = self.sum_digits
        with np.errstate(invalid="ignore"):
            out = np.where(self.count > 0, 0.0, np.nan)
        some = np.flatnonzero(s.size if where is None else (s.size > 0) & where)
        big = some[self.count[some] > _VECTOR_COUNT]
        some = some[self.count[some] <= _VECTOR_COUNT]
        if _native is not None:  # the groups of counts 1 .. _VECTOR_COUNT
            _finish_compiled(1, s, self._counted(where), out)
            some = some[:0]
        if len(some):
            n = self.count[some]
            k = s.size[some].astype(np.int64)
            top = s.ends()[some] - 1
            remainder = np.zeros(len(some), np.int64)
            q = []
            for j in range(4):  # the top four digits, zeros past the lowest
                r = (remainder << 32) | _digit_at(s.digits, top - j, k > j)
                q.append(r // n)
                remainder = r - q[-1] * n
            rest = (remainder != 0) | (k > 4)
            exp0 = 32 * (s.low[some].astype(np.int64) + k - 4) + SUM_BASE  # q[3]'s unit
            lead = q[0] != 0  # else q[1] is: two digits over n < 2**32 are at least 2
            a2 = np.where(lead, q[0], q[1])
            a1 = np.where(lead, q[1], q[2])
            a0 = np.where(lead, q[2], q[3])
            rest |= lead & (q[3] != 0)
            out[some] = _round_window(a2, a1, a0, rest, exp0 + 32 * lead) * s.sign[some]
        for g in big.tolist():
            out[g] = _python_mean(self, g)
        return self._nonfinite(out, spread=False)

    def std(self, where: np.ndarray | None = None) -> np.ndarray:
        """Each group's population standard deviation, the correctly rounded square root
        of its exact variance (``where``: as ``sum``'s)."""
        if self.squares is None:
            raise ValueError("std needs the sums of squares: accumulate(..., squares=True)")
        if where is not None and _native is None:
            return self._of_taken("std", where)
        with np.errstate(invalid="ignore"):
            out = np.where(self.count > 0, 0.0, np.nan)
        finite = (self.nan | self.pos_inf | self.neg_inf) == 0
        wanted = (self.squares.size > 0) & finite & (self.count > 0)
        some = np.flatnonzero(wanted if where is None else wanted & where)
        big = some[self.count[some] > _VECTOR_COUNT]
        some = some[self.count[some] <= _VECTOR_COUNT]
        if _native is not None and len(some):  # those groups alone: the others' counts as 0
            counted = np.zeros(len(self), np.int64)
            counted[some] = self.count[some]
            _finish_compiled(2, self.sum_digits, counted, out, self.squares)
            some = some[:0]
        if len(some):
            out[some] = _std(self.sum_digits.take(some), self.squares.take(some), self.count[some])
        for g in big.tolist():
            out[g] = _python_std(self, g)
        return self._nonfinite(out, spread=True)

    def _counted(self, where: np.ndarray | None) -> np.ndarray:
        """The counts, 0 outside ``where``: the extension finishes groups of count 0 as
        they are."""
        return self.count if where is None else np.where(where, self.count, 0)

    def _of_taken(self, name: str, where: np.ndarray) -> np.ndarray:
        """Statistic ``name`` of the groups ``where``, from a copy of theirs (numpy's way)."""
        at = np.flatnonzero(where)
        out = np.full(len(self), np.nan)
        out[at] = getattr(self.take(at), name)()
        return out

    def _nonfinite(self, out: np.ndarray, *, spread: bool) -> np.ndarray:
        pos, neg = self.pos_inf > 0, self.neg_inf > 0
        if spread:
            out[pos | neg] = np.nan
        else:
            out[pos & ~neg] = np.inf
            out[neg & ~pos] = -np.inf
            out[pos & neg] = np.nan
        out[self.nan > 0] = np.nan
        return out


def accumulate(groups: np.ndarray, values: np.ndarray, n_groups: int, *, squares: bool = True) -> ExactState:
    """The exact states of ``n_groups`` groups from rows: ``values[i]`` is in group ``groups[i]``.

    Args:
        groups: int64 group ids, each in ``range(n_groups)``.
        values: float64 values, one a group id.
        n_groups: how many groups the state has (groups with no rows are empty).
        squares: keep the sums of squares (what ``std`` needs).

    >>> s = accumulate(np.array([0, 0, 0]), np.array([1e16, 1.0, -1e16]), 1)
    >>> s.sum().tolist(), s.std().tolist()
    ([1.0], [8164965809277260.0])
    """
    g = np.asarray(groups, dtype=np.int64)
    v = np.ascontiguousarray(values, dtype=np.float64)
    if g.shape != v.shape or g.ndim != 1:
        raise ValueError(f"groups and values must be 1-d and of one length, not {g.shape} and {v.shape}")
    if _native is not None:
        return _compiled(g, v, n_groups, squares)
    if len(g) and (g.min() < 0 or g.max() >= n_groups):
        raise ValueError(f"group ids must be in range({n_groups})")
    count = np.bincount(g, minlength=n_groups)
    if count.max(initial=0) > MAX_COUNT:
        raise ValueError(f"a group holds more than {MAX_COUNT} rows: accumulate them in parts and merge")
    bits = v.view(np.int64)
    biased = (bits >> 52) & 0x7FF
    special = biased == 0x7FF
    zero = np.zeros(n_groups, np.int64)
    nan, pos_inf, neg_inf = zero, zero.copy(), zero.copy()
    if special.any():
        rows = np.flatnonzero(special)
        sv, sg = v[rows], g[rows]
        nan = np.bincount(sg[np.isnan(sv)], minlength=n_groups)
        pos_inf = np.bincount(sg[sv == np.inf], minlength=n_groups)
        neg_inf = np.bincount(sg[sv == -np.inf], minlength=n_groups)
        keep = ~special
        g, bits, biased = g[keep], bits[keep], biased[keep]
    sum_rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    square_rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    window = _window(biased, n_groups)
    if window is not None:  # most rows binned by (group, exponent) first
        outside = (biased < window[0]) | (biased >= window[0] + window[1])
        sum_rows, square_rows = _binned(g, bits, biased, outside, window, n_groups, squares)
        rest = np.flatnonzero(outside)
        g, bits, biased = g[rest], bits[rest], biased[rest]
    m, e = _significands(bits, biased)
    sum_rows.append((g, m, e + (-1075 - SUM_BASE), bits < 0))
    group, mantissa, offset, negative = (np.concatenate(c) for c in zip(*sum_rows, strict=True))
    sums = _sum_digits(group, mantissa, offset, negative, n_groups)
    sq = None
    if squares and not square_rows:
        sq = _square_digits(g, m, 2 * e + (-2150 - SQUARE_BASE), n_groups)
    elif squares:  # the rows outside the window as limbs too: one carrying for all
        limbs = _square_limbs(m)
        square_rows += [(g, limbs[j], 2 * e + (-2150 - SQUARE_BASE) + 32 * j) for j in range(4)]
        group, limb, offset = (np.concatenate(c) for c in zip(*square_rows, strict=True))
        sq = _sum_digits(group, limb, offset, np.zeros(len(group), bool), n_groups)
    return ExactState(count, nan, pos_inf, neg_inf, sums, sq)


def merge(
    a: ExactState, b: ExactState, b_groups_in_a: np.ndarray | None = None, *, n_groups: int | None = None
) -> ExactState:
    """``a`` with ``b`` added: b's group j into a's group ``b_groups_in_a[j]`` (j itself
    where None). The result has ``n_groups`` groups (at least a's, and every target).

    >>> a = accumulate(np.array([0, 1]), np.array([0.1, 0.2]), 2)
    >>> b = accumulate(np.array([0]), np.array([0.7]), 1)
    >>> merge(a, b, np.array([1])).sum().tolist()
    [0.1, 0.8999999999999999]
    """
    mapping = np.arange(len(b)) if b_groups_in_a is None else np.asarray(b_groups_in_a, dtype=np.int64)
    if len(mapping) != len(b):
        raise ValueError(f"b_groups_in_a has {len(mapping)} entries for {len(b)} groups of b")
    wanted = max(len(a), int(mapping.max(initial=-1)) + 1)
    return combine([a, b], [np.arange(len(a)), mapping], wanted if n_groups is None else n_groups)


def combine(states: list[ExactState], mappings: list[np.ndarray], n_groups: int) -> ExactState:
    """The states added into ``n_groups`` groups: group j of ``states[i]`` goes to group
    ``mappings[i][j]`` (several groups may go to one: they add)."""
    maps = [np.asarray(m, dtype=np.int64) for m in mappings]
    if len(maps) != len(states) or any(len(m) != len(s) for m, s in zip(maps, states, strict=True)):
        raise ValueError("combine needs one mapping a state, one entry a group")
    if any(len(m) and (m.min() < 0 or m.max() >= n_groups) for m in maps):
        raise ValueError(f"mappings must be in range({n_groups})")
    if not states:
        return ExactState.empty(n_groups)
    target = np.concatenate(maps)

    def added(name: str) -> np.ndarray:  # counts under 2**53: float64 adds them exactly
        weights = np.concatenate([getattr(s, name) for s in states]).astype(np.float64)
        return np.bincount(target, weights=weights, minlength=n_groups).astype(np.int64)

    count, nan, pos_inf, neg_inf = (added(name) for name in ("count", "nan", "pos_inf", "neg_inf"))
    add = _add_digits if _native is None else _add_compiled
    sums = add([s.sum_digits for s in states], maps, n_groups)
    kept = [(s.squares, m) for s, m in zip(states, maps, strict=True) if s.squares is not None]
    sq = add([q for q, _ in kept], [m for _, m in kept], n_groups) if kept else None
    return ExactState(count, nan, pos_inf, neg_inf, sums, sq)


def concat(states: list[ExactState]) -> ExactState:
    """The groups of ``states``, one state's after another's (squares kept only if all have them)."""
    squares = [s.squares for s in states if s.squares is not None]
    return ExactState(
        np.concatenate([s.count for s in states]),
        np.concatenate([s.nan for s in states]),
        np.concatenate([s.pos_inf for s in states]),
        np.concatenate([s.neg_inf for s in states]),
        _concat_digits([s.sum_digits for s in states]),
        _concat_digits(squares) if len(squares) == len(states) else None,
    )


def path() -> str:
    """Which path ``accumulate`` takes: "compiled" or "pure numpy" (``METRICLOG_PURE=1``,
    or no extension built)."""
    return "pure numpy" if _native is None else "compiled"


# --- accumulating -------------------------------------------------------------------


def _compiled(g: np.ndarray, v: np.ndarray, n_groups: int, squares: bool) -> ExactState:
    """``accumulate`` by the extension: it fills the groups' arrays and hands back the
    digits (the same arrays as the numpy path's, since their form is unique)."""
    g = np.ascontiguousarray(g)
    count, nan, pos_inf, neg_inf = (np.empty(n_groups, np.int64) for _ in range(4))
    kept = n_groups if squares else 0
    s_parts = np.empty(n_groups, np.int8), np.empty(n_groups, np.int16), np.empty(n_groups, np.uint8)
    q_parts = np.empty(kept, np.int8), np.empty(kept, np.int16), np.empty(kept, np.uint8)
    assert _native is not None
    s_digits, q_digits = _native.accumulate(
        g, v, n_groups, squares, count, nan, pos_inf, neg_inf, *s_parts, *q_parts
    )
    sums = Digits(*s_parts, np.frombuffer(s_digits, np.uint32))
    sq = None if q_digits is None else Digits(*q_parts, np.frombuffer(q_digits, np.uint32))
    return ExactState(count, nan, pos_inf, neg_inf, sums, sq)


def _add_compiled(parts: list[Digits], maps: list[np.ndarray], n_groups: int) -> Digits:
    """``_add_digits`` by the extension: every part's integers added into their groups and
    carried, a group that one canonical part reaches copied (the same arrays: the form is
    unique)."""
    assert _native is not None
    joined = _concat_digits(parts) if len(parts) != 1 else parts[0]
    target = np.concatenate(maps) if len(maps) != 1 else maps[0]
    sign, low, size = np.empty(n_groups, np.int8), np.empty(n_groups, np.int16), np.empty(n_groups, np.uint8)
    digits = _native.add_digits(
        *(np.ascontiguousarray(getattr(joined, f.name)) for f in fields(Digits)),
        np.ascontiguousarray(target, dtype=np.int64), n_groups, sign, low, size,
    )  # fmt: skip
    return Digits(sign, low, size, np.frombuffer(digits, np.uint32))


def _finish_compiled(
    kind: int, s: Digits, count: np.ndarray, out: np.ndarray, squares: Digits | None = None
) -> None:
    """Each group's sum (``kind`` 0), mean (1) or std (2) by the extension, into ``out``:
    of groups of count 1 or more only (``count``: 0 for a group not wanted), the mean and
    std of counts up to ``_VECTOR_COUNT`` only, the std of groups whose squares are nonzero
    only (the others are left as they are)."""
    assert _native is not None
    q = squares if squares is not None else Digits.zeros(0)
    _native.finish(
        kind, *(np.ascontiguousarray(getattr(s, f.name)) for f in fields(Digits)),
        np.ascontiguousarray(count, dtype=np.int64), min(_VECTOR_COUNT, MAX_COUNT),
        *(np.ascontiguousarray(getattr(q, f.name)) for f in fields(Digits)), out,
    )  # fmt: skip


def _significands(bits: np.ndarray, biased: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``m`` and ``e`` of finite values (their bits and biased exponents): each is ``m * 2**(e - 1075)``."""
    m = (bits & _FRACTION) | ((biased > 0).astype(np.int64) << 52)
    return m, np.maximum(biased, 1)


def _window(biased: np.ndarray, n_groups: int) -> tuple[int, int] | None:
    """The exponents (first, how many) whose rows are binned by (group, exponent) before
    they become digits, or None where binning would not pay: fewer than
    ``_ROWS_A_BIN`` rows a bin, or most rows outside any window."""
    rows = len(biased)
    if rows > _BINNED_ROWS or not rows:
        return None
    width = min(_WIDEST, rows // (_ROWS_A_BIN * max(n_groups, 1)))
    if width < 1:
        return None
    hist = np.bincount(biased, minlength=2048)[:_BINNED_TOP]
    total = np.concatenate([[0], np.cumsum(hist)])
    covered = total[width:] - total[:-width]
    first = int(np.argmax(covered))
    if covered[first] * 2 < rows:
        return None
    used = np.flatnonzero(hist[first : first + width])
    return first + int(used[0]), int(used[-1] - used[0]) + 1


def _binned(
    g: np.ndarray,
    bits: np.ndarray,
    biased: np.ndarray,
    outside: np.ndarray,
    window: tuple[int, int],
    n_groups: int,
    squares: bool,
) -> tuple[
    list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    list[tuple[np.ndarray, np.ndarray, np.ndarray]],
]:
    """Rows of exponents in ``window`` (not ``outside`` it) added by (group, exponent) bin:
    the sums as two float64 halves (exact: see the module docstring), handed on as rows of
    ``_sum_digits``; the squares as four 32-bit limbs a bin, as rows (group, limb sum,
    offset). Rows outside go to one bin past the others, never read (not filtered out:
    that would copy every column)."""
    first, width = window
    bins = n_groups * width
    key = g * width + (biased - first)
    if outside.any():
        key[outside] = bins
    high = (bits & ~np.int64(_HALF_MASK)).view(np.float64)
    low = bits.view(np.float64) - high
    sum_rows = []
    for weights in (high, low):
        total = np.bincount(key, weights=weights, minlength=bins + 1)[:bins]
        at = np.flatnonzero(total)
        tbits = total[at].view(np.int64)
        tm, te = _significands(tbits, (tbits >> 52) & 0x7FF)
        sum_rows.append((at // width, tm, te + (-1075 - SUM_BASE), tbits < 0))
    if not squares:
        return sum_rows, []
    m, _ = _significands(bits, biased)
    limbs = _square_limbs(m)
    sums = np.zeros((4, bins), np.int64)
    for start in range(0, len(g), ROWS_PER_BINCOUNT):
        part = slice(start, start + ROWS_PER_BINCOUNT)
        for j, limb in enumerate(limbs):
            sums[j] += np.bincount(key[part], weights=limb[part], minlength=bins + 1)[:bins].astype(np.int64)
    at = np.flatnonzero(sums.any(axis=0))
    e = np.maximum(at % width + first, 1)
    offset = 2 * e + (-2150 - SQUARE_BASE)
    return sum_rows, [(at // width, sums[j, at], offset + 32 * j) for j in range(4)]


def _sum_digits(
    g: np.ndarray, m: np.ndarray, offset: np.ndarray, negative: np.ndarray, n_groups: int
) -> Digits:
    """Digits of the signed sums of ``m * 2**offset`` a group (offset >= 0)."""
    d, r = offset >> 5, offset & 31
    low32 = (m & _MASK) << r  # under 2**63
    carried = (low32 >> 32) + ((m >> 32) << r)  # under 2**53
    pieces = [low32 & _MASK, carried & _MASK, carried >> 32]
    return _place(g, d, pieces, negative, n_groups)


def _square_limbs(m: np.ndarray) -> list[np.ndarray]:
    """``m**2`` (m under 2**53) as four int64 limbs under 2**32, lowest first."""
    um = m.view(np.uint64)
    lo, hi = um & np.uint64(0xFFFFFFFF), um >> np.uint64(32)
    mask, w = np.uint64(0xFFFFFFFF), np.uint64(32)
    ll = lo * lo  # under 2**64: exact in uint64
    t = np.uint64(2) * hi * lo + (ll >> w)  # under 2**55
    u = hi * hi + (t >> w)  # under 2**43
    return [
        (ll & mask).view(np.int64),
        (t & mask).view(np.int64),
        (u & mask).view(np.int64),
        (u >> w).view(np.int64),
    ]


def _square_digits(g: np.ndarray, m: np.ndarray, offset: np.ndarray, n_groups: int) -> Digits:
    """Digits of the sums of ``m**2 * 2**offset`` a group (offset >= 0 and even)."""
    limbs = _square_limbs(m)
    d, r = offset >> 5, offset & 31  # r even, at most 30: a limb shifted stays under 2**62
    shifted = [limb << r for limb in limbs]
    pieces = [shifted[0] & _MASK]
    for j in range(1, 4):
        pieces.append((shifted[j] & _MASK) | (shifted[j - 1] >> 32))
    pieces.append(shifted[3] >> 32)
    return _place(g, d, pieces, None, n_groups)


def _place(
    g: np.ndarray, d: np.ndarray, pieces: list[np.ndarray], negative: np.ndarray | None, n_groups: int
) -> Digits:
    """Add each row's ``pieces`` (under 2**32; piece j at digit ``d + j``, negated where
    ``negative``) by group and digit; carry into the canonical form."""
    n_pieces = len(pieces)
    if not len(g):
        return Digits.zeros(n_groups)
    lo, hi = int(d.min()), int(d.max())
    span = hi - lo + n_pieces + 1  # one digit on top for carries
    if n_groups * span <= max(_SPARSE_BINS, 4 * len(g)):  # one span for all groups
        low = np.full(n_groups, lo, np.int64)
        size = np.full(n_groups, span, np.int64)
        key = g * span + (d - lo)
        total = n_groups * span
    else:  # each group its own span
        low = np.full(n_groups, hi, np.int64)
        top = np.full(n_groups, lo - 1, np.int64)
        np.minimum.at(low, g, d)
        np.maximum.at(top, g, d)
        size = np.where(top >= low, top - low + n_pieces + 1, 0)
        starts = np.cumsum(size) - size
        key = starts[g] + (d - low[g])
        total = int(size.sum())
    bins = total
    if negative is not None and negative.any():
        key = key + negative * total  # negative values in bins of their own
        bins = 2 * total
    x = np.zeros(total + n_pieces, np.int64)
    for start in range(0, len(g), ROWS_PER_BINCOUNT):
        part = slice(start, start + ROWS_PER_BINCOUNT)
        k = key[part]
        for j, piece in enumerate(pieces):
            added = np.bincount(k, weights=piece[part], minlength=bins).astype(np.int64)
            x[j : j + total] += added[:total]
            if bins > total:
                x[j : j + total] -= added[total:]
    return _canonical(x[:total], low, size)


# --- carrying, merging ----------------------------------------------------------------


def _canonical(x: np.ndarray, low: np.ndarray, size: np.ndarray) -> Digits:
    """The canonical Digits of int64 digits ``x`` (groups one after another, ``size``
    digits from position ``low``; each group's top digit has room for what reaches it)."""
    size = size.astype(np.int64)
    ends = np.cumsum(size)
    top = np.zeros(len(x), bool)
    top[ends[size > 0] - 1] = True
    _carry(x, top)
    n_groups = len(size)
    group = np.repeat(np.arange(n_groups), size)
    negative = np.zeros(n_groups, bool)
    negative[group[top]] = x[top] < 0
    if negative.any():
        flip = negative[group]
        x[flip] = -x[flip]
        _carry(x, top)
    if len(x) and (x[top] >> 32).any():
        raise AssertionError("a digit past the top of its group: the headroom argument failed")
    nonzero = np.flatnonzero(x)
    owner = group[nonzero]
    firsts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]]) if len(owner) else np.zeros(0, np.int64)
    lasts = np.r_[firsts[1:], len(owner)] - 1 if len(owner) else np.zeros(0, np.int64)
    held = owner[firsts]
    first, last = nonzero[firsts], nonzero[lasts]
    new_size = np.zeros(n_groups, np.int64)
    new_size[held] = last - first + 1
    new_low = np.zeros(n_groups, np.int64)
    new_low[held] = low[held] + first - (ends[held] - size[held])
    sign = np.zeros(n_groups, np.int8)
    sign[held] = np.where(negative[held], -1, 1)
    if new_size.max(initial=0) > 255 or (
        len(held) and (new_low.min() < -(1 << 15) or new_low.max() >= 1 << 15)
    ):
        raise AssertionError("digits past the representation's bounds")
    digits = x[_ranges(first, new_size[held])].astype(np.uint32)
    return Digits(sign, new_low.astype(np.int16), new_size.astype(np.uint8), digits)


def _carry(x: np.ndarray, top: np.ndarray) -> None:
    """Carry ``x`` in place: every digit but a group's top one into [0, 2**32)."""
    c = x >> 32
    c[top] = 0
    x -= c << 32
    x[1:] += c[:-1]
    # what is left: carries of -1 or 1, passed along runs of zeros or of 2**32 - 1
    at = np.flatnonzero(((x >> 32) != 0) & ~top)
    while len(at):
        c = x[at] >> 32
        x[at] -= c << 32
        x[at + 1] += c
        nxt = at + 1
        at = nxt[((x[nxt] >> 32) != 0) & ~top[nxt]]


def _add_digits(parts: list[Digits], maps: list[np.ndarray], n_groups: int) -> Digits:
    """The sums of ``parts``' integers, each group j of part i into group ``maps[i][j]``.

    A group that one nonzero integer reaches takes it as it is (it is canonical already);
    only groups that several reach are added and carried."""
    held = [np.flatnonzero(part.size) for part in parts]
    reached = np.bincount(np.concatenate([m[h] for m, h in zip(maps, held, strict=True)]), minlength=n_groups)
    several = np.flatnonzero(reached > 1)
    number = np.full(n_groups, -1, np.int64)
    number[several] = np.arange(len(several))
    source = np.full(n_groups, -1, np.int64)  # each group's integer in the pieces below
    offset = 0
    adding: list[tuple[Digits, np.ndarray]] = []
    for part, m, h in zip(parts, maps, held, strict=True):
        one = reached[m[h]] == 1
        source[m[h[one]]] = offset + h[one]
        offset += len(part)
        if not one.all():
            adding.append((part.take(h[~one]), number[m[h[~one]]]))
    pieces = [*parts, Digits.zeros(1)]
    source[source < 0] = offset  # nothing reaches it: the zero
    if len(several):
        source[several] = offset + 1 + np.arange(len(several))
        pieces.append(_add_several([a for a, _ in adding], [m for _, m in adding], len(several)))
    return _concat_digits(pieces).take(source)


def _add_several(parts: list[Digits], maps: list[np.ndarray], n_groups: int) -> Digits:
    """The sums of ``parts``' nonzero integers, group j of part i into ``maps[i][j]``."""
    low = np.full(n_groups, np.iinfo(np.int64).max)
    high = np.full(n_groups, np.iinfo(np.int64).min)
    for part, m in zip(parts, maps, strict=True):
        np.minimum.at(low, m, part.low.astype(np.int64))
        np.maximum.at(high, m, part.low.astype(np.int64) + part.size - 1)
    size = high - low + 2  # one digit on top for carries
    starts = np.cumsum(size) - size
    x = np.zeros(int(size.sum()), np.int64)
    for part, m in zip(parts, maps, strict=True):
        value, group, position = part.signed()
        target = m[group]
        np.add.at(x, starts[target] + position - low[target], value)
    return _canonical(x, low, size)


def _concat_digits(parts: list[Digits]) -> Digits:
    return Digits(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Digits)))


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The indices ``starts[i] .. starts[i] + sizes[i] - 1``, one range after another."""
    sizes = sizes.astype(np.int64)
    return np.repeat(starts.astype(np.int64), sizes) + _within(sizes)


def _within(sizes: np.ndarray) -> np.ndarray:
    """0 .. sizes[i] - 1 for each i, one after another."""
    total = int(sizes.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def _digit_at(digits: np.ndarray, at: np.ndarray, present: np.ndarray) -> np.ndarray:
    return np.where(present, digits[np.where(present, at, 0)] if len(digits) else 0, 0).astype(np.int64)


# --- rounding -------------------------------------------------------------------------


def _round_window(
    a2: np.ndarray, a1: np.ndarray, a0: np.ndarray, rest: np.ndarray, exp0: np.ndarray
) -> np.ndarray:
    """The float64 nearest ``(a2 2**64 + a1 2**32 + a0 + f) 2**exp0`` (digits under 2**32,
    ``a2 > 0``; ``0 <= f < 1``, and ``f > 0`` exactly where ``rest``), ties to even."""
    length = np.frexp(a2.astype(np.float64))[1].astype(np.int64)  # a2's bits, 1..32
    k = 32 - length
    b2 = ((a2 << k) | (a1 >> (32 - k))) & _MASK  # leading one at bit 31
    b1 = ((a1 << k) | (a0 >> (32 - k))) & _MASK
    b0 = (a0 << k) & _MASK
    window = (b2 << 30) | (b1 >> 2)  # in [2**61, 2**62)
    sticky = ((b1 & 3) | b0) != 0
    return _to_float(window, exp0 - k + 34, sticky | rest)


def _to_float(window: np.ndarray, unit: np.ndarray, sticky: np.ndarray) -> np.ndarray:
    """The float64 nearest ``(window + f) 2**unit``, ``window`` in [2**61, 2**62), ``0 <= f < 1``
    nonzero where ``sticky``; ties to even, past the range +inf."""
    out = np.empty(len(window))
    normal = unit >= -1083  # the leading bit at 2**-1022 or above: 53 bits kept
    with np.errstate(over="ignore"):
        out[normal] = np.ldexp((window[normal] | sticky[normal]).astype(np.float64), unit[normal])
    tiny = ~normal
    if tiny.any():  # a multiple of 2**-1074: rounded here, in integers, once
        w, s = window[tiny], sticky[tiny]
        drop = -1074 - unit[tiny]
        shift = np.minimum(drop, 62)
        q = w >> shift
        rem = w - (q << shift)
        half = np.int64(1) << (shift - 1)
        up = (rem > half) | ((rem == half) & (s | ((q & 1) == 1)))
        q = np.where(drop > 62, 0, q + up)
        out[tiny] = np.ldexp(q.astype(np.float64), -1074)
    return out


def _std(s: Digits, q: Digits, n: np.ndarray) -> np.ndarray:
    """sqrt(n Q - S**2) / n, scaled, correctly rounded, for groups with squares and n < 2**31;
    in batches of groups of like widths (what a batch's dense digits hold)."""
    out = np.zeros(len(n))
    width = _spread_width(s, q)
    order = np.argsort(width, kind="stable")
    for start in range(0, len(order), _STD_BATCH):
        rows = order[start : start + _STD_BATCH]
        d = _spread(s.take(rows), q.take(rows), n[rows])
        some = np.flatnonzero(d.top >= 0)
        if not len(some):
            continue
        part, n_part = d.take(some), n[rows[some]]
        result, decided = _quick(part, n_part)
        doubt = np.flatnonzero(~decided)
        if len(doubt):
            result[doubt] = _settle(
                part.take(doubt), n_part[doubt], _candidate(part.take(doubt), n_part[doubt])
            )
        out[rows[some]] = result
    return out


def _top_64(d: _Dense, groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """D's top 64 bits from its leading one, as two 32-bit digits (``b2``, ``b1``), and how
    far they were shifted up to put that one at bit 31 of ``b2``."""
    rows = np.arange(groups)
    a2, a1, a0 = (d.digit(rows, d.top - j) for j in range(3))
    length = np.frexp(a2.astype(np.float64))[1].astype(np.int64)
    shift = 32 - length
    b2 = ((a2 << shift) | (a1 >> (32 - shift))) & _MASK
    b1 = ((a1 << shift) | (a0 >> (32 - shift))) & _MASK
    return b2, b1, shift


def _quick(d: _Dense, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sqrt(D 2**SQUARE_BASE) / n to about 2**-62 in double-double from D's top 62 bits,
    rounded; and whether that rounding is certain: the root is further than 2**-60 of
    itself from a midpoint between floats, and the result normal (else ``_settle``)."""
    b2, b1, shift = _top_64(d, len(n))
    window = (b2 << 30) | (b1 >> 2)  # D = (window + f) 2**unit, 0 <= f < 1, window >= 2**61
    unit = 32 * (d.base + d.top - 2) + SQUARE_BASE - shift + 34
    odd = unit & 1
    window <<= odd
    unit -= odd
    high = (window & ~np.int64(1023)).astype(np.float64)  # 53 bits or fewer: exact
    low = (window & 1023).astype(np.float64)
    root = np.sqrt(high)
    p, e = _two_product(root, root)
    root_low = (((high - p) - e) + low) / (2 * root)  # one Newton step: sqrt(high + low) = root + root_low
    nf = n.astype(np.float64)
    q = root / nf
    p, e = _two_product(q, nf)
    q_low = (((root - p) - e) + root_low) / nf  # (root + root_low) / n = q + q_low
    c = q + q_low
    off = (q - c) + q_low  # where q + q_low lies from c
    power = (c.view(np.int64) & _FRACTION) == 0
    gap = np.spacing(c) * np.where(power & (off < 0), 0.25, 0.5)  # to the midpoint on that side
    scale = unit // 2
    exponent = np.frexp(c)[1] + scale
    decided = (gap - np.abs(off) > c * 2.0**-60) & (exponent > -1020) & (exponent < 1020)
    with np.errstate(over="ignore", under="ignore"):
        return np.ldexp(c, scale), decided


def _two_product(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``p, e`` with ``p + e == a * b`` exactly (Dekker's product: no fma in numpy)."""
    p = a * b
    split = 134217729.0  # 2**27 + 1
    ca, cb = split * a, split * b
    ah, bh = ca - (ca - a), cb - (cb - b)
    al, bl = a - ah, b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


@dataclass(frozen=True)
class _Dense:
    """Non-negative integers, one a row, as digits in columns: row r is the sum of
    ``x[r, c] * 2**(32 * (base[r] + c))``, every digit in [0, 2**32); ``top`` and
    ``bottom``: the columns of the highest and lowest nonzero digit (-1 for zero)."""

    x: np.ndarray
    base: np.ndarray
    top: np.ndarray
    bottom: np.ndarray

    @classmethod
    def of(cls, x: np.ndarray, base: np.ndarray) -> _Dense:
        nonzero = x != 0
        held = nonzero.any(axis=1)
        top = np.where(held, x.shape[1] - 1 - np.argmax(nonzero[:, ::-1], axis=1), -1)
        return cls(x, base, top, np.where(held, np.argmax(nonzero, axis=1), -1))

    @classmethod
    def from_digits(cls, d: Digits) -> _Dense:
        """Digits' magnitudes, dense."""
        size = d.size.astype(np.int64)
        x = np.zeros((len(d), max(int(size.max(initial=0)), 1)), np.int64)
        x[np.repeat(np.arange(len(d)), size), _within(size)] = d.digits
        return cls.of(x, d.low.astype(np.int64))

    def take(self, rows: np.ndarray) -> _Dense:
        return _Dense(self.x[rows], self.base[rows], self.top[rows], self.bottom[rows])

    def digit(self, rows: np.ndarray, column: np.ndarray) -> np.ndarray:
        """The digit in ``column`` of each row (0 outside the columns)."""
        inside = (column >= 0) & (column < self.x.shape[1])
        return np.where(inside, self.x[rows, np.clip(column, 0, self.x.shape[1] - 1)], 0)


def _spread_width(s: Digits, q: Digits) -> np.ndarray:
    """The columns ``_spread`` gives each group: from the lowest of S**2's and nQ's digits
    to nQ's highest (n under 2**31 adds one) or S**2's, and one for carries."""
    ks, kq = s.size.astype(np.int64), q.size.astype(np.int64)
    ls, lq = s.low.astype(np.int64), q.low.astype(np.int64)
    base = np.where(ks > 0, np.minimum(2 * ls, lq), lq)
    return np.maximum(lq + kq, np.where(ks > 0, 2 * (ls + ks) - 1, lq)) - base + 2


def _spread(s: Digits, q: Digits, n: np.ndarray) -> _Dense:
    """``D = n Q - S**2`` a group (in units of 2**SQUARE_BASE), dense."""
    groups = len(n)
    ks, kq = s.size.astype(np.int64), q.size.astype(np.int64)
    ls, lq = s.low.astype(np.int64), q.low.astype(np.int64)
    base = np.where(ks > 0, np.minimum(2 * ls, lq), lq)
    x = np.zeros((groups, int(_spread_width(s, q).max(initial=1))), np.int64)
    qd = _Dense.from_digits(q).x
    for c in range(qd.shape[1]):  # n Q: digits under 2**32 times n under 2**31
        at = np.flatnonzero(c < kq)
        x[at, lq[at] - base[at] + c] += qd[at, c] * n[at]
    sd = _Dense.from_digits(s).x
    shift = 2 * ls - base
    for i in range(sd.shape[1]):  # S**2, digit by digit: uint64 products in 32-bit halves
        for j in range(i, sd.shape[1]):
            at = np.flatnonzero(j < ks)
            product = sd[at, i].astype(np.uint64) * sd[at, j].astype(np.uint64)
            lo = (product & np.uint64(0xFFFFFFFF)).astype(np.int64)
            hi = (product >> np.uint64(32)).astype(np.int64)
            times = 1 if i == j else 2
            column = shift[at] + i + j
            x[at, column] -= times * lo
            x[at, column + 1] -= times * hi
    for c in range(x.shape[1] - 1):  # carried from the lowest column up, in one pass
        x[:, c + 1] += x[:, c] >> 32
        x[:, c] &= _MASK
    if (x[:, -1] < 0).any() or (x[:, -1] >> 32).any():
        raise AssertionError("a negative variance, or past its columns")
    return _Dense.of(x, base)


def _candidate(d: _Dense, n: np.ndarray) -> np.ndarray:
    """A float near sqrt(D 2**SQUARE_BASE) / n (D > 0), from D's top 64 bits."""
    b2, b1, shift = _top_64(d, len(n))
    unit = 32 * (d.base + d.top - 2) - shift + 32 + SQUARE_BASE  # b1's unit
    approx = b2.astype(np.float64) * 2.0**32 + b1.astype(np.float64)  # D ~ approx 2**unit
    odd = unit & 1
    with np.errstate(over="ignore", under="ignore"):
        candidate = np.ldexp(np.sqrt(approx * (1 + odd)) / n, (unit - odd) // 2)
    return np.minimum(candidate, np.finfo(np.float64).max)


def _settle(d: _Dense, n: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """The float64 nearest sqrt(D 2**SQUARE_BASE) / n for each row of ``d`` (D > 0),
    from finite ``candidate``s near it: each moves a float at a time until the root lies
    between its midpoints."""
    candidate = candidate.copy()
    pending = np.arange(len(n))
    result = np.empty(len(n))
    with np.errstate(over="ignore"):  # MAX's next float up is inf: never the answer
        for _ in range(64):  # the candidate is a few floats off at most
            c = candidate[pending]
            cbits = c.view(np.int64)
            biased = cbits >> 52
            big_c = (cbits & _FRACTION) | ((biased > 0).astype(np.int64) << 52)
            e = np.maximum(biased, 1) - 1075  # c = big_c 2**e
            above = _compare(d, pending, n[pending], 2 * big_c + 1, e - 1)
            binade = (big_c == _HIDDEN) & (biased > 1)  # below a power of two the gap halves
            lower = np.where(binade, 4 * big_c - 1, 2 * big_c - 1)
            below = np.where(
                c == 0, 1, _compare(d, pending, n[pending], np.maximum(lower, 1), e - 1 - binade)
            )
            even = (big_c & 1) == 0
            up = (above > 0) | ((above == 0) & ~even)
            down = (below < 0) | ((below == 0) & ~even)
            settled = ~((above > 0) | (below < 0))
            result[pending[settled]] = np.where(
                up[settled], np.nextafter(c[settled], np.inf),
                np.where(down[settled], np.nextafter(c[settled], 0.0), c[settled]),
            )  # fmt: skip
            candidate[pending] = np.where(above > 0, np.nextafter(c, np.inf), np.nextafter(c, 0.0))
            pending = pending[~settled]
            if not len(pending):
                return result
    raise AssertionError("std: the candidate did not settle")


def _compare(d: _Dense, rows: np.ndarray, n: np.ndarray, mid: np.ndarray, exp: np.ndarray) -> np.ndarray:
    """The sign of ``sqrt(D 2**SQUARE_BASE) / n - mid 2**exp`` for ``D`` = d's ``rows``
    (``0 < mid < 2**56``, ``2 exp - SQUARE_BASE >= 0``): ``D`` against ``(n mid)**2`` shifted."""
    m0, m1 = mid & _MASK, mid >> 32
    t0 = n * m0
    t1 = n * m1 + (t0 >> 32)
    limbs = [t0 & _MASK, t1 & _MASK, t1 >> 32]  # n mid, under 2**87
    cols = np.zeros((7, len(mid)), np.int64)
    for a in range(3):
        for b in range(3):
            p = limbs[a].view(np.uint64) * limbs[b].view(np.uint64)
            cols[a + b] += (p & np.uint64(0xFFFFFFFF)).view(np.int64)
            cols[a + b + 1] += (p >> np.uint64(32)).view(np.int64)
    for c in range(6):
        cols[c + 1] += cols[c] >> 32
        cols[c] &= _MASK
    z = 2 * exp - SQUARE_BASE
    zq, zr = z >> 5, z & 31
    shifted = np.zeros((8, len(mid)), np.int64)
    shifted[0] = (cols[0] << zr) & _MASK
    for c in range(1, 7):
        shifted[c] = ((cols[c] << zr) & _MASK) | (cols[c - 1] >> (32 - zr))
    shifted[7] = cols[6] >> (32 - zr)
    # D's digits at the same positions zq .. zq + 7
    base, top, bottom = d.base[rows], d.top[rows], d.bottom[rows]
    diff = np.zeros((8, len(mid)), np.int64)
    for c in range(8):
        diff[c] = np.sign(d.digit(rows, zq + c - base) - shifted[c])
    above = base + top > zq + 7  # D has digits above the window: it is larger
    below = base + bottom < zq  # ... or below it (the lowest digit is nonzero)
    nonzero = diff != 0
    first = 7 - np.argmax(nonzero[::-1], axis=0)
    sign = np.where(nonzero.any(axis=0), diff[first, np.arange(len(mid))], np.where(below, 1, 0))
    return np.where(above, 1, sign)


# --- Python integers, for counts of 2**31 and more -------------------------------------


def _python_mean(state: ExactState, g: int) -> float:
    total = state.sum_digits.take(np.array([g])).to_ints()[0]
    if total == 0:
        return 0.0
    return _fraction_to_float(Fraction(total, int(state.count[g])) * Fraction(2) ** SUM_BASE)


def _python_std(state: ExactState, g: int) -> float:
    assert state.squares is not None
    s = state.sum_digits.take(np.array([g])).to_ints()[0]
    q = state.squares.take(np.array([g])).to_ints()[0]
    n = int(state.count[g])
    return sqrt_ratio(n * q - s * s, (n * n) << -SQUARE_BASE)  # std = sqrt(d 2**SQUARE_BASE) / n


def sqrt_ratio(num: int, den: int) -> float:
    """The square root of ``num / den`` (integers, ``num >= 0``, ``den > 0``), correctly
    rounded to float64 (+inf past its range).

    The root is taken of the ratio scaled to at least 110 bits (``math.isqrt``), so its
    integer part has 55 bits or more, then rounded to odd: an inexact root's last bit is
    set. No float and no midpoint between two floats lies strictly between two integers
    that wide, so the float nearest that odd number is the float nearest the root.

    >>> sqrt_ratio(2, 1) == 2 ** 0.5, sqrt_ratio(1, 4), sqrt_ratio(0, 7)
    (True, 0.5, 0.0)
    """
    if num == 0:
        return 0.0
    twos = min((num & -num).bit_length(), (den & -den).bit_length()) - 1  # the same ratio, smaller
    num, den = num >> twos, den >> twos
    k = 56 - (num.bit_length() - den.bit_length()) // 2  # the root's scale: 2**k
    quotient, rest = divmod(num << 2 * k, den) if k >= 0 else divmod(num, den << -2 * k)
    root = math.isqrt(quotient)
    odd = 2 * root + (rest != 0 or root * root != quotient)  # in halves of 2**-k
    return _fraction_to_float(Fraction(odd, 1 << (k + 1)) if k >= -1 else Fraction(odd << (-k - 1)))


def _fraction_to_float(x: Fraction) -> float:
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf
