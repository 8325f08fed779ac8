"""Run independent simulation jobs (sweep points, study runs) in this process, a process pool, or as Ray
tasks on whatever cluster `ray.init()` finds, with a progress bar; results come back in input order, so
every way gives the same output.

    results = map_jobs(run_point, points, jobs=4)                  # process pool (fork)
    results = map_jobs(run_point, points, ray=True)                # local Ray, or RAY_ADDRESS's cluster
    results = map_jobs(run_point, points, ray=True, ray_address="ray://head:10001")

`fn` must be a module-level function and the items picklable. Ray workers import `shadowprefill` from
their own environment: on a cluster every node needs the same version installed. A job that raises
re-raises here (Ray: as a `RayTaskError` carrying the worker's traceback).
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _bar(total: int, desc: str, show: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="job", disable=not show, file=sys.stderr)


def map_jobs(fn: Callable[[T], R], items: Sequence[T], *, jobs: int = 1, ray: bool = False,
             ray_address: str | None = None, desc: str = "jobs", progress: bool = True) -> list[R]:
    """[fn(item) for item in items], run serially (jobs=1), in `jobs` forked processes, or as Ray tasks
    (`ray=True`; `ray_address` as for `ray.init`, default: RAY_ADDRESS or a local cluster)."""
    items = list(items)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    if ray or ray_address:
        return _ray_map(fn, items, ray_address, desc, progress)
    bar = _bar(len(items), desc, progress)
    out: list[R] = []
    try:
        if jobs == 1 or len(items) <= 1:
            for item in items:
                out.append(fn(item))
                bar.update(1)
        else:
            import multiprocessing as mp
            out = [None] * len(items)
            with mp.get_context("fork").Pool(min(jobs, len(items))) as pool:
                # as they finish (the bar moves with each), put back in input order
                for i, result in pool.imap_unordered(_indexed_call, [(i, fn, x) for i, x in enumerate(items)]):
                    out[i] = result
                    bar.update(1)
    finally:
        bar.close()
    return out


def _indexed_call(job: tuple):
    i, fn, item = job
    return i, fn(item)


def ray_available() -> bool:
    """Whether `ray` can be imported here."""
    return importlib.util.find_spec("ray") is not None


def _ray_map(fn, items: list, address: str | None, desc: str, progress: bool) -> list:
    import ray
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, logging_level="WARNING", log_to_driver=True)
    try:
        remote = ray.remote(num_cpus=1)(fn)
        refs = [remote.remote(item) for item in items]
        where = {ref: i for i, ref in enumerate(refs)}
        out: list = [None] * len(refs)
        pending = list(refs)
        bar = _bar(len(refs), f"{desc} (ray)", progress)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    out[where[ref]] = ray.get(ref)
                    bar.update(1)
        finally:
            bar.close()
        return out
    finally:
        if started:
            ray.shutdown()
