"""Prefix caching without a model: block keys, the LRU block pool, admission after a cached prefix,
tenant salts, and a long stress run that simulates every K/V write and read of the KV pool."""

from __future__ import annotations

import random
import zlib

import pytest

from orcaserve.handler.openai.protocol import ProtocolError
from orcaserve.handler.openai.tenancy import derive_cache_salt, header_value
from orcaserve.scheduler.core.block_hash import block_key, extend_block_keys
from orcaserve.scheduler.core.block_pool import BlockPool
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request, RequestStatus
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, policy="fcfs", caching=True):
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget, policy)


def req(rid: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None, priority: int = 0) -> Request:
    return Request(
        EngineRequest(
            rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority, cache_salt=salt, arrival_time=0.0
        )
    )


def fake_token(r: Request) -> int:
    """A 'sampled' token that depends only on the request's tokens, like greedy decoding: equal
    prompts generate equal answers, so generated blocks get shared too."""
    return 3 + zlib.crc32(repr(r.all_token_ids).encode()) % 50


def run_step(s: Scheduler):
    out = s.schedule()
    s.update_after_step(out)
    for r in out.sampling:
        r.append_token(fake_token(r))
        if len(r.output_token_ids) >= r.params.max_tokens:
            s.finish_request(r, "length")
    return out


def run_all(s: Scheduler) -> None:
    while s.has_unfinished():
        run_step(s)


# ---- keys and pool -----------------------------------------------------------------------------
def test_block_keys_chain_content_context_and_salt():
    a = extend_block_keys([], list(range(12)), 4, 3, None)
    assert len(a) == 3 and all(len(k) == 32 for k in a)  # SHA-256 digests
    assert a == extend_block_keys([], list(range(12)), 4, 3, None)  # deterministic
    # Same tokens in another context (a different first block): a different key.
    b = extend_block_keys([], [9, 9, 9, 9] + list(range(4, 12)), 4, 3, None)
    assert b[1] != a[1] and b[2] != a[2]
    # A salt enters the first block and reaches every later one through the chain.
    s = extend_block_keys([], list(range(12)), 4, 3, "tenant-a")
    assert all(x != y for x, y in zip(a, s))
    assert s != extend_block_keys([], list(range(12)), 4, 3, "tenant-b")
    assert block_key(None, [1, 2], "") != block_key(None, [1, 2], None)  # "" is a salt, None none
    # A LoRA adapter enters the first block too: no key is shared across adapters, salts or the
    # base model, and the base model's keys stay the ones it had before adapters existed.
    tokens = list(range(12))
    keyed = {
        (salt, lora): extend_block_keys([], tokens, 4, 3, salt, lora)
        for salt in (None, "", "tenant-a")
        for lora in (None, "", "a", "b")
    }
    assert len({k for keys in keyed.values() for k in keys}) == 3 * len(keyed)
    assert keyed[None, None] == a and keyed["tenant-a", None] == s
    assert block_key(None, [1], "a", None) != block_key(None, [1], None, "a")  # a salt is not an adapter
    # Lazily extended, never recomputed: existing keys are kept as they are.
    part = extend_block_keys([], list(range(12)), 4, 1, None)
    assert extend_block_keys(part, list(range(12)), 4, 3, None) == a
    with pytest.raises(ValueError):
        extend_block_keys([], list(range(7)), 4, 2, None)


def test_pool_keeps_freed_blocks_cached_and_evicts_least_recently_freed():
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    assert pool.register(a[0], b"ka") and pool.register(b[0], b"kb")
    assert not pool.register(a[1], b"ka")  # the key is taken: the duplicate stays an ordinary block
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 4 and pool.num_cached_free == 2 and pool.num_cached == 2
    # A hit takes the block off the free list and raises its count.
    assert pool.lookup(b"kb") == b[0]
    pool.touch([b[0]])
    assert pool.ref_count(b[0]) == 1 and not pool.is_free(b[0]) and pool.num_cached_free == 1
    # Allocation takes the least recently freed: a[0] (cached) first, then a[1], then b[1].
    first = pool.allocate(1)
    assert first == [a[0]] and pool.lookup(b"ka") is None and pool.key_of(a[0]) is None
    assert pool.allocate(2) == [a[1], b[1]] and pool.allocate(1) is None
    assert pool.lookup(b"kb") == b[0]  # referenced: never evicted
    with pytest.raises(RuntimeError):
        pool.touch([a[1]])  # not cached
    pool.free([a[1]])
    with pytest.raises(RuntimeError):
        pool.register(a[1], b"x")  # only blocks in use (just filled) are cached
    with pytest.raises(RuntimeError):
        pool.free([a[1]])


def test_second_request_starts_after_the_cached_full_blocks():
    s = make_scheduler(block_size=4)
    prefix = list(range(100, 110))  # 10 tokens: 2 full blocks
    s.add_request(req("a", prefix + [1, 2]))
    run_all(s)
    b = req("b", prefix + [7, 8, 9])
    s.add_request(b)
    out = run_step(s)
    assert b.num_cached_tokens == 8 and out.num_scheduled_tokens == {"b": 13 - 8}
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (12 + 13, 8)
    run_all(s)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


