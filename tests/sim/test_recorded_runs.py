"""Recorded seeded runs: the simulator's results stay what they were.

`tests/sim/data/recorded_runs.json` holds the §5 metrics and a digest of every call and normal request
(placement, nanosecond timings, cached tokens) of short seeded runs of five Table 2 policies on both
workload families, made by `bench/recorded_runs.py --cases test`. A refactor must reproduce them exactly;
a deliberate change of behaviour regenerates the file in the same commit and says why in the README.
"""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import recorded_runs  # noqa: E402

RECORDED = json.loads((pathlib.Path(__file__).parent / "data" / "recorded_runs.json").read_text())


@pytest.mark.parametrize("case", recorded_runs.CASES["test"], ids=lambda c: c["name"])
def test_recorded_run_is_reproduced(case):
    name, result = recorded_runs.run_case(case)
    want = RECORDED[name]
    assert set(result["policies"]) == set(want["policies"])
    assert all(row["num_calls"] > 0 for row in want["policies"].values())   # the recording has calls to compare
    diffs = recorded_runs.compare({name: want}, {name: result})
    assert not diffs, "\n".join(diffs)
