"""bench/bench_target_speed.py runs end to end (CPU, the tiny target's shape) and reports each
precision (and regenerate_data's grouped attention) against float32's, measured in the same run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_target_speed.py")


def test_each_precision_is_reported_against_float32(tiny_target):
    result = subprocess.run([sys.executable, BENCH, "--target", tiny_target, "--device", "cpu",
                             "--prompts", "4", "--new-tokens", "3", "--batch", "2", "--length", "16"],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert "random weights, on cpu" in lines[0]
    rows = [re.match(r"(.+): answering [\d,]+ tokens/s \(([\d.]+)x\), features [\d.]+ ms per 2 x 16 "
                     r"\(([\d.]+)x\)$", line) for line in lines[1:]]
    assert all(rows), lines
    assert [r.group(1) for r in rows] == ["float32", "float32, TF32 matmuls", "bfloat16",
                                          "float32, grouped attention",
                                          "bfloat16, grouped attention",
                                          "float32, grouped attention, reserved cache"]
    assert rows[0].group(2) == rows[0].group(3) == "1.00"
