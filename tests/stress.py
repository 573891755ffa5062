"""`make stress N=20`: the store's concurrency and fault tests (gc, `store verify --repair` and builds racing each
other, builds and transfers killed, a remote dropping connections), run N times over, each run a fresh pytest
session as `make test` runs it. Prints each test's failures out of its runs and exits 1 on any failure.

A test that fails here one time in twenty is a race in the store or in the test, not noise: fix it at its cause.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FILES = ["tests/test_store_races.py", "tests/test_input_writes.py", "tests/test_gc_during_build.py",
         "tests/test_operator_faults_store.py", "tests/test_crash_and_concurrency.py"]


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """{test id: ("passed" | "failed" | "skipped", the failure's report)} from a pytest JUnit XML report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failure is not None:
            out[name] = ("failed", failure.text or failure.get("message", ""))
        elif case.find("skipped") is not None:
            out[name] = ("skipped", "")
        else:
            out[name] = ("passed", "")
    return out


def main(runs: int) -> int:
    results: dict[str, list[str]] = defaultdict(list)
    sessions_failed = 0
    with tempfile.TemporaryDirectory(prefix="qbuild-stress-") as tmp:
        for i in range(runs):
            report = Path(tmp) / f"run-{i}.xml"
            started = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-p",
                                   "no:cacheprovider", f"--junitxml={report}", *FILES], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            found = outcomes(report) if report.exists() else {}
            for test, (outcome, _) in found.items():
                results[test].append(outcome)
            failed = sorted(t for t, (o, _) in found.items() if o == "failed")
            if proc.returncode != 0 and not failed:
                sessions_failed += 1   # the session itself broke (collection, a crashed worker)
                print(proc.stdout[-3000:], file=sys.stderr)
            print(f"run {i + 1}/{runs}: {len(found) - len(failed)} passed, {len(failed)} failed "
                  f"({time.monotonic() - started:.0f} s){': ' + ', '.join(failed) if failed else ''}", flush=True)
            for test in failed:   # the end of each failure's report, where its assertion is
                print(f"--- {test} (run {i + 1})\n" + "\n".join(found[test][1].splitlines()[-40:]), flush=True)
    print(f"\n{'failures':>9}  test")
    for test in sorted(results):
        fails = results[test].count("failed")
        print(f"{fails:>4}/{len(results[test]):<4}  {test}")
    total = sum(o.count("failed") for o in results.values())
    print(f"\n{total} failures in {sum(len(o) for o in results.values())} test runs "
          f"({len(results)} tests x {runs} runs); {sessions_failed} broken sessions")
    return 1 if total or sessions_failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
