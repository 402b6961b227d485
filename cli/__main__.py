"""``python -m metriclog``."""

from .start import main

main()
