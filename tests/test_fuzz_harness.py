"""scripts/fuzz_cudnn.py's bookkeeping without a GPU: a child that dies mid-case costs that case
alone (recorded as a crash with its program), the next child starts at the next case, and the
tally counts every case once. (Without a GPU every other case is refused by planning.)"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_crash_costs_only_its_case(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz_cudnn.py"), "--cases", "4", "--workers",
         "1", "--crash-at", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 1, run.stderr  # a crash is a failure
    records = [json.loads(line) for line in (tmp_path / "fuzz.jsonl").read_text().splitlines()]
    outcomes = {r["index"]: r["outcome"] for r in records}
    assert outcomes == {0: "refused", 1: "refused", 2: "crash", 3: "refused"}
    crashed = next(r for r in records if r["outcome"] == "crash")
    assert crashed["kind"] == "mask_score_mod" and crashed["text"] and crashed["programs"]
    assert "| all | 0 | 0 | 3 | 0 | 0 | 1 | 0 |" in (tmp_path / "fuzz.md").read_text()
