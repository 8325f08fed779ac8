"""Simulator speed and pool bookkeeping, before and after a change, measured in one run on one machine.

Exports the `shadowprefill` package of a git revision (`--before`, default main) with this tree's compiled
extensions, or with its own native core compiled from its csrc/ (`--build-before`), next to the
working tree's, then runs `bench/test_sim_bench.py` (simulated seconds per wall second, GHCP-like, 4 + 4
instances at ρ = 0.7; simulated seconds per CPU second of the process) and `bench/test_pool_bench.py native`
(pool bookkeeping per iteration, thread CPU) on each,
alternating `--rounds` times, and prints a table (median and best per side, after / before, and the median
of the rounds' own after / before ratios: each round pairs two runs made minutes apart, so the box's drift
between rounds cancels in it).

    .venv/bin/python bench/speed_before_after.py --before main --rounds 3
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export(rev: str, dest: str, build: bool = False) -> str:
    """The package and bench/ of `rev` under dest, with this tree's compiled extensions, or (`build`) its own:
    its csrc/ compiled there (`setup.py build_ext --inplace`), so a change to the native core is measured too."""
    paths = ["shadowprefill", "bench"] + (["setup.py", "pyproject.toml", "CMakeLists.txt", "csrc"] if build else [])
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, *paths], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    if build:
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest, check=True,
                       capture_output=True, env=dict(os.environ, SHADOWPREFILL_CUDA="0"))
        return dest
    for so in glob.glob(os.path.join(ROOT, "shadowprefill", "*.so")):
        shutil.copy(so, os.path.join(dest, "shadowprefill"))
    return dest


def run(tree: str, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"a bench run in {tree} exited with {out.returncode}:\n{tail}")
    return out.stdout


_SIM = """
import sys, time
sys.path.insert(0, "bench")
from test_sim_bench import build
sim = build("harvest-slo+host", {sim_seconds})
t0 = time.process_time()
sim.run()
print("RATE", sim.clock.now() / (time.process_time() - t0))
"""


def sim_rate(tree: str, sim_seconds: float) -> float:
    """Simulated seconds per CPU second of the process (`bench/test_sim_bench.py`'s run; CPU time, not wall
    time, so that other jobs on a shared machine disturb the comparison less)."""
    out = run(tree, ["-c", _SIM.format(sim_seconds=sim_seconds)])
    return float(re.search(r"RATE ([0-9.]+)", out).group(1))


def pool_us(tree: str) -> float:
    out = run(tree, ["bench/test_pool_bench.py", "native"])
    line = next(l for l in out.splitlines() if l.startswith("[native] pool bookkeeping") and "no hashes=" in l)
    return float(re.search(r"thread CPU (?:median )?([0-9.]+)", line).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git revision measured as 'before'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sim-seconds", type=float, default=60.0)
    ap.add_argument("--no-pool", action="store_true", help="skip the pool bookkeeping bench")
    ap.add_argument("--build-before", action="store_true",
                    help="compile the 'before' revision's own native core (default: it runs this tree's)")
    a = ap.parse_args()
    if a.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {a.rounds}")
    if not a.sim_seconds > 30.0:
        raise ValueError(f"--sim-seconds must be > 30 (the bench's warm-up), got {a.sim_seconds}")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": export(a.before, tmp, build=a.build_before), "after": ROOT}
        sims = {k: [] for k in trees}
        pools = {k: [] for k in trees}
        for _ in range(a.rounds):
            for side, tree in trees.items():
                sims[side].append(sim_rate(tree, a.sim_seconds))
                if not a.no_pool:
                    pools[side].append(pool_us(tree))
    med = {k: statistics.median(v) for k, v in sims.items()}
    best = {k: max(v) for k, v in sims.items()}
    print(f"| measure | before ({a.before}) | after | after / before |")
    print("|---|---|---|---|")
    print(f"| simulator, simulated s per CPU s (median of {a.rounds}) | {med['before']:.2f} | {med['after']:.2f} | "
          f"{med['after'] / med['before']:.2f}x |")
    print(f"| simulator, simulated s per CPU s (best of {a.rounds}) | {best['before']:.2f} | {best['after']:.2f} | "
          f"{best['after'] / best['before']:.2f}x |")
    paired = [after / before for before, after in zip(sims["before"], sims["after"])]   # round by round
    print(f"| simulator, after / before of each round (median of {a.rounds}; range) | | | "
          f"{statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f}) |")
    if not a.no_pool:
        pm = {k: statistics.median(v) for k, v in pools.items()}
        pb = {k: min(v) for k, v in pools.items()}
        print(f"| pool bookkeeping, native core, us per iteration (median of {a.rounds}) | {pm['before']:.1f} | "
              f"{pm['after']:.1f} | {pm['after'] / pm['before']:.2f}x |")
        print(f"| pool bookkeeping, native core, us per iteration (best of {a.rounds}) | {pb['before']:.1f} | "
              f"{pb['after']:.1f} | {pb['after'] / pb['before']:.2f}x |")
        pp = [after / before for before, after in zip(pools["before"], pools["after"])]
        print(f"| pool bookkeeping, after / before of each round (median of {a.rounds}; range) | | | "
              f"{statistics.median(pp):.2f}x ({min(pp):.2f}-{max(pp):.2f}) |")
    print(f"raw: sim {sims}; pool {pools}")


if __name__ == "__main__":
    main()