@pytest.mark.parametrize("length", [8, 9, 11, 12])
def test_a_fully_cached_prompt_recomputes_the_block_of_its_last_token(length):
    """The last prompt token is always computed (it samples), in a block of the request's own."""
    s = make_scheduler(block_size=4)
    prompt = list(range(200, 200 + length))
    s.add_request(req("a", prompt, max_tokens=1))
    run_all(s)
    b = req("b", prompt, max_tokens=1)
    s.add_request(b)
    out = run_step(s)
    assert b.num_cached_tokens == (length - 1) // 4 * 4
    assert out.num_scheduled_tokens == {"b": length - b.num_cached_tokens} and out.sampling == [b]


def test_other_salt_shares_nothing_same_salt_shares():
    s = make_scheduler(block_size=4)
    prompt = list(range(300, 320))
    s.add_request(req("a", prompt, salt="tenant-a"))
    run_all(s)
    for rid, salt, cached in (("b", "tenant-b", 0), ("n", None, 0), ("a2", "tenant-a", 16)):
        r = req(rid, prompt, salt=salt)
        s.add_request(r)
        run_step(s)
        assert r.num_cached_tokens == cached, rid
        run_all(s)


def test_concurrent_requests_share_blocks_and_nothing_is_written_while_shared():
    s = make_scheduler(block_size=4)
    prompt = list(range(400, 417))
    s.add_request(req("a", prompt, max_tokens=8))
    run_step(s)  # a's 4 full prompt blocks are cached now, a still runs
    b = req("b", prompt + [5], max_tokens=8)
    s.add_request(b)
    run_step(s)
    shared = set(s.kv.blocks_of("a")) & set(s.kv.blocks_of("b"))
    assert len(shared) == 4 and all(s.kv.pool.ref_count(blk) == 2 for blk in shared)
    run_all(s)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_preempted_request_readmits_after_its_own_cached_blocks():
    s = make_scheduler(num_blocks=8, block_size=4, budget=100)
    s.add_request(req("old", list(range(500, 515)), max_tokens=8))
    s.add_request(req("new", list(range(600, 615)), max_tokens=8))
    while not (out := run_step(s)).preempted:
        pass
    victim = s.requests[out.preempted[0]]
    assert victim.status == RequestStatus.WAITING and victim.num_computed_tokens == 0
    while victim.status != RequestStatus.RUNNING:
        run_step(s)
    # Readmitted after the full blocks still cached (its own, unless evicted meanwhile).
    assert victim.num_computed_tokens > 0
    assert victim.num_cached_tokens == 0  # the prompt's figure is from its first admission only
    run_all(s)
    assert s.kv.pool.num_free == 8


def test_caching_off_takes_no_hits():
    s = make_scheduler(caching=False)
    s.add_request(req("a", list(range(40))))
    run_all(s)
    b = req("b", list(range(40)))
    s.add_request(b)
    run_step(s)
    assert b.num_cached_tokens == 0 and s.prefix_cache_queries == 0 and s.kv.pool.num_cached == 0


# ---- tenants -----------------------------------------------------------------------------------
def test_header_lookup_ignores_case_and_query_parameters():
    assert header_value({"X-Tenant-Id": "acme", "url_path": "v1"}, "x-tenant-id") == "acme"
    # TorchServe files a query parameter's name among the headers, with a dict value.
    assert header_value({"x-tenant-id": {"content-type": "text/plain"}}, "X-Tenant-Id") is None
    assert header_value({"X-TENANT-ID": "a", "x-tenant-id": "a"}, "X-Tenant-Id") == "a"
    with pytest.raises(ProtocolError):
        header_value({"X-TENANT-ID": "a", "x-tenant-id": "b"}, "X-Tenant-Id")


def test_salt_derivation_isolates_tenants_whatever_the_body_says():
    h = "X-Tenant-Id"
    a = derive_cache_salt(h, {h: "a"}, None)
    assert a == derive_cache_salt(h, {"x-tenant-id": "a"}, None)  # one tenant shares
    assert a != derive_cache_salt(h, {h: "b"}, None)
    assert derive_cache_salt(h, {h: "a"}, "s") not in (a, derive_cache_salt(h, {h: "b"}, "s"))
    # Field boundaries cannot be moved: ("ab", salt "c") is not ("a", salt "bc").
    assert derive_cache_salt(h, {h: "ab"}, "c") != derive_cache_salt(h, {h: "a"}, "bc")
    # No body salt reproduces a tenant's salt, nor the single-tenant salts.
    assert derive_cache_salt(None, {}, "a") not in (a, derive_cache_salt(h, {h: "a"}, "a"))
    assert derive_cache_salt(None, {h: "a"}, None) is None  # no tenant header configured: one tenant
    for headers in ({}, {h: ""}, {h: "  "}, {h: {"content-type": "x"}}):
        with pytest.raises(ProtocolError) as e:
            derive_cache_salt(h, headers, "s")
        assert e.value.status == 400 and h in e.value.message


