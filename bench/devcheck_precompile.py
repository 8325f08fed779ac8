"""Pre-compilation of bench/device_check.py: every Triton kernel variant the run will launch is compiled in
parallel on the machine's CPU cores before anything is timed, so compilation never eats a timed section.

The variants come from bench/sm90_compile_report.py's capture (the public entry points run on the bench
shapes with every kernel launch recorded instead of executed), plus the prefill tiles of the tile sweep.
On a GPU each worker process calls the JIT's own `kernel.warmup(...)` for its share (compile, no launch),
which fills Triton's on-disk cache under exactly the keys the run will look up; the main process then warms
the same list up again (cache hits: the time printed says whether they hit). Without a GPU (--dry-run)
each worker compiles its share ahead of time for sm_90 (GPUTarget("cuda", 90, 32)), as the compile report
does: the same code path, checked on the CPU.

    python bench/devcheck_precompile.py --worker INDEX COUNT {gpu,sm90} [--quick] [--sweep T1,T2] [--limit N]
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SWEEP_SHAPES = ("prefill 2048 on 32K", "chunk 256 on 32K (split)")


def variants(quick: bool, sweep_tiles=(), limit: int = 0) -> list:
    """Distinct (name, kernel, args, kwargs) launches of the run (JIT-specialisation keys deduplicated)."""
    import sm90_compile_report as report
    from shadowprefill.triton_kernels import launch

    calls = list(report.workloads(quick))
    for spec in sweep_tiles:
        for name, call in list(calls):
            if name in SWEEP_SHAPES:
                calls.append((f"{name} tiles {spec}", lambda c=call, s=spec: _with_tile(launch, s, c)))
    seen, found = set(), []
    for name, call in calls:
        for kernel, args, kwargs in report.capture_launches(call):
            signature, constexprs, attrs, options = report.specialise(kernel, args, dict(kwargs))
            key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), tuple(sorted(options.items())),
                   tuple(sorted(signature.items())), tuple(sorted((k, str(v)) for k, v in attrs.items())))
            if key not in seen:
                seen.add(key)
                found.append((name, kernel, args, kwargs))
    return found[:limit] if limit else found


def _with_tile(launch, spec, call):
    with launch.forced_tiles(prefill=spec):
        call()


def compile_one(kernel, args, kwargs, mode: str) -> None:
    if mode == "gpu":
        kernel.warmup(*args, grid=(1,), **kwargs)
        return
    import sm90_compile_report as report
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature, constexprs, attrs, options = report.specialise(kernel, args, dict(kwargs))
    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                   options=options)


def worker(index: int, count: int, mode: str, quick: bool, sweep_tiles, limit: int) -> int:
    failed = 0
    for k, (name, kernel, args, kwargs) in enumerate(variants(quick, sweep_tiles, limit)):
        if k % count != index:
            continue
        try:
            compile_one(kernel, args, kwargs, mode)
        except Exception as e:  # noqa: BLE001 - report every variant; the run compiles it again if needed
            failed += 1
            print(f"precompile FAIL {name}: {kernel.fn.__name__}: {type(e).__name__}: {str(e)[-300:]}", flush=True)
    return 1 if failed else 0


def precompile(mode: str, workers: int, quick: bool, sweep_tiles=(), timeout_s: float = 120.0, limit: int = 0) -> dict:
    """Compile every variant in `workers` processes, each stopped at `timeout_s`; returns {"seconds",
    "failed_workers" (a variant failed to compile), "timed_out_workers"}."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        p for p in (HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p))
    start = time.time()
    command = [sys.executable, os.path.abspath(__file__), "--worker", "{i}", str(workers), mode,
               "--sweep", ",".join(sweep_tiles), "--limit", str(limit)] + (["--quick"] if quick else [])
    procs = [subprocess.Popen([c.format(i=i) for c in command], env=env) for i in range(workers)]
    failed = timed_out = 0
    for p in procs:
        try:
            failed += p.wait(timeout=max(1.0, start + timeout_s - time.time())) != 0
        except subprocess.TimeoutExpired:
            p.kill()
            timed_out += 1
    return {"seconds": time.time() - start, "failed_workers": failed, "timed_out_workers": timed_out}


def warm_up_here(quick: bool, sweep_tiles=()) -> tuple:
    """(variants, seconds): the JIT warm-up of every variant in this process (a GPU run, after precompile)."""
    start = time.time()
    found = variants(quick, sweep_tiles)
    for _, kernel, args, kwargs in found:
        kernel.warmup(*args, grid=(1,), **kwargs)
    return len(found), time.time() - start


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        print(__doc__)
        sys.exit(2)
    os.environ["TRITON_INTERPRET"] = "0"
    tiles = sys.argv[sys.argv.index("--sweep") + 1].split(",") if "--sweep" in sys.argv else []
    limit = int(sys.argv[sys.argv.index("--limit") + 1]) if "--limit" in sys.argv else 0
    sys.exit(worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], "--quick" in sys.argv,
                    [t for t in tiles if t], limit))
