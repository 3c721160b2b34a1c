"""Speculative decoding (prompt lookup or a draft model) on vs off: copy-heavy and open-ended
prompts, 1 / 4 / 16 / 32 clients, offline (docs/speculative-decoding.md; dated runs in
docs/performance-log.md).

    orcaserve-bench spec                                  # SmolLM2, every set and client count
    orcaserve-bench spec --clients 1,4 --max-tokens 96 --out spec.json
    orcaserve-bench spec --method draft --draft-model DIR_OR_GGUF
    orcaserve-bench spec --method draft --draft-model DIR_OR_GGUF --temperature 1.0   # sampled rows
    orcaserve-bench spec --method draft --agreement 0,0.5,0.8,1   # synthetic pair: spec_draft.py
    orcaserve-bench spec --rows 12                        # step time against a verifying row's rows: spec_rows.py
    orcaserve-bench spec --replay                         # tokens a step, replayed and priced: spec_replay.py
    orcaserve-bench spec --http --peers llamacpp          # served by TorchServe, beside llama.cpp: spec_http.py

Copy-heavy prompts ask to repeat, correct or reformat a text or code given in the prompt, made from
the project's own source and docstrings (shipped with it); open-ended ones ask for new text. Each
client runs one request after another (a closed loop), greedy (or at `--temperature`, unseeded, each
request then to `--max-tokens` whatever EOS: off and on emit other tokens), up to `--max-tokens` tokens.
`--every-row` bypasses the policy (every eligible row proposes K tokens every step), to measure a
proposer's acceptance rather than the policy's choices. Off and
on alternate on one engine, `--repeats` pairs per point with medians kept (the same weights, cache
and threads; the machine may be shared, so runs alternate rather than follow each other), and the
outputs of the two are compared token for token. Before a point's pairs, one run with speculation
on, not counted, teaches the policy's step-cost model that load, as a running server has learnt it;
the model is kept over the point's runs. The prefix cache is off: with it, the second run of a pair
would find the first one's prompts cached, computing less (a speed-up that is not speculation's)
and, in bf16, a prompt's last chunk over cached K/V rather than in one prefill (numerics that are
not speculation's either). Printed: tokens/s off and on (medians), the speed-up, the acceptance (proposed,
accepted, mean accepted length), the steps that speculated, the decode rows that found no proposal
and the acceptance at each proposal position (given the ones before it were accepted); and the
speed-up by the process's CPU time (tokens per CPU second, on over off), which on a shared machine
at `OMP_NUM_THREADS=1` varies far less than the wall clock (it leaves out the time the process waits
for a CPU; its OpenMP threads' spin-waits count in it); and the pairs: the median of each
alternated pair's speed-up by both clocks (a phase of the machine lands on both runs of a pair,
where the medians of each side can take it on one), the speed-up of the totals (all tokens over
all seconds, each side) and each pair's. `same` holds when every pair's outputs agree.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

from orcaserve.bench.engine.spec_pairs import pairs, summary
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.prompt import ChatPrompt
from orcaserve.scheduler.spec.config import SpeculativeConfig
from orcaserve.scheduler.spec.decoding import SpecDecoding
from orcaserve.scheduler.spec.policy import SpecPolicy
from orcaserve.scheduler.spec.stats import SpecStats
from orcaserve.scheduler.spec.target import Target


def copy_heavy_prompts() -> list[str]:
    """Tasks whose answer mostly repeats the prompt, built from the project's own code and text."""
    from orcaserve.scheduler.core import block_pool, step_cost
    from orcaserve.scheduler.spec import proposers

    code = inspect.getsource(block_pool.BlockPool.allocate)
    doc = inspect.getdoc(step_cost) or ""
    doc2 = inspect.getdoc(proposers.NgramProposer) or ""
    typos = doc2.replace("the ", "teh ", 3).replace("tokens", "tokns", 2)
    names = ["prefill", "decode", "preemption", "prefix cache", "fair share", "latency target", "speculation"]
    return [
        f"Repeat the following text exactly, word for word:\n\n{doc[:700]}",
        f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n{typos}",
        f"Rename the variable `blocks` to `taken` in this Python function and return the whole function:\n\n{code}",
        "Reformat this list as a JSON array of strings, one per line:\n" + "\n".join(f"- {n}" for n in names),
        f"Add a type hint to every argument of this function and return it in full:\n\n{code}",
        f"Rewrite the following text as a bulleted list, keeping every sentence unchanged:\n\n{doc2[:600]}",
    ]


OPEN_ENDED = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a new engineer why batching requests makes a language model server faster.",
    "Give five ideas for a weekend trip in the mountains, with one sentence each.",
    "Describe the water cycle to a ten-year-old.",
    "What are the pros and cons of working from home? Answer in a few paragraphs.",
    "Write a poem about autumn in a city.",
]


