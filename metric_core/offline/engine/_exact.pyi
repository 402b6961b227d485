"""The compiled path of ``exact.accumulate`` (``_exact.c``); built only where a C compiler was."""

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
