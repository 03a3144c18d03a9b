#!/usr/bin/python3
"""Runs rdma-core's pyverbs test suite and prints one line per test, sorted:
OUTCOME TEST_ID [REASON], then the totals. OUTCOME is pass, fail, error or skip.

The suite is not part of DRUM: the first argument is the tests/ folder of an rdma-core
checkout; the rest are the suite's own options (--dev, --port, --gid). Its run_tests.py
prints outcomes mixed with whatever the tests and the shim write to stderr; one line per
test lets runs bare, through the shim and governed be compared with diff.
Usage: pyverbs_outcomes.py SUITE_DIR --dev softrnic0 --port 1 --gid 0
"""
import os
import sys
import unittest
from importlib.machinery import SourceFileLoader


class Outcomes(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.rows = []

    def _row(self, outcome, test, reason=""):
        first = str(reason).strip().splitlines()
        self.rows.append((test.id(), outcome, first[-1][:160] if first else ""))

    def addSuccess(self, test):
        self._row("pass", test)

    def addFailure(self, test, err):
        self._row("fail", test, err[1])

    def addError(self, test, err):
        self._row("error", test, err[1])

    def addSkip(self, test, reason):
        self._row("skip", test, reason)

    def addExpectedFailure(self, test, err):
        self._row("pass", test)

    def addUnexpectedSuccess(self, test):
        self._row("fail", test, "unexpected success")


def main():
    suite_dir = os.path.abspath(sys.argv[1])
    sys.argv[1:] = sys.argv[2:]
    sys.path.insert(0, suite_dir)
    from args_parser import parser

    parser.parse_args()
    tests = SourceFileLoader("tests", os.path.join(suite_dir, "__init__.py")).load_module()
    result = Outcomes()
    unittest.TestLoader().loadTestsFromModule(tests).run(result)
    totals = {}
    for test_id, outcome, reason in sorted(result.rows):
        totals[outcome] = totals.get(outcome, 0) + 1
        print(f"{outcome} {test_id} {reason}".rstrip(), flush=True)
    print("totals " + " ".join(f"{k}={totals.get(k, 0)}" for k in ("pass", "fail", "error", "skip")))


if __name__ == "__main__":
    main()
