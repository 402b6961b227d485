"""The compiled paths of ``exact`` (``_exact.c``): accumulate, add_digits (``combine``), finish
(``sum``, ``mean``, ``std``); order_stats (``finish._order_statistics``: median and pNN);
and the Table of ``grouptable``; built only where a C compiler was."""

import numpy as np

def accumulate(
    groups: np.ndarray,
    values: np.ndarray,
    n_groups: int,
    squares: bool,
    count: np.ndarray,
    nan: np.ndarray,
    pos_inf: np.ndarray,
    neg_inf: np.ndarray,
    s_sign: np.ndarray,
    s_low: np.ndarray,
    s_size: np.ndarray,
    q_sign: np.ndarray,
    q_low: np.ndarray,
    q_size: np.ndarray,
    /,
) -> tuple[bytearray, bytearray | None]: ...
def add_digits(
    sign: np.ndarray,
    low: np.ndarray,
    size: np.ndarray,
    digits: np.ndarray,
    target: np.ndarray,
    n_groups: int,
    out_sign: np.ndarray,
    out_low: np.ndarray,
    out_size: np.ndarray,
    /,
) -> bytearray: ...
def finish(
    kind: int,
    sign: np.ndarray,
    low: np.ndarray,
    size: np.ndarray,
    digits: np.ndarray,
    count: np.ndarray,
    limit: int,
    q_sign: np.ndarray,
    q_low: np.ndarray,
    q_size: np.ndarray,
    q_digits: np.ndarray,
    out: np.ndarray,
    /,
) -> None: ...
def order_stats(
    bucket: np.ndarray,
    combo: np.ndarray,
    value: np.ndarray,
    q: float,
    g_bucket: np.ndarray,
    g_combo: np.ndarray,
    count: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    nan: np.ndarray,
    below: np.ndarray,
    rank: np.ndarray,
    /,
) -> int: ...

class Table:
    """Records added straight into their groups (bucket, combo): counts, min, max and exact
    sums, kept across calls (``grouptable.GroupTable`` wraps it); ``add``'s ``squares``, one
    a label, says what its records keep (``partials.KEEP_SUMS``, ``KEEP_SQUARES``,
    ``KEEP_COUNT``)."""

    squares: bool
    def __len__(self) -> int: ...
    def add(
        self,
        bucket: np.ndarray,
        label: np.ndarray,
        values: np.ndarray,
        combo_of: np.ndarray,
        squares: np.ndarray,
        /,
    ) -> None: ...
    def below(self, upto: int, every: bool, /) -> int: ...
    def drain(
        self,
        upto: int,
        every: bool,
        bucket: np.ndarray,
        combo: np.ndarray,
        count: np.ndarray,
        nan: np.ndarray,
        pos_inf: np.ndarray,
        neg_inf: np.ndarray,
        min: np.ndarray,
        max: np.ndarray,
        s_sign: np.ndarray,
        s_low: np.ndarray,
        s_size: np.ndarray,
        q_sign: np.ndarray,
        q_low: np.ndarray,
        q_size: np.ndarray,
        /,
    ) -> tuple[bytearray, bytearray]: ...
