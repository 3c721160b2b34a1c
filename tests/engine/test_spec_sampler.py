"""The rejection sampler keeps the target's distribution (total variation under 0.01 over 200k
draws, vectorised), a seeded one repeats itself; the prompt-lookup proposer finds what it should;
the step's speculation policy pays only while it should."""

from __future__ import annotations

import torch

from orcaserve.scheduler.core.step_cost import StepShape
from orcaserve.scheduler.spec.config import SpeculativeConfig
from orcaserve.scheduler.spec.policy import SpecPolicy, match_kind
from orcaserve.scheduler.spec.proposers import NgramProposer
from orcaserve.scheduler.spec.verify import accepted_length, rejection_sample

DRAWS = 200_000
VOCAB = 12
K = 3


def _dist(gen: torch.Generator, rows: int) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64) * 2.5, -1)


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * float((freq - probs).abs().sum())


def _check_keeps_target(draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor, p: torch.Tensor) -> int:
    """Position-independent targets p[j] (so position 1's law is checked too): the first emitted
    token follows p[0]; the second, where a row emitted one, p[1], and where it stopped after one,
    the next step would sample p[1] itself, so the pairs (first, second) follow p[0] x p[1]."""
    gen = torch.Generator().manual_seed(0)
    target = p[None].expand(DRAWS, -1, -1).contiguous()  # [N, K + 1, V]
    out, emitted = rejection_sample(target, draft_tokens, draft_probs, generator=gen)
    assert bool((emitted >= 1).all()) and bool((emitted <= K + 1).all())
    assert _tv(out[:, 0], p[0]) < 0.01
    second = torch.where(emitted > 1, out[:, 1], torch.multinomial(p[1], DRAWS, replacement=True, generator=gen))
    assert _tv(out[:, 0] * VOCAB + second, (p[0][:, None] * p[1][None]).flatten()) < 0.01
    full = emitted == K + 1  # every proposal accepted: the bonus token follows p[K]
    if int(full.sum()) >= 10_000:
        assert _tv(out[full, K], p[K]) < 0.03
    return int(full.sum())


def test_point_mass_proposals_keep_the_target_distribution():
    gen = torch.Generator().manual_seed(1)
    p = _dist(gen, K + 1)
    drafts = p[:K].argmax(-1)[None].expand(DRAWS, -1).contiguous()  # likely proposals: long runs
    assert _check_keeps_target(None, drafts, p) >= 10_000
    drafts = torch.randint(0, VOCAB, (DRAWS, K), generator=gen)  # proposals of any quality
    _check_keeps_target(None, drafts, p)


def test_draft_distribution_proposals_keep_the_target_distribution():
    gen = torch.Generator().manual_seed(2)
    p, q = _dist(gen, K + 1), _dist(gen, K)
    q_rows = q[None].expand(DRAWS, -1, -1).contiguous()  # [N, K, V]
    drafts = torch.stack([torch.multinomial(q[j], DRAWS, replacement=True, generator=gen) for j in range(K)], 1)
    _check_keeps_target(q_rows, drafts, p)


def test_seeded_rejection_sampling_repeats_itself():
    gen = torch.Generator().manual_seed(3)
    p = _dist(gen, K + 1)[None].expand(64, -1, -1).contiguous()
    drafts = torch.randint(0, VOCAB, (64, K), generator=gen)
    a = rejection_sample(p, drafts, generator=torch.Generator().manual_seed(9))
    b = rejection_sample(p, drafts, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_accepted_length():
    assert accepted_length([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accepted_length([5, 9, 7, 8], [5, 6, 7]) == 1
    assert accepted_length([4, 6], [5]) == 0


def test_prompt_lookup_proposals():
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert cfg is not None
    prop = NgramProposer(cfg)
    tokens = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3]
    assert prop.propose("a", tokens, 4) == [4, 5, 6, 9]  # the longest suffix that occurred before
    tokens += [4, 7]  # neither the suffix (4, 7) nor (7,) occurred before
    assert prop.propose("a", tokens, 4) == []
    assert prop.propose("b", [3, 8, 3, 8, 3, 8], 5) == [3, 8, 3, 8, 3]  # a loop goes on past its end
    assert prop.propose("c", [1, 2, 3, 1, 2, 7, 1, 2], 2) == [7, 1]  # the latest occurrence
    prop.drop("a")
    assert "a" not in prop._index


def test_prompt_lookup_measures_its_match_past_the_longest_lookup():
    """The match found by a 4-token lookup is measured backwards: its length (here 9 tokens, the
    whole copied run) is the proposal's kind for the policy; a one-token guess is another kind."""
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert cfg is not None
    prop = NgramProposer(cfg)
    run = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    tokens = [5, *run, 20, 21, 6, *run]
    assert prop.lookup("a", tokens) == (9, 9)  # the copy's last token, 9 tokens agree
    assert prop.propose("a", tokens, 3) == [20, 21, 6]
    assert prop.lookup("b", [1, 2, 3, 4, 3]) == (2, 1)  # one token, looked up alone
    assert prop.lookup("c", [1, 2, 3]) == (-1, 0)
    assert [match_kind(n) for n in (1, 2, 3, 4, 7, 8, 32)] == [0, 1, 1, 2, 2, 3, 3]


def test_policy_stops_paying_as_the_batch_fills_and_pauses_poor_rows():
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert cfg is not None
    policy = SpecPolicy(cfg)
    # 30 ms a step plus 1 ms per decode row, 2 ms per prompt token: a proposal is cheap beside
    # a small batch's step, dear beside a large one's.
    for d in range(1, 40, 3):
        for p in (0, 64, 256):
            policy.observe_step(StepShape(p, d, 0.0), 0.030 + 0.001 * d + 0.002 * p)
    assert policy.cost.coefficients is not None

    class Row:
        def __init__(self, i):
            self.request_id, self.num_computed_tokens = f"r{i}", 100

    class Sched:
        def __init__(self, n):
            self.sampling = [Row(i) for i in range(n)]
            self.shape = StepShape(0, n, 0.0)

    for i in range(64):  # rows that accept about two tokens a step
        policy.observe(f"r{i}", 4, 2)
    small, large = Sched(2), Sched(64)
    assert len(policy.plan(small, small.sampling)) == 2  # type: ignore[arg-type]
    assert policy.plan(large, large.sampling) == []  # type: ignore[arg-type]
    for _ in range(8):
        policy.observe("poor", 4, 0)
    assert policy.k_for("poor") == 0


def test_a_rejection_never_emits_the_rejected_proposal():
    """Rounding can leave p(d) < q(d) with no token where p > q (a residual of zero mass): the
    token drawn then is p's without d, never d itself."""
    n = 2_000
    target = torch.tensor([[0.4, 0.5], [0.5, 0.5]], dtype=torch.float64)[None].expand(n, -1, -1).contiguous()
    draft = torch.tensor([[0.5, 0.5]], dtype=torch.float64)[None].expand(n, -1, -1).contiguous()
    out, emitted = rejection_sample(
        target, torch.zeros(n, 1, dtype=torch.long), draft, torch.Generator().manual_seed(3)
    )
    rejected = emitted == 1
    assert 0 < int(rejected.sum()) < n  # accepted with p(0) / q(0) = 0.8
    assert bool((out[rejected, 0] == 1).all())
