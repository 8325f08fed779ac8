"""The shadow-prefill controller: how many shadow tokens join one iteration (paper §3.2, Algorithm 1).

    1: if waiting queue nonempty or admission blocked then return 0
    3: else if B = ∅ then b ← βT                              (idle instance)
    5: else if B holds a routed call then b ← min(credit, βT)  (C2, routed-step protection)
    7: else b ← min(βT, min_{r∈B} σ_r)                       (C1, SLO slack)
   10: n ← max{n : t̂(B + n shadow tokens) ≤ b}
   11: n ← min(n, free shadow KV)
   12: if n < n_min then return 0
   15: take n tokens from jobs in Q by switch probability

σ_r is Eq. 1 for a decoding request, σ_r = (1−m)·T_r·(k_r+1) − (t − f_r), and the TTFT slack
(1−m)·F_r − (t − a_r) − p̂_r for a prefilling one, p̂_r being t̂ of its chunks after this iteration
(σ_r bounds the length of this iteration, so the current chunk is not counted twice).

Two readings we had to fix, since the paper leaves them open:
- Credit (line 6) pays only for the time the shadow tokens add, t̂(B+n) − t̂(B) ≤ b: the routed call's
  own iteration time is not the shadow's to spend, and this is what bounds the routed calls' long-run
  slowdown by δ (§3.2). The credit accrues δ × the duration of decode-only iterations (Harvest-SLO,
  δ = 0.025) or of every busy iteration (Harvest, δ = 0.1, which uses the credit on every busy
  iteration, Table 2), and what is spent is the predicted added time.
- Line 10 with several jobs: jobs are taken in order (line 15); each gets the largest whole-page chunk
  that keeps t̂ within b given the chunks before it, at its own cached context, and chunks below n_min
  are deferred (appendix C: each chunk re-reads the whole cached context). T in βT is the engine's TPOT
  SLO; `idle_cap_s` overrides βT.
- A job whose cached prefix was spilled must reload it before its chunk can attend to it, and the batch
  waits for that reload: the reload time (the latency model's `reload_time`, when it has one) counts in
  t̂ like the chunk's compute, so a shadow never stretches an iteration past b through its reloads.

Default SLOs (§5.1): TTFT ≤ max(1 s, 5 × isolated prefill), TPOT ≤ max(25 ms, 5 × batch-1 decode).
"""
from __future__ import annotations

import math

from shadowprefill.shadow.jobs import ShadowJob, ShadowJobQueue

SLO_DECODE_CONTEXT = 1024   # context of the "batch-1 decode" that sets the default TPOT SLO


class ShadowChunk:
    """Shadow work of one iteration: tokens [start, start + num_new) of a job's history, written into
    shadow-class pages; produces no token. Holds page references only while in flight."""

    __slots__ = ("job", "token_ids", "start", "num_new", "block_ids", "version", "ready_event", "page_hashes")

    def __init__(self, job: ShadowJob, token_ids: list[int], start: int, num_new: int, block_ids: list[int],
                 ready_event=None, page_hashes=None) -> None:
        self.job = job
        self.token_ids = token_ids      # the job's history; [0, start + num_new) is what the chunk computes
        self.page_hashes = page_hashes  # token_ids' kv.PageHashes (None: commit hashes the new pages)
        self.start = start
        self.num_new = num_new
        self.block_ids = block_ids
        self.version = job.version
        self.ready_event = ready_event

    @property
    def new_token_ids(self) -> list[int]:
        return self.token_ids[self.start:self.start + self.num_new]

    def __repr__(self) -> str:
        return f"ShadowChunk({self.job.session_id!r}, [{self.start}, {self.start + self.num_new}))"


