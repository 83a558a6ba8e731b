"""experiments.idle_bench: per gap, one median per op position, and the CLI's outputs."""
from __future__ import annotations

import json

from experiments.idle_bench import main, measure


def test_measure_gives_a_median_per_position_per_gap():
    res = measure([0.0, 1.0], ops=4, reps=3, warmup=2)
    assert list(res) == [0.0, 1.0]
    assert all(len(v) == 4 and all(t > 0 for t in v) for v in res.values())


def test_cli_text_and_json(capsys):
    main(["--gaps-ms", "0,2", "--ops", "4", "--reps", "2", "--json"])
    assert list(json.loads(capsys.readouterr().out)) == ["0.0", "2.0"]
    main(["--gaps-ms", "0,2", "--ops", "4", "--reps", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["gap   0.0 ms", "gap   2.0 ms"]
