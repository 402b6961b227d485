"""``python -m tests.soak``: see tests/soak/runner.py."""

import sys

from tests.soak.runner import main

sys.exit(main())