class ShadowController:
    """Algorithm 1 over one engine's scheduler batches, job queue and KV pool."""

    def __init__(self, config, predictor, jobs: ShadowJobQueue, pool, *, tpot_slo: float | None = None) -> None:
        self.config = config
        self.mode = config.shadow_mode
        self.predictor = predictor
        self.jobs = jobs
        self.pool = pool
        self.block_size = config.block_size
        self.delta = config.effective_delta
        self.tpot_slo = tpot_slo if tpot_slo is not None else self.default_tpot_slo()
        self.cap = config.idle_cap_s if config.idle_cap_s is not None else config.beta * self.tpot_slo  # βT
        self.reload_time = getattr(getattr(predictor, "latency_model", None), "reload_time", None)
        self.credit = 0.0
        self.credit_earned = 0.0
        self.credit_spent = 0.0
        self.branch_counts = {"blocked": 0, "idle": 0, "credit": 0, "slo": 0}
        self.last_branch = ""
        self.last_budget = 0.0

    # ------------------------------------------------------------------------------------------- SLOs
    def default_tpot_slo(self) -> float:
        """TPOT SLO: the configured one, else max(25 ms, 5 × batch-1 decode) (§5.1)."""
        cfg = self.config
        if cfg.tpot_slo_s is not None:
            return float(cfg.tpot_slo_s)
        return max(cfg.min_tpot_slo_s, cfg.slo_factor * self.predictor.decode_time(SLO_DECODE_CONTEXT))

    def default_ttft_slo(self, prompt_len: int) -> float:
        """TTFT SLO: the configured one, else max(1 s, 5 × isolated prefill of the prompt) (§5.1)."""
        cfg = self.config
        if cfg.ttft_slo_s is not None:
            return float(cfg.ttft_slo_s)
        isolated = self.predictor.prefill_time(prompt_len, 0, cfg.token_budget)
        return max(cfg.min_ttft_slo_s, cfg.slo_factor * isolated)

    # ----------------------------------------------------------------------------------- Alg. 1 1-9
    def budget(self, batch, now: float) -> tuple[float, str]:
        """Lines 1-9: the time budget b (seconds) and the branch that set it:
        "blocked" (b = 0), "idle" (b bounds the iteration), "credit" (b bounds the time the shadow adds),
        "slo" (b bounds the iteration)."""
        if self.mode not in ("harvest", "harvest-slo"):
            return 0.0, "blocked"
        if batch.waiting_nonempty or batch.admission_blocked:        # line 1
            return 0.0, "blocked"                                     # line 2
        if not batch.has_requests:                                    # line 3
            return self.cap, "idle"                                   # line 4
        if self.mode == "harvest" or batch.has_routed:               # line 5 (Harvest: every busy iteration)
            return min(self.credit, self.cap), "credit"               # line 6
        return min(self.cap, self.min_slack(batch, now)), "slo"      # line 8

    def min_slack(self, batch, now: float) -> float:
        """min_{r∈B} σ_r: Eq. 1 for decoding requests, TTFT slack for prefilling ones."""
        best = math.inf
        for r in batch.decodes:
            if r.tpot_deadline < best:
                best = r.tpot_deadline          # f_r + (1-m) T_r (k_r + 1), kept by the engine (Eq. 1)
        best -= now
        budget = self.config.token_budget
        for r, n in batch.prefills:
            if r.first_token_time is None:      # (1-m) F_r - (t - a_r) - p̂_r
                rest = r.num_remaining - n
                p_hat = self.predictor.prefill_time(rest, r.num_computed_tokens + n, budget) if rest > 0 else 0.0
                slack = r.ttft_deadline - now - p_hat
            else:                               # recomputing after preemption: still Eq. 1
                slack = r.tpot_deadline - now
            best = min(best, slack)
        return best

    # ---------------------------------------------------------------------------------- Alg. 1 10-16
    def plan(self, batch, now: float) -> list[ShadowChunk]:
        """Budget this iteration and take shadow chunks from the jobs (refs held until `complete`)."""
        b, branch = self.budget(batch, now)
        self.branch_counts[branch] += 1
        self.last_branch, self.last_budget = branch, b
        if b <= 0.0 or len(self.jobs) == 0:
            return []
        cfg, bs, pred = self.config, self.block_size, self.predictor
        n_min = cfg.n_min
        smallest = max(n_min, 1)
        marginal = branch == "credit"
        used = 0.0 if marginal else pred.predict_features(*batch.features(include_shadow=False))
        token_room = cfg.token_budget - batch.num_tokens
        seq_room = cfg.max_seqs - batch.num_seqs
        if min(token_room, pred.max_chunk(used, 0, b)) < smallest or seq_room <= 0:
            return []                                     # not even a fresh job's chunk fits
        kv_room = -1                                      # line 11, read when first needed
        chunks: list[ShadowChunk] = []
        total = 0
        for job in self.jobs.runnable(n_min, cfg.shadow_min_switch_prob):   # line 15: by switch probability
            room = token_room - total
            if kv_room >= 0:
                room = min(room, kv_room - total)
            if room < smallest or len(chunks) >= seq_room:
                break
            # Upper bound from the job's belief first: no prefix lookup for a job that cannot fit.
            k = min(job.pending_tokens(bs), room, pred.max_chunk(used, job.num_cached, b))   # line 10
            if k - k % bs < smallest:
                continue
            if kv_room < 0:
                kv_room = self.free_shadow_blocks(now, limit=token_room // bs + 1) * bs       # line 11
                room = min(room, kv_room)
                if room < smallest:
                    break
            limit = job.shadowable_tokens(bs)
            if job.page_hashes is None or job.page_hashes.tokens is not job.token_ids:
                job.page_hashes = self.pool.page_hash_chain(job.token_ids, tenant=job.tenant)
            if self.reload_time is not None and self.pool.host_tier is not None:
                dev, host = self.pool.peek_prefix(job.token_ids, tenant=job.tenant, max_tokens=limit,
                                                  hashes=job.page_hashes)
                if host:                # no reload (acquire) unless the chunk fits beside it
                    k = min(limit - dev - host, room, pred.max_chunk(used + self.reload_time(host), dev + host, b))
                    if k - k % bs < smallest:
                        job.num_cached = dev + host
                        continue
            match = self.pool.acquire_prefix(job.token_ids, now=now, tenant=job.tenant, shadow=True,
                                             max_tokens=limit, hashes=job.page_hashes)
            start = match.num_tokens
            job.num_cached = start
            reload = self.reload_time(match.host_tokens) if match.host_tokens and self.reload_time else 0.0
            k = min(limit - start, room, pred.max_chunk(used + reload, start, b))              # line 10
            k -= k % bs                                                                         # whole pages
            if k < smallest:                                                                    # line 12
                self.pool.release(match.block_ids, now=now)
                continue
            blocks = self.pool.allocate(k // bs, now=now, shadow=True)
            if blocks is None:                                                                  # line 11
                self.pool.release(match.block_ids, now=now)
                break
            # the job's token list is only appended to (a rewrite replaces it): no O(context) snapshot copy
            chunks.append(ShadowChunk(job, job.token_ids, start, k, list(match.block_ids) + blocks,
                                      match.ready_event, job.page_hashes))
            batch.reload_tokens += match.host_tokens
            added = pred.chunk_time(k, start) + reload
            used += added
            total += k
            if marginal:
                self.credit -= added
                self.credit_spent += added
            if pred.max_chunk(used, 0, b) < smallest:       # the budget is spent
                break
        return chunks                                                                           # line 16

    def free_shadow_blocks(self, now: float, limit: int | None = None) -> int:
        """Pages a shadow chunk may take now (at most `limit`): free or cold pages within the shadow cap
        (line 11)."""
        return self.pool.available_blocks(now=now, shadow=True, limit=limit)

    # -------------------------------------------------------------------------------- after execution
    def complete(self, chunks: list[ShadowChunk], now: float) -> int:
        """Register the chunks' pages in the prefix cache (shadow class), drop the references, advance
        the jobs. Returns the shadow tokens computed."""
        total = 0
        for c in chunks:
            end = c.start + c.num_new
            hashes = c.page_hashes if c.page_hashes is not None and c.page_hashes.tokens is c.token_ids else None
            self.pool.commit(c.block_ids, c.token_ids, now=now, tenant=c.job.tenant, num_tokens=end,
                             hashes=hashes)
            self.pool.release(c.block_ids, now=now)
            job = c.job
            job.tokens_computed += c.num_new
            if self.jobs.get(job.session_id) is job and job.version == c.version and end > job.num_cached:
                job.num_cached = end
            total += c.num_new
        return total

    def on_iteration_end(self, batch, duration: float) -> None:
        """Credit accrual: δ × duration of decode-only iterations (Harvest-SLO) or of every busy
        iteration (Harvest) (§3.2, Table 2)."""
        if self.mode == "harvest-slo":
            if batch.is_decode_only:
                self.credit += self.delta * duration
                self.credit_earned += self.delta * duration
        elif self.mode == "harvest" and batch.has_requests:
            self.credit += self.delta * duration
            self.credit_earned += self.delta * duration
