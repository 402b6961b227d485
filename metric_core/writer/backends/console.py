"""Prints reduced metrics per step (or raw ones) to stdout."""

from __future__ import annotations

from typing import Any

from metric_core.format.sample import to_json
from metric_core.metric import BackendRole, Metric
from metric_core.writer.backends import LoggerBackend


class ConsoleBackend(LoggerBackend):
    """A line per step: ``[process] step 12: trainer/loss=0.3120 ...``."""

    async def init(
        self,
        role: BackendRole,
        controller_logger_metadata: dict[str, Any] | None = None,
        process_name: str | None = None,
    ) -> None:
        self.process_name = process_name or "?"

    async def log_batch(self, metrics: list[Metric], global_step: int) -> None:
        if not metrics:
            return
        body = "  ".join(f"{m.key}={m.value:.6g}" for m in sorted(metrics, key=lambda m: m.key))
        print(f"[{self.process_name}] step {global_step}: {body}", flush=True)

    async def log_samples(self, samples: list[Metric], step: int) -> None:
        """Each key's chosen samples (top and bottom by reward), a JSON line each."""
        for m in samples:
            print(f"[{self.process_name}] step {step}: {m.key} ({len(m.value)} samples shown)", flush=True)
            for sample in m.value:
                print("  " + to_json(sample), flush=True)

    def log_stream(self, metric: Metric, global_step: int) -> None:
        print(f"[{self.process_name}] step {global_step}: {metric.key}={metric.value:.6g}")
