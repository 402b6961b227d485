# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Unit tests for core metrics functionality."""

# The sample-related cases of torchforge's tests/unit_tests/observability/test_metrics.py
# as PR #486 ('Add Sample-level Logging API') changes them: its head 981e845 (2025-11-05)
# as GitHub merged it onto main 6e77f0b (refs/pull/486/merge, 7a7723c), with module paths
# changed to metric_core's. The rest of that file is test_metrics.py here, unchanged by
# the PR.

from metric_core.torchforge.metrics import (
    Reduce,
    reduce_metrics_states,
)


class TestReduceOperations:
    """Test reduce_metrics_states function returning List[Metric] - Diff 2 feature."""

    def test_single_state(self):
        """Test reduce_metrics_states with single state."""
        states = [
            {
                "loss": {"reduction_type": "mean", "sum": 10.0, "count": 2},
                "rollout/sample": {
                    "reduction_type": "sample",
                    "samples": [{"id": 1, "reward": 0.5}],
                },
            }
        ]
        metrics = reduce_metrics_states(states)
        assert len(metrics) == 2
        # Convert to dict for easier testing
        result_dict = {m.key: (m.value, m.reduction) for m in metrics}

        assert result_dict["loss"][0] == 5.0
        assert result_dict["loss"][1] == Reduce.MEAN

        assert result_dict["rollout/sample"][0] == [{"id": 1, "reward": 0.5}]
        assert result_dict["rollout/sample"][1] == Reduce.SAMPLE

    def test_multiple_states(self):
        """Test reduce_metrics_states with multiple states."""
        states = [
            {
                "loss": {"reduction_type": "mean", "sum": 10.0, "count": 2},
                "rollout/sample": {
                    "reduction_type": "sample",
                    "samples": [{"id": 1, "reward": 0.5}],
                },
            },
            {
                "loss": {"reduction_type": "mean", "sum": 20.0, "count": 3},
                "rollout/sample": {
                    "reduction_type": "sample",
                    "samples": [{"id": 2, "reward": 0.8}],
                },
            },
            {"accuracy": {"reduction_type": "sum", "total": 15.0}},
        ]
        metrics = reduce_metrics_states(states)

        assert len(metrics) == 3

        # Convert to dict for easier testing
        result_dict = {m.key: (m.value, m.reduction) for m in metrics}

        # Check scalar reductions
        assert result_dict["loss"][0] == 30.0 / 5.0  # 6.0
        assert result_dict["loss"][1] == Reduce.MEAN
        assert result_dict["accuracy"][0] == 15.0
        assert result_dict["accuracy"][1] == Reduce.SUM

        # Check sample concatenation
        assert result_dict["rollout/sample"][0] == [
            {"id": 1, "reward": 0.5},
            {"id": 2, "reward": 0.8},
        ]
        assert result_dict["rollout/sample"][1] == Reduce.SAMPLE
