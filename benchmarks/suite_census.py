"""Where the test suite's time goes: a pytest plugin recording each test's wall time, the CPU seconds of the
processes it started (`RUSAGE_CHILDREN`: launchers and ranks that exited and were waited for; jobs started by a
SLURM daemon and ranks orphaned by a SIGKILL are not counted; ranks forked by the tests' fork server,
tests/zygote.py, as it reports them) and the commands it launched.

    PYTHONPATH=. SUITE_CENSUS=/tmp/census.jsonl bash scripts/test.sh -p benchmarks.suite_census
    python -m benchmarks.suite_census /tmp/census.jsonl [--top 40]

The report lists the tests by CPU seconds with their launches (`tr4`: torchrun with 4 ranks, `ds2`: the deepspeed
launcher with 2, `py1`: `python trainer.py`, `fork4`: 4 ranks forked by the fork server), and the totals per test
file.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import time

import pytest

_popen_init = subprocess.Popen.__init__


def _path() -> str:
    return os.environ.get("SUITE_CENSUS", "suite_census.jsonl")


def _record(row: dict) -> None:
    with open(_path(), "a") as f:
        f.write(json.dumps(row) + "\n")


def _launch_kind(argv: list[str]) -> str:
    text = " ".join(argv)
    if argv and argv[0].endswith("deepspeed") and "--num_gpus" in argv:
        return "ds" + argv[argv.index("--num_gpus") + 1]
    if "torch.distributed.run" in text:
        nproc = [a.split("=", 1)[1] for a in argv if a.startswith("--nproc_per_node=")]
        return "tr" + (nproc[0] if nproc else "?")
    if any(a.endswith("trainer.py") for a in argv):
        return "py1"
    if "tests.zygote" in argv:
        return "fork server"
    return os.path.basename(argv[0]) if argv else "?"


def _popen(self, args, *rest, **kwargs):
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    _record({"launch": _launch_kind(argv), "test": test})
    return _popen_init(self, args, *rest, **kwargs)


def pytest_configure(config) -> None:
    subprocess.Popen.__init__ = _popen


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start, forked = resource.getrusage(resource.RUSAGE_CHILDREN), time.time(), _forked()
    yield
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    now = _forked()
    for kind in now[1][len(forked[1]) :]:
        _record({"launch": kind, "test": item.nodeid})
    _record({"test": item.nodeid, "wall": time.time() - start, "child_cpu": cpu + now[0] - forked[0]})


def _forked() -> tuple[float, list[str]]:
    """(CPU seconds, launches) of the ranks the fork server (tests/zygote.py) ran for this process so far."""
    import sys

    servers = getattr(sys.modules.get("tests.conftest"), "_ZYGOTE", [])
    return sum(z.cpu_seconds for z in servers), [k for z in servers for k in z.launches]


def report(path: str, top: int) -> None:
    rows = [json.loads(line) for line in open(path)]
    tests = [r for r in rows if "wall" in r]
    launches = collections.defaultdict(collections.Counter)
    for r in rows:
        if "launch" in r:
            launches[r["test"]][r["launch"]] += 1
    total = collections.Counter(k for c in launches.values() for k in c.elements())
    print(f"{len(tests)} tests: {sum(r['wall'] for r in tests):.0f} s of test time, ", end="")
    print(f"{sum(r['child_cpu'] for r in tests):.0f} CPU-s in the processes they started")
    print("launches:", ", ".join(f"{k} {n}" for k, n in total.most_common()))
    print(f"\n{'CPU-s':>7} {'wall s':>7}  test  [launches]")
    for r in sorted(tests, key=lambda r: -r["child_cpu"])[:top]:
        kinds = " ".join(f"{k}x{n}" for k, n in launches[r["test"]].most_common())
        print(f"{r['child_cpu']:7.1f} {r['wall']:7.1f}  {r['test']}  [{kinds}]")
    files = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in tests:
        f = files[r["test"].split("::")[0]]
        f[0], f[1], f[2] = f[0] + r["child_cpu"], f[1] + r["wall"], f[2] + 1
    print(f"\n{'CPU-s':>7} {'wall s':>7} tests  file")
    for name, (cpu, wall, n) in sorted(files.items(), key=lambda x: -x[1][0]):
        print(f"{cpu:7.0f} {wall:7.0f} {n:5d}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("census", help="the JSONL file the plugin wrote (SUITE_CENSUS)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    report(args.census, args.top)


if __name__ == "__main__":
    main()
