"""Fan-out: wall time of deploy (no change), status and doctor on 1, 2 and 4 containers, as ratios
to the same task on one container measured in the same run.

    .venv/bin/python bench/bench_fanout.py [--repeat 3] [--state DIR]

Run from the repository root, as root. Brings up its own sandbox of two embedded hosts with two
containers each (pve1: 200, 201; pve2: 202, 203), or reuses --state DIR (which then keeps the four
venvs for the next run); deploys all four once from a frozen copy of this checkout, then runs the
real CLI: `--ct 200` (1), `--ct 200,202` (2, one per host: in parallel), `--ct 200,201` (2 on one
host: in order), `--group all` (4: two hosts in parallel, two containers each in order). Medians
of --repeat runs; tasks and layouts interleaved so that load drift hits all alike. Not a test.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_ops import deploy, sandbox  # noqa: E402

INVOKE = str(REPO / ".venv" / "bin" / "invoke")
LAYOUTS = {  # name -> selection flags
    "1": ["--ct", "200"],
    "2 (two hosts)": ["--ct", "200,202"],
    "2 (one host)": ["--ct", "200,201"],
    "4 (two hosts)": ["--group", "all"],
}
TASKS = {"deploy (no change)": ["deploy"], "status": ["status"], "doctor": ["doctor"]}


def invoke(box, checkout: Path, *args: str) -> float:
    start = time.perf_counter()
    r = subprocess.run([INVOKE, *args, "--inventory", str(box.inventory)], cwd=checkout, capture_output=True,
                       text=True, timeout=1800)
    elapsed = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"bench: invoke {' '.join(args)} failed "
                         f"({r.returncode}):\n{r.stdout[-1500:]}{r.stderr[-800:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per task and layout (median shown)")
    parser.add_argument("--state", help="sandbox state dir to create or reuse (default: a temporary one)")
    args = parser.parse_args()

    state = args.state or tempfile.mkdtemp(prefix="dflash-bench-fanout-")
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-checkout-"))
    box = sandbox.up(state, containers=(200, 201), hosts=2, inventory_path=f"{state}/sandbox.yaml")
    checkout = deploy.snapshot_checkout(work)
    try:
        first = invoke(box, checkout, "deploy", "--group", "all")
        print(f"setup: deploy to 4 containers {first:.1f} s", flush=True)
        times = {(task, layout): [] for task in TASKS for layout in LAYOUTS}
        for _ in range(args.repeat):
            for task, argv in TASKS.items():
                for layout, selection in LAYOUTS.items():
                    times[(task, layout)].append(invoke(box, checkout, *argv, *selection))

        print(f"\n{'task':<20} {'containers':<15} {'median s':>9} {'x 1 container':>14}   "
              f"(each {args.repeat} runs of the real CLI)")
        for task in TASKS:
            base = statistics.median(times[(task, "1")])
            for layout in LAYOUTS:
                med = statistics.median(times[(task, layout)])
                print(f"{task:<20} {layout:<15} {med:>9.2f} {med / base:>14.2f}")
    finally:
        if not args.state:
            sandbox.down(state, purge=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
