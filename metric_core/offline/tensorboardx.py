"""tensorboardX, loaded without torch.

tensorboardX's writer imports torch where it is installed, only to tell torch tensors from
other values: about 1.8 s of CPU on a CPU build, most of a ``--to tensorboard`` upload's
start, on the machines where metriclog runs (a training job's). metriclog hands it plain
numbers, so torch, if no one loaded it yet, is kept out while the package loads; a later
``import torch`` anywhere in the process loads it as usual.
"""

from __future__ import annotations

import sys
from types import ModuleType


def import_tensorboardx() -> ModuleType:
    """The ``tensorboardX`` package (``ImportError`` where it is not installed)."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None  # type: ignore[assignment]  # ``import torch`` raises ImportError
    try:
        import tensorboardX

        return tensorboardX
    finally:
        if sys.modules.get("torch", ...) is None:
            del sys.modules["torch"]
