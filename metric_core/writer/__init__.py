"""The writer side: what a training rank imports.

``api`` (``init``, ``record_metric``, ``flush``, ``shutdown``) drives one ``collector``
per process; the collector hands its buffer to ``segments`` (the durable raw stream on
disk) and to live ``backends``. Nothing here imports polars, wandb (except the wandb
backend, when asked for), matplotlib or typer: ``tests/test_layout.py`` checks it.
"""
