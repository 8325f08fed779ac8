"""Timing, ceilings, the streamed result table and the goal verdicts of bench/device_check.py.

GPU timing follows the usual method: warm up (compilation, allocator), capture the calls in a CUDA graph
when possible (no launch gaps), time replays with CUDA events, report the median. Callers pass a list of
calls over distinct inputs whose bytes together exceed the L2 cache (rotating inputs), so repeated runs do
not measure the cache. On the CPU (--dry-run) the same code times with perf_counter.

Every row is appended to OUT/rows.jsonl and OUT/device_check.md and flushed the moment it is measured, and
every verdict to OUT/verdicts.txt, so a run stopped by its timeout (or a hang) loses nothing measured.
"""
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, TextIO

import torch

CPU_MIN_REPS = 3  # device_check --dry-run sets 1: the interpreter is slow and its numbers mean nothing


def median_seconds(fns: List[Callable], device: torch.device, target_s: float = 0.25, graph: bool = True,
                   max_reps: int = 200) -> float:
    """Median seconds of one call, over calls cycling through `fns` (each fn one call on its own inputs)."""
    if device.type != "cuda":
        for fn in fns:
            fn()
        times = []
        deadline = time.perf_counter() + (target_s if CPU_MIN_REPS > 1 else 0.0)
        while len(times) < CPU_MIN_REPS or (time.perf_counter() < deadline and len(times) < max_reps):
            start = time.perf_counter()
            for fn in fns:
                fn()
            times.append((time.perf_counter() - start) / len(fns))
        return statistics.median(times)
    run = _graph_replay(fns) if graph else None
    if run is None:
        def run():
            for fn in fns:
                fn()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    reps = int(min(max_reps, max(5, target_s / once)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / 1e3 for a, b in events) / len(fns)


def _graph_replay(fns: List[Callable]) -> Optional[Callable]:
    """A CUDA graph running every fn once (after a warm-up on a side stream), or None if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        return graph.replay
    except Exception as e:  # noqa: BLE001 - any capture failure: fall back to plain launches
        print(f"  (graph capture failed, timing plain launches: {type(e).__name__}: {e})")
        torch.cuda.synchronize()
        return None


def rotation_count(problem_bytes: int, l2_bytes: int, cap: int = 64) -> int:
    """How many independent copies of a problem make the rotated working set exceed 4x the L2 cache."""
    return int(max(1, min(cap, -(-4 * l2_bytes // max(problem_bytes, 1)))))


def l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return 16 << 10  # dry run: pretend 16 KiB, so the tiny problems still rotate over a few copies


def copy_ceiling(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds([lambda: dst.copy_(src)], device, graph=False)
    return 2 * nbytes / seconds


def matmul_ceiling(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """FLOP/s of an n x n x n matrix product on random data."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = median_seconds([lambda: torch.mm(a, b)], device, graph=False)
    return 2 * n ** 3 / seconds


def host_copy_rates(device: torch.device, nbytes: int) -> dict:
    """Contiguous pinned host <-> device copy rates (bytes/s), the peer of copy_blocks."""
    if device.type != "cuda":
        return {}
    dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev)
    d2h = median_seconds([lambda: host.copy_(dev, non_blocking=True)], device, graph=False)
    h2d = median_seconds([lambda: dev.copy_(host, non_blocking=True)], device, graph=False)
    return {"d2h": nbytes / d2h, "h2d": nbytes / h2d}


@dataclass
class Row:
    section: str
    case: str
    value: Optional[float]
    unit: str
    vs_ceiling: Optional[float] = None
    peer: str = ""
    vs_peer: Optional[float] = None
    note: str = ""


HEADER = ["section", "case", "value", "unit", "vs ceiling", "peer", "vs peer", "note"]


@dataclass
class Table:
    """Rows as they are measured: printed, and with `out` set appended (and flushed) to out/rows.jsonl and
    out/device_check.md; verdicts likewise to out/verdicts.txt."""
    out: Optional[str] = None
    dry: bool = False  # a dry run: speed verdicts are not given (its numbers mean nothing)
    rows: List[Row] = field(default_factory=list)
    verdicts: List[str] = field(default_factory=list)
    _files: dict = field(default_factory=dict)
    _md_header: bool = False  # a table header is due before the next markdown row

    def __post_init__(self):
        if self.out:  # a fresh run: files from an earlier one would mix in
            os.makedirs(self.out, exist_ok=True)
            for name in ("device_check.md", "rows.jsonl", "verdicts.txt"):
                if os.path.exists(os.path.join(self.out, name)):
                    os.remove(os.path.join(self.out, name))

    def _file(self, name: str) -> Optional[TextIO]:
        if not self.out:
            return None
        if name not in self._files:
            self._files[name] = open(os.path.join(self.out, name), "a", buffering=1)
        return self._files[name]

    def note(self, text: str) -> None:
        """A free line in the markdown file (section headers, environment)."""
        print(text, flush=True)
        f = self._file("device_check.md")
        if f:
            f.write(("\n" if self._md_header else "") + text + "\n\n")
            f.flush()
        self._md_header = False

    def add(self, *args, **kwargs) -> Row:
        row = Row(*args, **kwargs)
        self.rows.append(row)
        print(f"  {_cells(row)}", flush=True)
        md = self._file("device_check.md")
        if md:
            if not self._md_header:
                md.write("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER) + "\n")
                self._md_header = True
            md.write("| " + " | ".join(_cells(row).split(" ; ")) + " |\n")
            md.flush()
        js = self._file("rows.jsonl")
        if js:
            js.write(json.dumps({**row.__dict__, "time": round(time.time(), 1)}) + "\n")
            js.flush()
        return row

    def verdict(self, goal: str, passed: Optional[bool], detail: str, speed: bool = True) -> str:
        """PASS / FAIL / UNMEASURED line for one goal (DRY-RUN for speed goals of a dry run)."""
        word = "UNMEASURED" if passed is None else ("PASS" if passed else "FAIL")
        if speed and self.dry:
            word = "DRY-RUN"
        line = f"VERDICT {word:<10} {goal}: {detail}"
        self.verdicts.append(line)
        print(line, flush=True)
        f = self._file("verdicts.txt")
        if f:
            f.write(line + "\n")
            f.flush()
        return line

    def render(self) -> str:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(_cells(r).split(" ; ")) + " |" for r in self.rows]
        return "\n".join(lines)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def _cells(r: Row) -> str:
    return " ; ".join([r.section, r.case, _fmt(r.value), r.unit, _fmt(r.vs_ceiling, 2), r.peer or "-",
                       _fmt(r.vs_peer, 2), r.note or ""])
