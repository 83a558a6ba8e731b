"""experiments.gap: the plans and bounds of docs/results.md's gap section, on a tiny model."""
from __future__ import annotations

import re

from experiments.gap import main


def test_gap_prints_plans_and_ordered_bounds(capsys):
    main(["--model", "tiny_transformer", "--batch-size", "16", "--integral-groups", "5", "--time-limit-s", "10"])
    out = capsys.readouterr().out
    for key in ("cp-ar", "cp-ar-ps-small", "heaviest block", "lp-round", "DP-only LP", "release_bound", "all actions"):
        assert key in out
    num = lambda pat: float(re.search(pat, out).group(1))          # noqa: E731
    lp = num(r"DP-only LP \(action_space_bound\)\s+([\d.]+) ms")
    integral = num(r"groups integral\s+([\d.]+) ms")
    cp_ar = num(r"cp-ar\s+([\d.]+) ms")
    assert lp <= integral * (1 + 1e-6) <= cp_ar * (1 + 1e-6)
