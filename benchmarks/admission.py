"""What one client's oversized prompts cost everybody else: streams' token gaps during an attack.

    python benchmarks/admission.py                           # 8 prompts of 1 MiB, 4 victim streams
    python benchmarks/admission.py --attack-kind chat --json out.json

Victims: `--victims` greedy streams (EOS ignored) through an `EngineLoop` serving the default
model, as the handler runs it. Once every victim has its first token, `--attackers` prompts of
`--attack-bytes` bytes arrive at once: random printable text (the slowest text to tokenize that
was measured here, about 2.5 s per MiB) or, with `--attack-kind chat`, that text split into
`max_model_len - 1` messages (more are refused before rendering). Each is far beyond
`max_model_len` once tokenized, so each is answered with a 400;
the question is what its tokenization costs the victims. Printed: the victims' largest gap between
two tokens and their output tokens/s before and during the attack, and when the 400s arrived.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import string
import threading
import time

from serve_report import machine

from orcaserve.handler.openai.errors import http_error
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.errors import EngineError
from orcaserve.scheduler.serving.engine_loop import EngineLoop
from orcaserve.scheduler.serving.prompt import ChatPrompt


def _attack_prompt(kind: str, size: int, rng: random.Random, max_model_len: int) -> str | ChatPrompt:
    text = "".join(rng.choice(string.printable) for _ in range(size))
    if kind == "chat":  # the most messages that are not refused uncounted, sharing the text
        n = max_model_len - 1
        return ChatPrompt([{"role": "user", "content": text[i * size // n : (i + 1) * size // n]} for i in range(n)])
    return text


def _victim(loop: EngineLoop, i: int, max_tokens: int, times: list[float], first: threading.Event) -> None:
    stream = loop.submit(f"victim-{i}", list(range(100, 164)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for out in stream:
        times.extend([time.perf_counter()] * len(out.new_token_ids))
        first.set()


def _attacker(loop: EngineLoop, i: int, prompt, answered: list[tuple[float, str]]) -> None:
    stream = loop.submit(f"attack-{i}", prompt, SamplingParams(max_tokens=1))
    try:
        for _ in stream:
            pass
        answered.append((time.perf_counter(), "200"))
    except EngineError as e:
        answered.append((time.perf_counter(), f"{http_error(e).status}: {str(e)[:60]}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--victims", type=int, default=4)
    ap.add_argument("--victim-tokens", type=int, default=400)
    ap.add_argument("--attackers", type=int, default=8)
    ap.add_argument("--attack-bytes", type=int, default=1 << 20)
    ap.add_argument("--attack-kind", choices=["text", "chat"], default="text")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    engine = Engine.from_pretrained(default_model_path(), dtype=args.dtype)
    rng = random.Random(0)
    prompts = [
        _attack_prompt(args.attack_kind, args.attack_bytes, rng, engine.max_model_len) for _ in range(args.attackers)
    ]
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    loop = EngineLoop(engine).start()

    times: list[list[float]] = [[] for _ in range(args.victims)]
    firsts = [threading.Event() for _ in range(args.victims)]
    victims = [
        threading.Thread(target=_victim, args=(loop, i, args.victim_tokens, times[i], firsts[i]))
        for i in range(args.victims)
    ]
    for t in victims:
        t.start()
    for f in firsts:
        f.wait()
    time.sleep(2.0)  # a baseline stretch of plain decoding
    answered: list[tuple[float, str]] = []
    attack_start = time.perf_counter()
    attackers = [threading.Thread(target=_attacker, args=(loop, i, p, answered)) for i, p in enumerate(prompts)]
    for t in attackers:
        t.start()
    for t in attackers:
        t.join()
    attack_end = time.perf_counter()
    for t in victims:
        t.join()
    loop.shutdown()

    def rate(lo: float, hi: float) -> float:
        return sum(lo <= x < hi for ts in times for x in ts) / (hi - lo)

    gaps_during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if attack_start <= b <= attack_end]
    gaps_before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b < attack_start]
    result = {
        "machine": platform.processor() or platform.machine(),
        "cpu": machine()["cpu"],
        "dtype": str(engine.dtype).removeprefix("torch."),
        "attack": f"{args.attackers} x {args.attack_bytes} bytes of {args.attack_kind}",
        "attack_s": round(attack_end - attack_start, 2),
        "answers": sorted({a for _, a in answered}),
        "answer_times_s": [round(t - attack_start, 2) for t, _ in sorted(answered)],
        "victim_tok_s_before": round(rate(attack_start - 2.0, attack_start), 1),
        "victim_tok_s_during": round(rate(attack_start, attack_end), 1),
        "victim_max_gap_ms_before": round(max(gaps_before, default=0) * 1000, 1),
        "victim_max_gap_ms_during": round(max(gaps_during, default=attack_end - attack_start) * 1000, 1),
        "victim_tokens_during": sum(attack_start <= x <= attack_end for ts in times for x in ts),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
