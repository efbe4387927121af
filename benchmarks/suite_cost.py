"""What each test costs in CPU time (load-independent) and wall time, per test and per file.

As a pytest plugin (no conftest needed) it records every test's cost into a JSON file:

    PYTHONPATH=src:benchmarks python -m pytest -p suite_cost tests/test_x.py
    (ACCORD_SUITE_COST=path.json chooses the file; default suite-cost.json; under pytest-xdist each
    worker writes path.json.gw0, path.json.gw1, ... and the script below reads them together)

As a script it prints a table per test file, and with two records the change between them:

    python benchmarks/suite_cost.py before.json [after.json] [--tests]

CPU is resource.getrusage(SELF) + getrusage(CHILDREN) user+system, measured around each
test's whole protocol (set-up, call, tear-down): the test process and every child it waited
for (launchers, and through them their workers). A session- or module-scoped fixture is
charged to the first test that asks for it, so compare whole files, not single tests. Wall
time grows with the machine's load; CPU time barely does: compare CPU across runs, and say
the load (the 1-minute load average at the start and after the last test) next to wall
figures. The file is rewritten after every test, so an interrupted run keeps its figures.
"""

from __future__ import annotations

import glob
import json
import os
import resource
import sys
import time
from collections import defaultdict

import pytest


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_records: dict[str, dict] = {}
_load: list[float] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu(), time.perf_counter()
    yield
    _records[item.nodeid] = {"cpu": _cpu() - cpu, "wall": time.perf_counter() - wall}
    _write(_load + [os.getloadavg()[0]])  # after every test: a run stopped half-way keeps what it measured


def pytest_sessionstart(session):
    _load.append(os.getloadavg()[0])


def _write(load: list[float]) -> None:
    path = os.environ.get("ACCORD_SUITE_COST", "suite-cost.json")
    # Under pytest-xdist each worker records its own tests in a file of its own (PATH.gw0, ...);
    # reading PATH merges them.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path += "." + os.environ["PYTEST_XDIST_WORKER"]
    with open(path + ".partial", "w") as f:
        json.dump({"load": load, "tests": _records}, f, indent=1)
    os.replace(path + ".partial", path)


def _read(path: str) -> dict:
    """The record at PATH, merged with its xdist workers' (PATH.gw0, PATH.gw1, ...)."""
    parts = [json.load(open(p)) for p in [path, *sorted(glob.glob(glob.escape(path) + ".gw*"))] if os.path.exists(p)]
    if not parts:
        raise SystemExit(f"suite_cost: no record at {path} (nor {path}.gw*)")
    loads = [p["load"] for p in parts]
    return {
        "load": [min(load[0] for load in loads), max(load[-1] for load in loads)],
        "tests": {k: v for p in parts for k, v in p["tests"].items()},
    }


def _per_file(record: dict) -> dict[str, list[float]]:
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, cost in record["tests"].items():
        entry = files[nodeid.split("::")[0]]
        entry[0] += cost["cpu"]
        entry[1] += cost["wall"]
        entry[2] += 1
    return files


def main(argv: list[str]) -> None:
    per_test = "--tests" in argv
    paths = [a for a in argv if not a.startswith("--")]
    records = [_read(p) for p in paths]
    for path, record in zip(paths, records):
        start, end = record["load"][0], record["load"][-1]
        print(f"{path}: load average {start:.1f} at the start, {end:.1f} at the end")
    tables = [
        (_per_file(r) if not per_test else {k: [v["cpu"], v["wall"], 1] for k, v in r["tests"].items()})
        for r in records
    ]
    keys = sorted(set().union(*tables), key=lambda k: -max(t.get(k, [0])[0] for t in tables))
    header = f"{'file' if not per_test else 'test':<60} " + " ".join(
        f"{'n':>3} {'CPU s':>7} {'wall s':>7}" for _ in tables
    )
    if len(tables) == 2:
        header += f" {'ΔCPU s':>8} {'CPU ratio':>9}"
    print(header)
    totals = [[0.0, 0.0, 0] for _ in tables]
    for key in keys:
        row = f"{key[-60:]:<60} "
        for table, total in zip(tables, totals):
            cpu, wall, n = table.get(key, [0.0, 0.0, 0])
            total[0], total[1], total[2] = total[0] + cpu, total[1] + wall, total[2] + n
            row += f"{n:>3} {cpu:>7.1f} {wall:>7.1f} "
        if len(tables) == 2:
            a, b = tables[0].get(key, [0.0])[0], tables[1].get(key, [0.0])[0]
            row += f"{b - a:>8.1f} {b / a if a else float('nan'):>9.2f}"
        print(row)
    row = f"{'total':<60} " + "".join(f"{n:>3} {cpu:>7.1f} {wall:>7.1f} " for cpu, wall, n in totals)
    if len(tables) == 2:
        row += f"{totals[1][0] - totals[0][0]:>8.1f} {totals[1][0] / totals[0][0]:>9.2f}"
    print(row)


if __name__ == "__main__":
    main(sys.argv[1:])
