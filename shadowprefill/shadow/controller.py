"""The shadow-prefill controller: how much shadow work joins one iteration (paper §3.2, Algorithm 1).

    1: if waiting queue nonempty or admission blocked then return 0
    3: else if B = ∅ then b ← βT                              (idle instance)
    5: else if B holds a routed call then b ← min(credit, βT)  (C2, routed-step protection; capped by the budget)
    7: else b ← min(βT, min_{r∈B} σ_r)                       (C1, SLO slack)
   10: n ← max{n : t̂(B + n shadow tokens) ≤ b}
   11: n ← min(n, free shadow KV)
   12: if n < n_min then return 0
   15: take n tokens from jobs in Q by switch probability

The controller is engine-free: `plan(view)` reads an `IterationView` (view.py) and returns a
`ShadowBudget` for lines 10-12; whoever holds the shadow work (this project's scheduler over its shadow
requests, `engine.shadow_work.take`, or the vLLM plugin over vLLM's own shadow requests) asks the budget how many tokens a chunk at a given cached
context may have (`max_tokens`) and records what it took (`take`). `end_iteration` accrues the credit.

σ_r is Eq. 1 for a decoding request, σ_r = f_r + (1−m)·T_r·(k_r+1) − t, and the TTFT slack
a_r + (1−m)·F_r − t − p̂_r for a prefilling one, p̂_r being t̂ of its chunks after this iteration
(σ_r bounds the length of this iteration, so the current chunk is not counted twice).

Readings we had to fix, since the paper leaves them open:
- Credit (line 6) pays only for the time the shadow tokens add, t̂(B+n) − t̂(B) ≤ b: the routed call's
  own iteration time is not the shadow's to spend, and this is what bounds the routed calls' long-run
  slowdown by δ (§3.2). It accrues δ × the duration of decode-only iterations (Harvest-SLO, δ = 0.025) or
  of every busy iteration (Harvest, δ = 0.1, which uses the credit on every busy iteration, Table 2).
- The credit is spent "capped by the budget" (§3.2), the budget being line 8's smallest slack in the batch:
  under Harvest-SLO the chunks must also keep t̂(B + n) ≤ min_{r∈B} σ_r, so an iteration carrying a routed
  call never pushes a request in it past its Eq. 1 line ("requests close to their deadline block it").
  Line 6 alone would let the credit stretch routed iterations whose normal decodes are already late.
- Line 10 with several jobs: jobs are taken in order (line 15); each gets the largest whole-page chunk
  that keeps t̂ within b given the chunks before it, at its own cached context, and chunks below n_min are
  deferred (appendix C: each chunk re-reads the whole cached context). `idle_cap_s` overrides βT.
- A chunk whose cached prefix must come back from the host tier reads it through a layer-wise reload
  that overlaps the iteration's compute (issue 15): t̂ grows only by what the compute does not hide,
  overlap(c, n) − c at the iteration's compute c with the chunk (`reload=`, ShadowBudget.reload_s).
"""
from __future__ import annotations

import math

from shadowprefill.shadow.policy import BETA, MARGIN, N_MIN, ShadowPolicy, get_shadow_policy
from shadowprefill.shadow.view import IterationView

SLO_DECODE_CONTEXT = 1024   # context of the "batch-1 decode" that sets the default TPOT SLO
LIVENESS_S = 1.0            # an idle instance whose budget admits no chunk still probes this often (probe_due)


def default_tpot_slo(predictor, *, minimum: float = 0.025, factor: float = 5.0) -> float:
    """§5.1: TPOT SLO = max(25 ms, 5 × batch-1 decode)."""
    return max(minimum, factor * predictor.decode_time(SLO_DECODE_CONTEXT))


def default_ttft_slo(predictor, prompt_len: int, chunk: int, *, minimum: float = 1.0, factor: float = 5.0) -> float:
    """§5.1: TTFT SLO = max(1 s, 5 × isolated prefill of the prompt in chunks of `chunk` tokens)."""
    return max(minimum, factor * predictor.prefill_time(prompt_len, 0, chunk))


