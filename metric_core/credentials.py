"""Whether W&B can authenticate here without asking: for ``upload`` and for a sidecar
started in a job (which checks before it starts, not at the job's end)."""

from __future__ import annotations

import netrc
import os
from urllib.parse import urlparse


def has_credentials() -> bool:
    """Whether wandb can authenticate without asking: an API key, token file, or netrc entry."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base = os.environ.get("WANDB_BASE_URL")
    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    if base:
        return urlparse(base).hostname in hosts
    return any("wandb" in host for host in hosts)