def run_set(
    engine: Engine, prompts: list, clients: int, requests: int, max_tokens: int, temperature: float = 0.0
) -> dict:
    """`requests` prompts (cycling through `prompts`: chat messages' text, or token ids as they
    are), `clients` in flight at a time, greedy by default."""
    # Sampled requests run to max_tokens (an unseeded run's EOS would make its work another run's).
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=temperature > 0)
    chat = lambda p: p if isinstance(p, list) else ChatPrompt([{"role": "user", "content": p}])  # noqa: E731
    queue = [chat(prompts[i % len(prompts)]) for i in range(requests)]
    outputs: dict[str, list[int]] = {}
    in_flight, nxt = 0, 0
    start, cpu = time.perf_counter(), time.process_time()
    while nxt < len(queue) or in_flight:
        while in_flight < clients and nxt < len(queue):
            engine.add_request(f"q{nxt}", queue[nxt], params)
            nxt, in_flight = nxt + 1, in_flight + 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
                in_flight -= 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(map(len, outputs.values()))
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "tok_cpu_s": tokens / cpu, "outputs": outputs}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--clients", default="1,4,16,32", help="concurrent clients, comma-separated")
    ap.add_argument("--sets", default="copy,open", help="prompt sets: copy (copy-heavy), open (open-ended)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=7)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampled rows at this temperature (unseeded: off and on then differ; 0: greedy, compared)",
    )
    ap.add_argument("--method", default="ngram", choices=("ngram", "draft"), help="the proposer")
    ap.add_argument("--draft-model", default=None, help="method draft: the draft's HF dir or .gguf")
    ap.add_argument(
        "--draft-quantization", default=None, help="method draft: the draft's weights (null: chosen for its file)"
    )
    ap.add_argument(
        "--agreement",
        default=None,
        help="method draft: comma-separated agreements of a synthetic target/draft pair (spec_draft.py); "
        "the draft defaults to a random 4-layer model of SmolLM2's width",
    )
    ap.add_argument(
        "--draft-vocab",
        default="",
        help="--agreement: the draft's lm_head cut to its first N rows, for each N of a comma-separated list in turn",
    )
    ap.add_argument(
        "--every-row",
        action="store_true",
        help="bypass the policy: every eligible row proposes K tokens every step (acceptance, not the policy)",
    )
    ap.add_argument("--rows", type=int, default=0, help="step time at 1..ROWS rows of one verifying request")
    ap.add_argument(
        "--replay",
        action="store_true",
        help="prompt lookup and the policy replayed over the off run's answers, steps priced by --row-ms",
    )
    ap.add_argument("--replay-ks", default="2,3,4,5,6,7,8,12,16", help="--replay: the K values")
    ap.add_argument("--replay-answers", default=None, help="--replay: the off run's answers, read or written (JSON)")
    ap.add_argument("--row-ms", default=None, help="--replay: step ms by rows, 'ROWS:MS,...' (default: Zen 5's)")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: max(4, clients))")
    ap.add_argument("--repeats", type=int, default=3, help="off/on pairs per point, alternated; medians kept")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quantization", default=None, help="the target's (null: chosen for the file; none: dense)")
    ap.add_argument("--http", action="store_true", help="orcaserve served by TorchServe, not offline (spec_http.py)")
    ap.add_argument(
        "--peers",
        default="",
        help="llamacpp: llama.cpp's server on the same GGUF, its n-gram speculation on vs off (spec_peers.py)",
    )


def speculation(engine: Engine, args: argparse.Namespace) -> SpecDecoding:
    """The engine's speculation as `args` ask (a draft model loads here, beside the engine's)."""
    setting: dict = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "draft":
        from orcaserve.bench.models.random_checkpoint import DRAFTS, checkpoint_path, with_tokenizer

        setting["model"] = args.draft_model or checkpoint_path(DRAFTS[engine.vocab_size])
        if args.draft_model is None and (args.model or "").endswith(".gguf"):  # the file's tokenizer
            name = f"{DRAFTS[engine.vocab_size]}-{os.path.basename(args.model)[: -len('.gguf')]}"
            setting["model"] = with_tokenizer(setting["model"], engine.tokenizer, name)
        setting["quantization"] = args.draft_quantization
    cfg = SpeculativeConfig.parse(setting)
    assert cfg is not None
    target = Target(engine.config, engine.tokenizer, engine.vocab_size, engine.max_model_len, engine.kv.pool.num_blocks)
    return SpecDecoding(cfg, target)