class ShadowBudget:
    """One iteration's allowance for shadow work (Algorithm 1 lines 10-12), spent chunk by chunk.

    `seconds` is b and `branch` the line that set it ("blocked", "idle", "credit", "slo"). For "credit"
    b bounds the time the shadow chunks add; otherwise it bounds the whole iteration, t̂(B + chunks).
    `n_min` is the smallest chunk worth running (line 12). `scale`: the feedback shrink b carries (t̂'s
    `budget_scale` when it was planned). `probe`: set by `ShadowController.probe_due`: the iteration runs
    one chunk of n_min tokens whatever b says, so feedback does not judge it against b."""

    __slots__ = ("seconds", "branch", "n_min", "scale", "probe", "_used_s", "tokens", "chunks", "_pred", "_ctl",
                 "_marginal", "_token_room", "_seq_room", "_kv_room", "_view", "_batch_s")

    def __init__(self, seconds: float, branch: str, *, n_min: int = 0, predictor=None, base_s: float | None = 0.0,
                 token_room: int = 0, seq_room: int = 0, view: IterationView | None = None,
                 controller: "ShadowController | None" = None, scale: float = 1.0) -> None:
        self.seconds, self.branch, self.n_min = seconds, branch, max(n_min, 1)
        self.scale, self.probe = scale, False
        self._used_s = base_s                    # t̂ so far (None: t̂(B), computed when first needed)
        self.tokens = 0                          # shadow tokens taken
        self.chunks = 0
        self._pred, self._ctl, self._view = predictor, controller, view
        self._marginal = branch == "credit"
        self._token_room, self._seq_room = token_room, seq_room
        self._kv_room = -1                       # line 11, read when first needed
        self._batch_s = None                     # credit branch: t̂(B), read when first needed

    @property
    def predictor(self):
        """t̂ the budget is spent against (read-only use: `chunk_time`, `predict`)."""
        return self._pred

    @property
    def used_s(self) -> float:
        """t̂ of what the iteration holds so far (for the credit branch: only the time shadow chunks add)."""
        if self._used_s is None:
            view = self._view
            self._used_s = self._pred.predict(view.prefill_pairs(), view.decode_contexts())
        return self._used_s

    @property
    def open(self) -> bool:
        """Whether a chunk of n_min fresh tokens could still fit (time, tokens, sequences)."""
        return (self.seconds > 0.0 and self.chunks < self._seq_room
                and min(self._token_room - self.tokens, self._pred.max_chunk(self.used_s, 0, self.seconds))
                >= self.n_min)

    def room(self) -> int:
        """Tokens the iteration could still take (token budget; free shadow KV once it was read)."""
        room = self._token_room - self.tokens
        if self._kv_room >= 0:
            room = min(room, self._kv_room - self.tokens)
        return room if self.chunks < self._seq_room else 0

    @property
    def iteration_s(self) -> float:
        """t̂ of the whole iteration so far (the batch and the chunks taken): the compute a reload overlaps."""
        if not self._marginal:
            return self.used_s
        if self._batch_s is None:
            view = self._view
            self._batch_s = self._pred.predict(view.prefill_pairs(), view.decode_contexts())
        return self._batch_s + self.used_s

    def reload_s(self, reload, tokens: int = 0, context: int = 0) -> float:
        """The time a layer-wise host-tier reload adds beyond the compute that hides it, with a chunk of
        `tokens` at `context` in the iteration. `reload` = (overlap, reload_tokens), overlap(compute_s, n) the
        iteration's seconds (model.latency.LatencyModel.overlapped_time): overlap(c, n) − c at c =
        iteration_s + the chunk's t̂ (the longer the compute, the less of the copy shows)."""
        overlap, n = reload
        c = self.iteration_s + (self._pred.chunk_time(tokens, context) if tokens else 0.0)
        return overlap(c, n) - c

    def fits(self, context: int, extra_s: float = 0.0, reload=None) -> int:
        """Line 10: the largest chunk at `context` cached tokens (plus `extra_s`) within b. With `reload`
        (see reload_s) the chunk's t̂ plus what its reload adds must fit; since that is non-decreasing in the
        chunk (overlap is), the largest such k is found by bisection between the chunk that fits with the
        reload's cost at no chunk (which only shrinks as the chunk grows) and the one that fits without it."""
        pred, base = self._pred, self.used_s + extra_s
        best = pred.max_chunk(base, context, self.seconds)
        if reload is None:
            return best

        def ok(k: int) -> bool:
            return base + pred.chunk_time(k, context) + self.reload_s(reload, k, context) <= self.seconds

        lo = pred.max_chunk(base + self.reload_s(reload), context, self.seconds)
        if not ok(lo):
            return 0
        while lo < best:                                     # ok(lo) holds; find the largest k <= best
            mid = (lo + best + 1) // 2
            lo, best = (mid, best) if ok(mid) else (lo, mid - 1)
        return lo

    def read_kv_room(self, block_size: int) -> int:
        """Line 11: read the free shadow KV (once; whole pages) and return room() with it."""
        if self._kv_room < 0:
            limit = (self._token_room // block_size + 1) * block_size
            self._kv_room = self._view.free_shadow(limit) // block_size * block_size
        return self.room()

    def max_tokens(self, context: int, extra_s: float = 0.0, block_size: int = 1,
                   remaining: int | None = None) -> int:
        """Lines 10-12 for one chunk: the most tokens (a multiple of `block_size`) a chunk at `context`
        cached tokens may add now, 0 if that is below n_min. `remaining`: the work's tokens left; a last
        chunk shorter than n_min is allowed when all of it fits (a shadow request that must finish)."""
        k = min(self.read_kv_room(block_size), self.fits(context, extra_s))
        if remaining is not None and remaining < self.n_min:
            return remaining if 0 < remaining <= k else 0
        k -= k % block_size
        return k if k >= self.n_min else 0

    def take(self, tokens: int, context: int, extra_s: float = 0.0, reload=None) -> float:
        """Record a chunk of `tokens` at `context` cached tokens (plus `extra_s`, plus what its `reload` adds:
        reload_s); returns its added t̂. In the credit branch the added time is paid from the credit."""
        added = self._pred.chunk_time(tokens, context) + extra_s
        if reload is not None:
            added += self.reload_s(reload, tokens, context)
        self._used_s = self.used_s + added
        self.tokens += tokens
        self.chunks += 1
        if self._marginal:
            self._ctl.spend(added)
        return added

    @property
    def bound_s(self) -> float:
        """What the iteration was allowed before the feedback shrink: b / scale, plus t̂(B) where b bounds only
        the time the chunks add (credit). Feedback judges a measured step against this, not the shrunk b: a
        step near t̂ judged against the shrunk b shrank it again, down to its floor (predictor.feedback)."""
        allowed = self.seconds / self.scale
        if not self._marginal:
            return allowed
        return self.iteration_s - self.used_s + allowed

    @property
    def fresh_tokens(self) -> int:
        """The tokens a chunk on no cached context could still add (what a stats line reports)."""
        if self.seconds <= 0.0:
            return 0
        return max(0, min(self._token_room - self.tokens, self._pred.max_chunk(self.used_s, 0, self.seconds)))

    def __repr__(self) -> str:
        return f"ShadowBudget({self.branch}, {self.seconds * 1e3:.2f} ms, taken {self.tokens} tokens)"


class ShadowController:
    """Algorithm 1 for one instance: a policy, a latency predictor t̂ and the credit.

    `predictor`: `max_chunk(base_s, cached, budget_s)`, `chunk_time(n, cached)`, `prefill_time(n, cached,
    chunk)`, `predict_features(p, pc, d, dc)` (`shadow.predictor.IterationPredictor`). `tpot_slo`: T of βT.
    `token_budget` / `max_seqs`: the engine's per-iteration limits, which shadow chunks share. `feedback`:
    `end_iteration` tells t̂ the measured time of an iteration whose chunks had to fit b (the plan before it);
    a host with several iterations in flight (the vLLM plugin) passes False and reports them itself."""

    def __init__(self, policy: "str | ShadowPolicy", predictor, *, tpot_slo: float, token_budget: int = 2048,
                 max_seqs: int = 256, beta: float = BETA, delta: float | None = None, margin: float = MARGIN,
                 n_min: int = N_MIN, idle_cap_s: float | None = None, feedback: bool = True) -> None:
        self.policy = get_shadow_policy(policy)
        for name, value in (("tpot_slo", tpot_slo), ("beta", beta), ("margin", margin)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if delta is not None and not (isinstance(delta, (int, float)) and delta >= 0):
            raise ValueError(f"delta must be a number >= 0, got {delta!r}")
        self.predictor = predictor
        self.tpot_slo = float(tpot_slo)
        self.token_budget, self.max_seqs = token_budget, max_seqs
        self.margin, self.n_min = margin, n_min
        self.delta = self.policy.default_delta if delta is None else float(delta)
        self._beta, self._idle_cap_s = beta, idle_cap_s
        self.cap = idle_cap_s if idle_cap_s is not None else beta * self.tpot_slo    # βT
        self.credit = 0.0
        self.credit_earned = 0.0
        self.credit_spent = 0.0
        self.branch_counts = {"blocked": 0, "idle": 0, "credit": 0, "slo": 0}
        self.probes = 0                  # liveness probes (probe_due)
        self._last_progress = -math.inf  # view.now of the last plan whose iteration ran shadow tokens
        self.last_branch = ""
        self.last_budget = 0.0
        self.feedback = feedback         # end_iteration reports b overruns (a host with steps in flight: False)
        self._planned: ShadowBudget | None = None

    # ----------------------------------------------------------------------------------- Alg. 1 1-9
    def budget_seconds(self, view: IterationView) -> tuple[float, str]:
        """Lines 1-9: the time budget b (seconds) and the branch that set it."""
        branch = self.branch(view)
        return self._seconds(branch, view), branch

    def branch(self, view: IterationView) -> str:
        """Which of lines 1-9 sets b: "blocked", "idle", "credit" or "slo"."""
        return self.branch_of(view.waiting, view.admission_blocked, view.has_requests, view.has_routed)

    def branch_of(self, waiting: bool, admission_blocked: bool, has_requests: bool, has_routed: bool) -> str:
        """`branch` from the four facts of B it reads."""
        policy = self.policy
        if not policy.runs_jobs or waiting or admission_blocked:             # line 1
            return "blocked"
        if not has_requests:                                                   # line 3
            return "idle"
        if not policy.slo_slack or has_routed:                                 # line 5 (Harvest: every busy it.)
            return "credit"
        return "slo"

    def _seconds(self, branch: str, view: IterationView) -> float:
        if branch == "slo":
            return min(self.cap, self.min_slack(view))                         # line 8
        if branch == "credit":
            b = min(self.credit, self.cap)                                     # line 6
            if self.policy.slo_slack and b > 0.0:                              # ... capped by the budget (§3.2)
                b = min(b, self.min_slack(view) - self.predictor.predict(view.prefill_pairs(), view.decode_contexts()))
            return b
        return self.cap if branch == "idle" else 0.0                           # lines 4, 2

    def min_slack(self, view: IterationView) -> float:
        """min_{r∈B} σ_r: Eq. 1 for decoding requests, TTFT slack for prefilling ones."""
        now, step = view.now, 1.0 - self.margin
        decodes = view.decodes                                                 # Eq. 1
        best = min([r.first_token_time + step * r.tpot_slo * (r.num_decode_iters + 1) for r in decodes]) \
            if decodes else math.inf
        best -= now
        chunk, pred = self.token_budget, self.predictor
        for r, n in view.prefills:
            if r.first_token_time is None:                                     # a_r + (1-m) F_r - t - p̂_r
                rest = r.num_remaining - n
                p_hat = pred.prefill_time(rest, r.num_computed_tokens + n, chunk) if rest > 0 else 0.0
                slack = r.arrival_time + step * r.ttft_slo - now - p_hat
            else:                                                              # recomputing: still Eq. 1
                slack = r.first_token_time + step * r.tpot_slo * (r.num_decode_iters + 1) - now
            best = min(best, slack)
        return best

    # ---------------------------------------------------------------------------------- Alg. 1 10-12
    def plan(self, view: IterationView) -> ShadowBudget:
        """Budget one iteration; the caller spends it chunk by chunk (line 15). (A caller with no shadow work
        to place calls `count_idle_plan` instead.)"""
        branch = self.branch(view)
        self.branch_counts[branch] += 1
        b = self._seconds(branch, view) * self.predictor.budget_scale                 # feedback (predictor.py)
        self.last_branch, self.last_budget = branch, b
        if b <= 0.0:
            return ShadowBudget(0.0, branch, n_min=self.n_min, predictor=self.predictor, view=view,
                                controller=self)
        self._planned = ShadowBudget(b, branch, n_min=self.n_min, predictor=self.predictor,
                                     base_s=0.0 if branch == "credit" else None,
                                     token_room=self.token_budget - view.num_tokens,
                                     seq_room=self.max_seqs - view.num_seqs, view=view, controller=self,
                                     scale=self.predictor.budget_scale)
        return self._planned

    def count_idle_plan(self, waiting: bool, admission_blocked: bool, has_requests: bool, has_routed: bool) -> None:
        """What `plan` records, for a host with no shadow work to place (it builds no view): the branch of B
        is counted and b is 0 (not computed)."""
        branch = self.branch_of(waiting, admission_blocked, has_requests, has_routed)
        self.branch_counts[branch] += 1
        self.last_branch, self.last_budget = branch, 0.0

    def probe_due(self, budget: ShadowBudget) -> bool:
        """Liveness: whether an idle iteration (line 3) whose `budget` admits no shadow chunk runs one probe
        of n_min tokens anyway; then `budget.probe` is set. Due once LIVENESS_S passed since the last
        iteration with shadow tokens (`progressed`). Only a measured step relaxes t̂'s feedback shrink or
        corrects t̂, so without probes an idle instance whose b had shrunk below one chunk (a cold first
        forward, a machine busy for a moment) never ran shadow work again. An idle iteration delays no
        request in it; the cost is a routed call that arrives during the probe."""
        if budget.branch != "idle" or budget._view is None or budget.room() < 1:
            return False
        if budget._view.now - self._last_progress < LIVENESS_S:
            return False
        budget.probe = True
        self.probes += 1
        return True

    def progressed(self, now: float) -> None:
        """An iteration planned at `now` ran shadow tokens (probe_due's clock). end_iteration calls this for
        the plan it judges; a host with steps in flight (feedback=False) calls it itself."""
        self._last_progress = max(self._last_progress, now)

    def set_tpot_slo(self, tpot_slo: float) -> None:
        """Change T (e.g. once an engine's step times are measured): βT follows unless `idle_cap_s` fixed it."""
        if isinstance(tpot_slo, bool) or not isinstance(tpot_slo, (int, float)) or not 0 < tpot_slo < math.inf:
            raise ValueError(f"tpot_slo must be a finite number > 0, got {tpot_slo!r}")
        self.tpot_slo = float(tpot_slo)
        if self._idle_cap_s is None:
            self.cap = self._beta * self.tpot_slo

    def spend(self, seconds: float) -> None:
        """Pay `seconds` of shadow time from the credit (line 6)."""
        self.credit -= seconds
        self.credit_spent += seconds

    # -------------------------------------------------------------------------------- after execution
    def end_iteration(self, duration: float, *, busy: bool, decode_only: bool) -> None:
        """Credit accrual: δ × duration of decode-only iterations (Harvest-SLO) or of every busy iteration
        (Harvest) (§3.2, Table 2). `busy`: the iteration carried routed or normal work; `decode_only`: only
        decodes (no prefill chunk, no shadow chunk). With `feedback`, an iteration that ran shadow chunks reports
        its measured time to t̂ (predictor.feedback: against `bound_s`, b before the shrink, and t̂ of the
        iteration; a liveness probe is not judged) and counts as shadow progress (`progressed`)."""
        planned, self._planned = self._planned, None
        if self.feedback and planned is not None and planned.tokens:
            self.progressed(planned._view.now)
            if not planned.probe:                    # judged against b before the shrink, beside t̂
                self.predictor.feedback(planned.bound_s, duration, planned.iteration_s)
        policy = self.policy
        if not policy.runs_jobs:
            return
        if decode_only if not policy.credit_on_busy else busy:
            earned = self.delta * duration
            self.credit += earned
            self.credit_earned += earned
