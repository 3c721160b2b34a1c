"""In-process A/B of the one-row step, one thread, thread CPU per decode step: base (first layer op
by op, logits + sampler), c (first layer in the call), ca (c + argmax in the lm_head). Rotating order."""
import importlib.util, random, statistics, sys, time, types
import torch
from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.model.loader import default_model_path
from orcaserve.scheduler.sampling_params import SamplingParams

torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("dec_noC", "/tmp/onerow9/dec_noC.py")
noC = importlib.util.module_from_spec(spec); sys.modules["dec_noC"] = noC; spec.loader.exec_module(noC)
engine = Engine.from_pretrained(default_model_path(), max_num_seqs=1)
dec = engine.runner.decoder
fwd_c = dec.forward
fwd_base = types.MethodType(noC.Decoder.forward, dec)
rng = random.Random(0)
params = SamplingParams(max_tokens=int(sys.argv[2]) if len(sys.argv) > 2 else 128, temperature=0.0, ignore_eos=True)
prompt = [rng.randrange(100, 40000) for _ in range(32)]
def run(v, tag):
    dec.forward = fwd_base if v == "base" else fwd_c
    dec.head_argmax = v == "ca"
    engine.add_request(tag, prompt, params)
    engine.step()
    n, t0 = 0, time.thread_time()
    while engine.has_unfinished():
        engine.step(); n += 1
    return 1e3 * (time.thread_time() - t0) / n
names = ["base", "c", "ca"]
res = {v: [] for v in names}
outs = {}
for v in names: run(v, f"w{v}")
for r in range(int(sys.argv[1])):
    order = names[r % 3:] + names[:r % 3]
    for v in order:
        res[v].append(run(v, f"{v}{r}"))
for v in names:
    x = res[v]
    print(f"{v:5s} median {statistics.median(x):.3f} mean {statistics.mean(x):.3f} min {min(x):.3f} ms CPU/step  {' '.join(f'{t:.2f}' for t in x)}")
for a, b in (("base", "c"), ("c", "ca"), ("base", "ca")):
    d = [y - x for x, y in zip(res[a], res[b])]
    print(f"{b} - {a}: median {statistics.median(d):+.3f} mean {statistics.mean(d):+.3f} ms; {sum(t < 0 for t in d)}/{len(d)} rounds faster")