def alternate(
    engine: Engine, spec: SpecDecoding, method: str, prompts: list[str], clients: int, n: int, args: argparse.Namespace
) -> tuple[dict, dict, dict]:
    """Off and on alternated `args.repeats` times (off, on, off, on, ...); medians of tok/s, the
    runs' outputs, and the stats and declined steps of the runs on added up; and the pairs: each
    pair's ratio (on over off, by the wall clock and by CPU time), their medians, and the totals
    (all tokens over all seconds of each side). One run on first, not counted, teaches the
    policy's step-cost model this load (as a running server has learnt it); the policy is kept over
    the point's runs (it drops a request's state when the request finishes)."""
    spec.policy = SpecPolicy(spec.config)
    if args.every_row:
        k = spec.config.num_speculative_tokens
        spec.policy.plan = lambda sched, candidates, kinds=None: [(r, k) for r in candidates]  # every row, K each
    engine.spec = spec
    run_set(engine, prompts, clients, n, args.max_tokens, args.temperature)
    spec.policy.declined_steps, spec.stats = 0, SpecStats(method=method)
    offs: list[dict] = []
    ons: list[dict] = []
    for _ in range(args.repeats):
        engine.spec = None
        offs.append(run_set(engine, prompts, clients, n, args.max_tokens, args.temperature))
        engine.spec = spec
        ons.append(run_set(engine, prompts, clients, n, args.max_tokens, args.temperature))
    engine.spec = None
    return summary(offs), summary(ons), pairs(offs, ons)


def run(args: argparse.Namespace) -> dict:
    if args.method == "draft" and args.draft_model is None and args.agreement is None:
        raise SystemExit("--method draft needs --draft-model, or --agreement for the synthetic pair")
    sets = {"copy": copy_heavy_prompts(), "open": OPEN_ENDED}
    if args.http:
        from orcaserve.bench.engine.spec_http import run_http

        return run_http(args, {name: sets[name] for name in args.sets.split(",")})
    engine = Engine.from_pretrained(
        args.model or default_model_path(),
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=32,
        enable_prefix_caching=False,
    )
    engine.generate(["warm up"], SamplingParams(max_tokens=4))
    spec = speculation(engine, args)
    if args.rows:
        from orcaserve.bench.engine.spec_rows import run_rows

        return {"model": args.model or "SmolLM2-135M-Instruct (default)", **run_rows(args, engine, spec)}
    if args.replay:
        from orcaserve.bench.engine.spec_replay import ROW_MS, run_replay

        args.row_ms = args.row_ms or ROW_MS
        return {"model": args.model or "SmolLM2-135M-Instruct (default)", **run_replay(args, engine, sets)}
    if args.agreement is not None:
        from orcaserve.bench.engine.spec_draft import run_synthetic

        prompts = [p for name in args.sets.split(",") for p in sets[name]]
        return {
            "model": args.model or "SmolLM2-135M-Instruct (default)",
            **run_synthetic(args, engine, spec, prompts, run_set),
        }
    method = args.method
    results: dict = {"model": args.model or "SmolLM2-135M-Instruct (default)", "method": method, "runs": []}
    print(
        f"{'set':<6}{'clients':>8}{'off tok/s':>11}{method + ' tok/s':>13}{'speed-up':>10}{'accept':>8}{'mean len':>10}"
        f"{'steps on/off':>14}{'same':>6}",
        file=sys.stderr,
    )
    for name in args.sets.split(","):
        for clients in map(int, args.clients.split(",")):
            n = args.requests or max(4, clients)
            off, on, paired = alternate(engine, spec, method, sets[name], clients, n, args)
            stats = spec.stats.to_dict()
            row = {
                "set": name,
                "clients": clients,
                "requests": n,
                "off_tok_s": round(off["tok_s"], 2),
                f"{method}_tok_s": round(on["tok_s"], 2),
                "off_runs": off["runs"],
                f"{method}_runs": on["runs"],
                "speedup": round(on["tok_s"] / off["tok_s"], 3),
                "speedup_cpu": round(on["tok_cpu_s"] / off["tok_cpu_s"], 3),
                "same_tokens": off["all_outputs"] == on["all_outputs"],
                "pairs": paired,
                "spec": stats,
                "declined_steps": spec.policy.declined_steps,
            }
            results["runs"].append(row)
            print(
                f"{name:<6}{clients:>8}{row['off_tok_s']:>11.1f}{row[f'{method}_tok_s']:>13.1f}{row['speedup']:>9.2f}x"
                f"{stats['acceptance_rate']:>8.2f}{stats['mean_accepted_length']:>10.2f}"
                f"{stats['steps_on']:>7}/{stats['steps_off']:<6}{str(row['same_tokens']):>6}",
                file=sys.stderr,
            )
            by_pos = " ".join(f"{a:.2f}" for a in stats["acceptance_by_position"])
            unmatched = stats["unmatched_rows"]
            print(
                f"{'':<14}by CPU time {row['speedup_cpu']:.2f}x; rows without a match {unmatched};"
                f" acceptance by position {by_pos}",
                file=sys.stderr,
            )
            print(
                f"{'':<14}pairs {len(paired['ratios'])}: median {paired['median']:.2f}x wall,"
                f" {paired['median_cpu']:.2f}x CPU time; totals {paired['total']:.2f}x;"
                f" each {' '.join(f'{x:.2f}' for x in paired['ratios'])}",
                file=sys.stderr,
            )
    engine.spec = None
    if "llamacpp" in args.peers.split(","):
        from orcaserve.bench.engine.spec_peers import peer_table

        results["peers"] = peer_table(args, {name: sets[name] for name in args.sets.split(",")}, results["runs"])
    return results