# ---- stress ------------------------------------------------------------------------------------
class Shadow:
    """What each KV slot holds: (salt, tokens up to and including that position) of the request
    that wrote it, the stand-in for K/V (which depend on every earlier token). Salts stand for
    tenants: a read of a slot written under another salt is a cross-tenant hit."""

    def __init__(self, s: Scheduler) -> None:
        self.s, self.bs = s, s.kv.block_size
        self.slots: dict[tuple[int, int], tuple] = {}

    def run(self, out, fail: set[str]) -> None:
        pool = self.s.kv.pool
        for rid, n in out.num_scheduled_tokens.items():
            r, blocks = out.requests[rid], self.s.kv.blocks_of(rid)
            assert n >= 1, f"{rid} scheduled without a token to compute (its sample would have no logits)"
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                b = blocks[p // self.bs]
                assert pool.key_of(b) is None and pool.ref_count(b) == 1, f"write to cached/shared block {b}"
                ctx = ("garbage",) if rid in fail else (r.cache_salt, tuple(r.all_token_ids[: p + 1]))
                self.slots[(b, p % self.bs)] = ctx
            if rid in fail:
                continue
            for p in range(r.num_computed_tokens + n):  # attention reads the whole context
                want = (r.cache_salt, tuple(r.all_token_ids[: p + 1]))
                assert self.slots.get((blocks[p // self.bs], p % self.bs)) == want, (rid, p)

    def check(self, requests: dict[str, Request]) -> None:
        kv, pool = self.s.kv, self.s.kv.pool
        holders: dict[int, int] = {}
        for rid in requests:
            for b in kv.blocks_of(rid):
                holders[b] = holders.get(b, 0) + 1
        cached_free = 0
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == holders.get(b, 0) >= 0, b
            assert pool.is_free(b) == (pool.ref_count(b) == 0), f"block {b} both free and referenced"
            key = pool.key_of(b)
            if key is None:
                continue
            cached_free += pool.is_free(b)
            assert pool.lookup(key) == b
            salt, ctx = self.slots[(b, self.bs - 1)]  # a cached block is full: its last slot says it all
            assert extend_block_keys([], list(ctx), self.bs, len(ctx) // self.bs, salt)[-1] == key, b
        assert cached_free == pool.num_cached_free and pool.num_free + len(holders) == pool.num_blocks


def shadow_step(s: Scheduler, shadow: Shadow, fail_one: bool) -> int:
    """One step with every K/V write and read simulated; `fail_one`: a request fails in the model
    (the engine's _fail): its slots hold garbage, and it is finished before the scheduler advances,
    so none of its blocks may become cached. Returns the number of failed requests."""
    out = s.schedule()
    fail = {next(iter(out.num_scheduled_tokens))} if fail_one and out.num_scheduled_tokens else set()
    shadow.run(out, fail)
    for rid in fail:
        s.finish_request(out.requests[rid], "error")
    s.update_after_step(out)
    for r in out.sampling:
        if r.request_id not in fail:
            r.append_token(fake_token(r))
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish_request(r, "length")
    shadow.check(s.requests)
    return len(fail)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_stress_shared_prefixes_with_constant_eviction(policy):
    """Thousands of steps over a 28-block pool: prompts from four shared prefixes under three
    salts, aborts, failures, preemptions; every step checks the pool against the shadow."""
    rng = random.Random(11)
    s = make_scheduler(num_blocks=28, block_size=4, max_num_seqs=6, budget=24, policy=policy)
    shadow = Shadow(s)
    prefixes = [[rng.randrange(3, 60) for _ in range(n)] for n in (6, 11, 16, 23)]
    created = aborted = failed = evicted = 0
    keys_before: set[bytes] = set()
    for _ in range(4000):
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            prompt = rng.choice(prefixes) + [rng.randrange(3, 60) for _ in range(rng.choice([0, 0, 1, 3, 6]))]
            s.add_request(
                req(f"r{created}", prompt, rng.randint(1, 12), rng.choice([None, None, "a", "b"]), rng.randint(0, 3))
            )
            created += 1
        if s.requests and rng.random() < 0.04:
            s.finish_request(rng.choice(list(s.requests.values())), "abort")
            aborted += 1
        failed += shadow_step(s, shadow, rng.random() < 0.02)
        keys = set(s.kv.pool._by_key)
        evicted += len(keys_before - keys)
        keys_before = keys
    while s.has_unfinished():
        shadow_step(s, shadow, False)
    shadow.check({})
    assert s.kv.pool.num_free == s.kv.pool.num_blocks and s.requests == {}
    assert created > 3000 and aborted > 100 and failed > 20 and s.num_preemptions > 50, (created, aborted, failed)
    assert evicted > 500 and s.prefix_cache_hits > 0.2 * s.prefix_cache_queries, (evicted, s.prefix_cache_hits)
