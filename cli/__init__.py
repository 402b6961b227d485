"""The metriclog command line."""
