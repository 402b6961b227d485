"""``python -m metriclog``."""

from .main import main

main()
