"""The soak's fixed seeds (tests/soak/seeds.txt): jobs that found a bug, or cover a path
well, replayed in every `make test`, with the checks that found its bug (``only=``; all of
them where it says none). A seed marked ``xfail=...`` still fails on this
branch for the defect it names; once that defect is fixed, remove the mark.

`make soak` runs new seeds for as long as asked; `make soak SEED=N` replays one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak.checks import CHECKS
from tests.soak.runner import report, run_one

SEEDS_FILE = Path(__file__).parent / "soak" / "seeds.txt"
pytestmark = pytest.mark.slow  # real jobs of several processes, then the commands


def fixed_seeds() -> list:
    """``SEED [only=CHECK,...] [xfail=DEFECT | skip=WHY]  # what it found``, one a line."""
    out = []
    for line in SEEDS_FILE.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        seed, marks, only = int(fields[0]), [], None
        for mark in fields[1:]:
            name, _, reason = mark.partition("=")
            if name == "only":  # only=raw: the raw records' check alone
                only = frozenset(reason.split(",")) - {"raw"}
                if not only <= CHECKS:
                    raise ValueError(
                        f"{SEEDS_FILE}: seed {seed}: unknown check in {mark!r}: {sorted(CHECKS)}"
                    )
            elif name == "xfail":
                marks.append(pytest.mark.xfail(reason=reason.replace("_", " "), strict=False))
            elif name == "skip":
                marks.append(pytest.mark.skip(reason=reason.replace("_", " ") + f": make soak SEED={seed}"))
            else:
                raise ValueError(f"{SEEDS_FILE}: unknown mark {mark!r} on seed {seed}")
        out.append(pytest.param(seed, only, marks=marks, id=f"seed{seed}"))
    return out


@pytest.mark.parametrize(("seed", "only"), fixed_seeds())
def test_a_fixed_soak_seed_holds_against_the_oracle(seed, only, tmp_path):
    result = run_one(seed, tmp_path, only=only)
    assert not result.failures, report(result)
