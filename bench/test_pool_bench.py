"""Benchmarks of the KV pool (issue 4): CPU bookkeeping per engine iteration, and GPU spill/reload bandwidth.

1. `test_pool_bookkeeping_per_iteration` (CPU, bookkeeping-only pool as the simulator runs it): a steady-state
   continuous-batching loop with 256 running sequences and a 2,048-token budget (≈250 decodes + prefill
   chunks), agentic prompts = a 64-page cached session history + 900 new tokens, so every admission does a
   64-page prefix lookup; decodes allocate a page every 16 tokens and register each page as it fills;
   finished requests release ~120 pages; the pool (32,768 pages of 2 MiB = Llama-3-8B on 64 GiB of HBM, 32 GiB
   host tier) runs full of cached pages, so most new pages evict (and spill) one. The calls are the engine
   scheduler's: the decodes due a page get them in one `allocate_many`, the pages an iteration filled are
   registered in one `commit_many` (about 10 calls per iteration). The pool calls of 2,000 iterations are
   recorded, then replayed on a fresh pool: the timing covers the pool's bookkeeping and one Python call per
   recorded call (the replay's dispatch), goal <= 100 µs per iteration on one core; pytest-benchmark reports
   the replay per round.
2. `test_long_session_shadow_chunks` (CPU): the pool calls of one shadow job on a 64K-token session (acquire the
   cached prefix, allocate and commit a 512-token chunk, release), with and without the job's PageHashes
   (`hashes=`): without it every chunk re-hashes the whole 4,096-page prefix, with it only the new pages.
3. `test_spill_reload_bandwidth` (CUDA only): HostTier spill (D2H) and reload (H2D) of 512 scattered
   Llama-3-8B pages through copy_blocks on the side stream, as a ratio to one contiguous pinned copy of the
   same bytes. Skipped without a GPU: it is a measurement, not a test.

Script mode: `python bench/test_pool_bench.py` prints the CPU numbers.
"""
import random
import statistics
import time

import pytest
import torch

from shadowprefill.kv.manager import KVCacheManager
from shadowprefill.kv.host_tier import HostTier

BS = 16
NUM_BLOCKS = 32768
PAGE_BYTES = 32 * 2 * 8 * BS * 128 * 2          # Llama-3-8B, bf16: 2 MiB per 16-token page
TOKEN_BUDGET, MAX_SEQS = 2048, 256
PREFIX_PAGES, NEW_TOKENS, SESSIONS = 64, 900, 64


class Request:
    __slots__ = ("tokens", "prompt_len", "blocks", "computed", "decode_left", "chain")

    def __init__(self, tokens, decode_len):
        self.tokens, self.prompt_len, self.blocks = tokens, len(tokens), []
        self.computed, self.decode_left = 0, decode_len
        self.chain = None   # the request's PageHashes (use_chains; the engine keeps them for shadow jobs only)


