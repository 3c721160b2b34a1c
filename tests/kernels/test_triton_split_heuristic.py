"""The split-K heuristic against the measured H200 decode table (no GPU needed).

`docs/results/gpu-h200-2026-12-04/kernels.json` holds, per decode shape (batch, context,
two head layouts: 32 q / 8 KV heads x 128 and SmolLM2's 9 / 3 x 64, bf16, block 16), the time of
each split count. `choose_num_splits` must pick a split whose measured time is within 10 % of
the best at every shape, and at batch >= 128 nothing slower than what the
first-guess heuristic chose (recorded in the table as `heuristic_splits`).

One shape is excepted, with the evidence that its reading is noise: 8 KV heads, batch 2,
context 4k, 16 splits took 51.5 us, while the same split count over twice the keys (context 8k)
took 39.8 us and batch 4 at 4k (twice the work again) 34.8 us; no rule monotone in work can
follow it. It is to be re-measured (benchmarks/gpu_check.sh's kernels step).

Not measured, so not checked here: prefill and mixed steps and fp32 (they keep the first-guess
rule), contexts between 2k and 4k and above 32k, batch 128 on the 9 / 3 layout, and any GPU
other than the H200 (the rule scales with the device's SM count).
"""

import json
from pathlib import Path

import pytest
import torch

from orcaserve.kernels.triton.launch_config import choose_num_splits

TABLE = Path(__file__).resolve().parents[2] / "docs/results/gpu-h200-2026-12-04/kernels.json"
NOISY = {(32, 8, 2, 4096)}  # (heads, kv_heads, batch, context): see the module docstring


def decode_shapes(layout=None):
    data = json.loads(TABLE.read_text())
    for i, run in enumerate(data["runs"]):
        for row in run["decode"]:
            if layout in (None, i):
                yield data["num_sms"], run, row


def chosen(sms, run, row, sms_override=None) -> int:
    h, h_kv = run["heads"], run["kv_heads"]
    b = row["batch"]
    return choose_num_splits(
        b, b, h_kv, h // h_kv, 1, row["context"], sms_override or sms, torch.bfloat16, head_dim=run["head_dim"]
    )


def test_table_is_the_h200_run():
    data = json.loads(TABLE.read_text())
    assert data["device"] == "NVIDIA H200" and data["dtype"] == "bf16" and data["num_sms"] == 132
    assert sum(len(r["decode"]) for r in data["runs"]) == 66


@pytest.mark.parametrize("layout", [0, 1], ids=["32x8x128", "9x3x64"])
def test_within_10pct_of_best_measured_split(layout):
    bad, ratios = [], []
    for sms, run, row in decode_shapes(layout):
        ms = {int(k): v for k, v in row["ms_by_splits"].items()}
        s = chosen(sms, run, row)
        assert s in ms, f"B={row['batch']} ctx={row['context']}: {s} splits were not measured"
        ratio = ms[s] / min(ms.values())
        key = (run["heads"], run["kv_heads"], row["batch"], row["context"])
        if key in NOISY:
            # Still the outlier; and the same splits over twice the keys ran faster.
            twice = next(r for r in run["decode"] if r["batch"] == row["batch"] and r["context"] == 2 * row["context"])
            assert twice["ms_by_splits"][str(s)] < ms[s], "the excepted shape is no longer inconsistent"
            continue
        ratios.append(ratio)
        if ratio > 1.10:
            bad.append(f"B={row['batch']} ctx={row['context']}: {s} splits {ratio:.2f}x the best")
    assert not bad, bad
    assert ratios and max(ratios) <= 1.10


def test_nothing_slower_at_batch_128_and_up():
    for sms, run, row in decode_shapes():
        if row["batch"] < 128:
            continue
        ms = {int(k): v for k, v in row["ms_by_splits"].items()}
        assert ms[chosen(sms, run, row)] <= ms[row["heuristic_splits"]], row


def test_scales_with_the_sm_count():
    """Short contexts never split; otherwise 3-6 programs per SM in all, unless the keys run out."""
    for sms in (78, 108, 132, 170):
        for b, h_kv, ctx in ((1, 8, 32768), (4, 8, 16384), (16, 8, 8192), (32, 3, 65536)):
            s = choose_num_splits(b, b, h_kv, 4, 1, ctx, sms, torch.bfloat16, head_dim=128)
            assert 3 * sms < s * b * h_kv <= 6 * sms or s == 64 or s == ctx // 256, (sms, b, h_kv, ctx, s)
        assert choose_num_splits(4, 4, 8, 4, 1, 2048, sms, torch.bfloat16) == 1
    # Prefill rows and fp32 keep the first-guess rule (no measurement of those yet).
    assert choose_num_splits(2, 2, 1, 4, 1, 2048, 132, torch.float32) == 4  # 2048 // 512 keys
    assert choose_num_splits(512, 2, 8, 4, 256, 8192, 132, torch.bfloat16) == 1
