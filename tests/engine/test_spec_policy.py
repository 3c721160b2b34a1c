"""When speculating pays, without a model: a verifying row is priced as the rows it adds to the step
(docs/speculative-decoding.md "When it pays"), and the step's shape counts it so."""

from __future__ import annotations

from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.step_cost import StepShape
from orcaserve.scheduler.core.step_output import SchedulerOutput
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.sampling_params import SamplingParams
from orcaserve.scheduler.spec.config import SpeculativeConfig
from orcaserve.scheduler.spec.policy import SpecPolicy


def _request(rid: str, prompt: int, computed: int, extra: int = 0) -> Request:
    req = Request(EngineRequest(rid, list(range(prompt)), SamplingParams(max_tokens=64), arrival_time=0.0))
    req.all_token_ids += [7] * extra
    req.num_computed_tokens = computed
    return req


def test_a_verifying_row_counts_as_decode_rows_in_the_step_shape():
    decode = _request("d", 8, 8, extra=1)  # one token to feed
    verify = _request("v", 8, 8, extra=1 + 3)  # its token and 3 proposals
    chunk = _request("p", 20, 4)  # a prompt chunk of 10 tokens
    out = SchedulerOutput(
        num_scheduled_tokens={"d": 1, "v": 4, "p": 10},
        requests={"d": decode, "v": verify, "p": chunk},
        spec={"v": [7, 7, 7]},
    )
    out.seal(True)
    assert out.shape is not None
    assert (out.shape.decode_rows, out.shape.prompt_tokens) == (1 + 4, 10)


class _Row:
    def __init__(self, i: int) -> None:
        self.request_id, self.num_computed_tokens = f"r{i}", 100


class _Sched:
    def __init__(self, n: int) -> None:
        self.sampling = [_Row(i) for i in range(n)]
        self.shape = StepShape(0, n, 0.0)


def _policy() -> SpecPolicy:
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert cfg is not None
    return SpecPolicy(cfg)


def test_proposals_are_priced_as_rows_not_as_prompt_tokens():
    """A fitted model where prompt tokens are cheap (a long prefill's GEMM) and a row costs 0.6 ms
    beside 8 ms of weight reads, rows accepting about 2 of 4 proposals (each accepted with a chance
    of 0.65 given the ones before): at one stream all 4 pay, at 32 rows none does (0.65 tokens for
    0.6 ms against the step's 32 tokens in 27.2 ms). Priced as prompt tokens they looked free."""
    policy = _policy()
    policy.cost.coefficients = [0.008, 0.00005, 0.0006, 0.0]  # intercept, prompt token, row, context
    for i in range(32):
        for _ in range(8):
            policy.observe(f"r{i}", 4, 2)
    one, full = _Sched(1), _Sched(32)
    assert policy.plan(one, one.sampling) == [(one.sampling[0], 4)]  # type: ignore[arg-type]
    assert policy.plan(full, full.sampling) == []  # type: ignore[arg-type]
    assert policy.declined_steps == 1
    extra = policy.extra_seconds(100, 3)
    assert abs(extra - 3 * 0.0006) < 1e-9


def test_k_follows_the_acceptance_and_the_price_of_a_row():
    """At one stream (8.7 ms a step, 0.6 ms a row) a request accepting half its proposals gets 3:
    the 4th would bring 1/16 of a token for 0.6 ms, less than the step already yields per second."""
    policy = _policy()
    policy.cost.coefficients = [0.0087, 0.0, 0.0006, 0.0]
    for _ in range(8):
        policy.observe("r0", 4, 1)  # one accepted, the next rejected: 0.5
    one = _Sched(1)
    assert policy.plan(one, one.sampling) == [(one.sampling[0], 3)]  # type: ignore[arg-type]
    policy.cost.coefficients = [0.0087, 0.0, 0.0, 0.0]  # rows free: the configured K
    assert policy.plan(one, one.sampling) == [(one.sampling[0], 4)]  # type: ignore[arg-type]


def test_rows_speculate_best_first_while_they_beat_the_step():
    """Rows that accept more go first; each chosen proposal raises what the step yields, and the rest
    stop when their gain per second no longer beats it."""
    policy = _policy()
    policy.cost.coefficients = [0.008, 0.0, 0.001, 0.0]
    for i in range(6):
        for _ in range(8):
            policy.observe(f"r{i}", 4, 4 if i < 2 else 1)
    sched = _Sched(6)  # 14 ms for 6 tokens
    chosen = policy.plan(sched, sched.sampling)  # type: ignore[arg-type]
    # r0 and r1 (0.95 a proposal) take 4 each; then the step yields 13 tokens in 22 ms, more per
    # second than the others' first proposal (0.5 tokens for 1 ms)
    assert [(r.request_id, k) for r, k in chosen] == [("r0", 4), ("r1", 4)]


def test_a_kind_of_proposal_that_fails_pauses_alone():
    """A request whose one-token guesses are rejected stops proposing them, and still speculates
    with its full K where its proposals come from long matches (a copied run), which it accepts."""
    policy = _policy()
    policy.cost.coefficients = [0.0087, 0.0, 0.0006, 0.0]
    for _ in range(8):
        policy.observe("r0", 4, 0, kind=0)
        policy.observe("r0", 4, 4, kind=3)
    one = _Sched(1)
    row = one.sampling[0]
    assert policy.plan(one, one.sampling, {"r0": 0}) == []  # type: ignore[arg-type]
    assert policy.plan(one, one.sampling, {"r0": 3}) == [(row, 4)]  # type: ignore[arg-type]
    assert policy.plan(one, one.sampling) == []  # type: ignore[arg-type]  # no kind given: kind 0


def test_a_new_request_starts_from_the_engines_acceptance_of_its_kind():
    """A request's first long match is sized from what the engine's earlier requests accepted of that
    kind (a copied run, nearly all accepted: the full K), not from the default's one half (K = 3 at
    this price, the test above); a kind the engine accepts poorly starts at the default, not lower,
    so a new request keeps its probation."""
    policy = _policy()
    policy.cost.coefficients = [0.0087, 0.0, 0.0006, 0.0]
    first, second, third = _Sched(1), _Sched(1), _Sched(1)
    second.sampling[0].request_id, third.sampling[0].request_id = "r1", "r2"
    assert policy.plan(first, first.sampling, {"r0": 3}) == [(first.sampling[0], 3)]  # nothing learnt: one half
    for i in range(8):
        policy.observe(f"done{i}", 4, 4, kind=3)
        policy.observe(f"done{i}", 4, 0, kind=0)
        policy.drop(f"done{i}")
    assert policy.plan(second, second.sampling, {"r1": 3}) == [(second.sampling[0], 4)]
    assert policy.plan(third, third.sampling, {"r2": 0}) == [(third.sampling[0], 3)]