class PoolWorkload:
    """An engine's pool calls, iteration by iteration (scheduler simplified, no model)."""

    def __init__(self, seed: int = 0, use_chains: bool = False, backend: str = "python"):
        rng = random.Random(seed)
        self.use_chains = use_chains
        self.pool = fresh_pool(backend)
        histories = [[rng.randrange(128_000) for _ in range(PREFIX_PAGES * BS)] for _ in range(SESSIONS)]
        suffixes = [[rng.randrange(128_000) for _ in range(NEW_TOKENS)] for _ in range(97)]
        self.prompts = [histories[i % SESSIONS] + suffixes[(7 * i) % 97] + [i] for i in range(4096)]
        self.decode_lens = [rng.randint(64, 192) for _ in range(4096)]
        self.next_prompt, self.now = 0, 0.0
        self.running: list[Request] = []

    def step(self) -> None:
        pool, now = self.pool, self.now
        # finished requests free their pages (registered ones stay cached)
        done = [r for r in self.running if r.decode_left == 0]
        if done:
            self.running = [r for r in self.running if r.decode_left > 0]
            for r in done:
                pool.free(r.blocks, now=now)
        # admissions: a prefix lookup over the session history (64 cached pages)
        while len(self.running) < MAX_SEQS:
            i = self.next_prompt % len(self.prompts)
            r = Request(list(self.prompts[i]), self.decode_lens[i])
            if self.use_chains:
                r.chain = pool.hash_chain(r.tokens)
            m = pool.match_prefix(r.tokens, now=now, max_tokens=r.prompt_len - 1, hashes=r.chain)
            r.blocks, r.computed = m.block_ids, m.num_tokens
            self.running.append(r)
            self.next_prompt += 1
        # schedule, as the engine's scheduler: decodes first (those due a page get it in one call; a decode the
        # pool cannot serve sits this iteration out), then prefill chunks under the token budget
        budget = TOKEN_BUDGET
        batch = []
        decodes = [r for r in self.running if r.computed >= r.prompt_len]
        due = [r for r in decodes if r.computed + 1 > len(r.blocks) * BS]
        served = pool.allocate_many([(r.computed + BS) // BS - len(r.blocks) for r in due], now=now) if due else []
        for r, new in zip(due, served):
            r.blocks += new
        unserved = {id(r) for r in due[len(served):]}
        for r in decodes:
            if id(r) not in unserved:
                budget -= 1
                batch.append((r, 1))
        for r in self.running:
            n = min(r.prompt_len - r.computed, budget)
            if n <= 0:
                continue
            need = (r.computed + n + BS - 1) // BS - len(r.blocks)
            if need > 0:
                new = pool.allocate(need, now=now)
                if new is None:
                    continue
                r.blocks += new
            budget -= n
            batch.append((r, n))
        # after the forward: append sampled tokens; the pages that filled are registered in one call
        filled = []
        for r, n in batch:
            before = r.computed
            r.computed += n
            if r.computed >= r.prompt_len:
                r.tokens.append(r.computed & 0x7FFF)
                r.decode_left -= 1
            if r.computed // BS > before // BS:
                filled.append((r.blocks, r.tokens, "", r.computed, r.chain))
        if filled:
            pool.commit_many(filled, now=now)
        pool.poll(now)
        self.now += 0.03


class Recorder:
    """Stands in for the pool during the workload: forwards every call and logs it per iteration."""

    def __init__(self, pool: KVCacheManager):
        self.pool, self.iterations = pool, []

    def __getattr__(self, name):
        method = getattr(self.pool, name)
        if name == "hash_chain":      # no pool state: not recorded
            return method

        def call(*args, **kwargs):
            self.iterations[-1].append((name, args, kwargs))
            return method(*args, **kwargs)
        return call


def record(iterations: int, use_chains: bool = False) -> tuple[list, PoolWorkload]:
    """Run the workload and return its pool calls per iteration (arguments are only appended to later,
    and every call bounds what it reads by num_tokens / max_tokens / the list itself, so replaying the
    recorded references is exact)."""
    w = PoolWorkload(use_chains=use_chains)
    recorder = Recorder(w.pool)
    w.pool = recorder
    for _ in range(iterations):
        recorder.iterations.append([])
        w.step()
    w.pool = recorder.pool
    return recorder.iterations, w


def fresh_pool(backend: str) -> KVCacheManager:
    return KVCacheManager(NUM_BLOCKS, BS, page_bytes=PAGE_BYTES, model_id="llama-3-8b", backend=backend,
                          host_tier=HostTier(capacity_bytes=32 * 2**30, page_bytes=PAGE_BYTES))


def bind(trace: list, pool: KVCacheManager) -> list:
    """Bound calls; each recorded PageHashes is replaced by an empty one over the same tokens, so the replay
    hashes exactly what the recording hashed."""
    fresh: dict = {}

    def renew(chain):
        if chain is None:
            return None
        if id(chain) not in fresh:
            fresh[id(chain)] = pool.hash_chain(chain.tokens)
        return fresh[id(chain)]

    def unhashed(name, args, kwargs):
        if name == "commit_many":                # (block_ids, token_ids, tenant, num_tokens, hashes) items
            return ([item[:4] + (renew(item[4]),) for item in args[0]],), kwargs
        if kwargs.get("hashes") is None:
            return args, kwargs
        return args, {**kwargs, "hashes": renew(kwargs["hashes"])}
    return [[(getattr(pool, name), *unhashed(name, args, kwargs)) for name, args, kwargs in calls] for calls in trace]


def run_iteration(calls: list) -> None:
    for method, args, kwargs in calls:
        method(*args, **kwargs)


def replay(trace: list, measured: int, backend: str) -> tuple[list[float], list[float], KVCacheManager]:
    """Replay the trace on a fresh pool; (wall µs, thread CPU µs) of each of the last `measured` iterations."""
    pool = fresh_pool(backend)
    bound = bind(trace, pool)
    wall, cpu = [], []
    for i, calls in enumerate(bound):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        run_iteration(calls)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if i >= len(bound) - measured:
            wall.append((t1 - t0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
    return wall, cpu, pool


def _summary(us: list[float]) -> str:
    return f"median {statistics.median(us):.0f} us, p90 {statistics.quantiles(us, n=10)[-1]:.0f} us"


def _describe(w: PoolWorkload, trace: list) -> str:
    st = w.pool.stats
    n = len(trace)
    calls = sum(len(c) for c in trace[n // 2:]) / (n - n // 2)
    return (f"per iteration: {calls:.0f} pool calls, {st.lookups / n:.1f} lookups "
            f"(device hit {st.device_hit_tokens / max(st.lookup_tokens, 1):.2f} of looked-up tokens), "
            f"{st.allocated_blocks / n:.0f} pages allocated, {st.normal_evictions / n:.0f} evicted + spilled "
            f"(host tier, bookkeeping), {st.host_drops / n:.0f} host drops")


@pytest.mark.parametrize("backend", ["python", "native"])
def test_pool_bookkeeping_per_iteration(benchmark, backend):
    """pytest-benchmark times the replay of each recorded steady-state iteration (one round each). The trace
    is recorded on the Python reference, so the final stats check also compares the backends."""
    warmup, measured = 1000, 1000
    trace, w = record(warmup + measured)
    pool = fresh_pool(backend)
    bound = bind(trace, pool)
    for calls in bound[:warmup]:
        run_iteration(calls)
    steady = iter(bound[warmup:])
    benchmark.pedantic(lambda: run_iteration(next(steady)), rounds=measured, iterations=1)
    assert pool.stats.as_dict() == w.pool.stats.as_dict()       # the replay took the same decisions
    st = pool.stats
    assert st.lookups > 0 and st.device_hit_tokens > 0 and st.normal_evictions > 0 and st.spills > 0
    benchmark.extra_info["workload"] = _describe(w, trace)
    print("\n" + _describe(w, trace))


class LongSession:
    """One shadow job on a 64K-token session whose context is cached (see module docstring, 2.)."""

    def __init__(self, use_chain: bool, context: int = 65536, chunk: int = 512, max_chunks: int = 128,
                 backend: str = "native"):
        rng = random.Random(1)
        self.pool = KVCacheManager(2 * (context + max_chunks * chunk) // BS, BS, model_id="llama-3-8b",
                                   backend=backend)
        self.history = [rng.randrange(128_000) for _ in range(context)]
        ids = self.pool.allocate(context // BS, now=0.0)
        self.pool.commit(ids, self.history, now=0.0)
        self.pool.free(ids, now=0.0)
        self.history += [rng.randrange(128_000) for _ in range(max_chunks * chunk)]   # what the chunks compute
        self.chain = self.pool.hash_chain(self.history) if use_chain else None
        self.context, self.chunk_tokens, self.now = context, chunk, 1.0

    def chunk(self) -> None:
        """The pool calls of one shadow chunk: acquire the cached prefix, allocate, commit, release."""
        pool, now = self.pool, self.now
        m = pool.match_prefix(self.history, now=now, shadow=True, max_tokens=len(self.history), hashes=self.chain)
        new = pool.allocate(self.chunk_tokens // BS, now=now, shadow=True)
        blocks = m.block_ids + new
        pool.commit(blocks, self.history, now=now, num_tokens=m.num_tokens + self.chunk_tokens, hashes=self.chain)
        pool.free(blocks, now=now)
        assert m.num_tokens >= self.context
        self.now += 0.05


def shadow_chunks(use_chain: bool, backend: str, chunks: int = 64) -> list[float]:
    """Thread-CPU µs of each chunk's pool calls (the first chunk, which builds the chain, included)."""
    session, out = LongSession(use_chain, max_chunks=chunks, backend=backend), []
    for _ in range(chunks):
        t0 = time.thread_time_ns()
        session.chunk()
        out.append((time.thread_time_ns() - t0) / 1e3)
    return out


@pytest.mark.parametrize("backend", ["python", "native"])
@pytest.mark.parametrize("use_chain", [False, True], ids=["rehash", "page-hashes"])
def test_long_session_shadow_chunks(benchmark, use_chain, backend):
    session = LongSession(use_chain, max_chunks=40, backend=backend)
    benchmark.pedantic(session.chunk, rounds=32, iterations=1, warmup_rounds=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="spill/reload bandwidth needs a CUDA GPU")
def test_spill_reload_bandwidth():
    from shadowprefill.kv.spec import KVCacheSpec
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=BS, dtype=torch.bfloat16)
    n, num_blocks = 512, 4096                                   # 1 GiB moved per direction
    cache = spec.allocate(num_blocks, "cuda")
    cache.normal_()
    tier = HostTier(n, spec=spec, pin_memory=True)
    block_ids = sorted(random.Random(0).sample(range(num_blocks), n))   # scattered pages
    slots = list(range(n))

    def timed(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            event = fn()
            (event.synchronize() if event is not None else torch.cuda.synchronize())
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    nbytes = n * spec.page_bytes
    spill_s = timed(lambda: tier.spill(cache, block_ids, slots))
    torch.cuda.synchronize()
    assert torch.equal(tier.cache[:8].cuda(), cache[block_ids[:8]])   # the spill did move the pages

    def reload():                                               # layer-wise: one copy + event per layer
        batch = tier.reload(cache, slots, block_ids)
        tier.start_reloads(cache)
        batch.wait()                                            # the compute stream waits on the last layer
    reload_s = timed(reload)
    flat_dev, flat_host = cache[:n].view(-1), tier.cache.view(-1)

    def contiguous(dst, src):
        dst.copy_(src, non_blocking=True)
        return None
    d2h_s = timed(lambda: contiguous(flat_host, flat_dev))
    h2d_s = timed(lambda: contiguous(flat_dev, flat_host))
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    print(f"\nLlama-3-8B pages ({spec.page_bytes} B), {n} scattered pages = {nbytes / 2**30:.1f} GiB per direction: "
          f"spill {gbps(spill_s):.1f} GB/s = {d2h_s / spill_s:.2f} x contiguous pinned D2H ({gbps(d2h_s):.1f} GB/s); "
          f"layer-wise reload {gbps(reload_s):.1f} GB/s = {h2d_s / reload_s:.2f} x contiguous pinned H2D "
          f"({gbps(h2d_s):.1f} GB/s)")


if __name__ == "__main__":
    import sys
    backends = sys.argv[1:] or ["python", "native"]
    traces = {use_chains: record(2000, use_chains) for use_chains in (False, True)}
    for backend in backends:
        for use_chains, (trace, w) in traces.items():
            wall, cpu, pool = replay(trace, 1000, backend)
            assert pool.stats.as_dict() == w.pool.stats.as_dict()
            print(f"[{backend}] pool bookkeeping per iteration (bookkeeping-only pool, one thread, last 1000 of 2000 "
                  f"iterations, {'requests keep PageHashes (hashes=)' if use_chains else 'no hashes='}): "
                  f"wall {_summary(wall)}; thread CPU {_summary(cpu)}")
        for use_chain in (False, True):
            print(f"[{backend}] shadow chunk of 512 tokens on a 64K-token cached session, pool calls "
                  f"({'with the job PageHashes' if use_chain else 're-hashing the prefix'}): "
                  f"thread CPU {_summary(shadow_chunks(use_chain, backend))} per chunk")
    print(_describe(*traces[False][::-1]))
