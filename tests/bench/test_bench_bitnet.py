"""`orcaserve-bench bitnet`'s table: each format's tok/s over the bf16 twin's at the same stream
count, its share of the DRAM roof from its own bytes a token; a skipped peer named with its reason;
an unknown format refused before anything loads."""

from __future__ import annotations

import pytest

from orcaserve.bench.engine import bitnet_twin


def _row(streams: int, tok_s: float) -> dict:
    return {"streams": streams, "tok_s": tok_s, "tpot_ms": 1e3 / tok_s, "stream_tok_s": tok_s / streams}


def test_the_table_holds_ratios_to_the_twin(capsys):
    res = {
        "layers": 4,
        "read_gb_s": 40.0,
        "formats": {
            "bf16": {"bytes_per_token": 1_000_000_000, "load_s": 9.0, "rows": [_row(1, 10.0), _row(32, 50.0)]},
            "tq1_0": {"bytes_per_token": 400_000_000, "load_s": 3.0, "rows": [_row(1, 25.0), _row(32, 150.0)]},
        },
        "peers": {"llamacpp tq1_0": "not set up"},
    }
    bitnet_twin.report(res)
    lines = {" ".join(line.split()[:3]): line.split() for line in capsys.readouterr().out.splitlines()}
    assert lines["orcaserve tq1_0 1"][6:9] == ["0.25", "2.50", "3.0"]  # of roof: 25 / (40e9 / 4e8)
    assert lines["orcaserve tq1_0 32"][7] == "3.00"
    assert lines["orcaserve bf16 32"][7] == "1.00"
    assert "llamacpp tq1_0: skipped (not set up)" in "\n".join(" ".join(v) for v in lines.values())


def test_a_quantized_head_is_taken_against_its_own_twin(capsys):
    """tq2_0-q6_k over bf16-q6_k (the bf16 twin with the head dequantized); tq2_0 over bf16."""
    res = {
        "layers": 30,
        "read_gb_s": 40.0,
        "formats": {
            "bf16-q6_k": {"bytes_per_token": 4e9, "load_s": 9.0, "rows": [_row(1, 8.0)]},
            "tq2_0-q6_k": {"bytes_per_token": 9e8, "load_s": 3.0, "rows": [_row(1, 36.0)]},
            "bf16": {"bytes_per_token": 4e9, "load_s": 9.0, "rows": [_row(1, 10.0)]},
            "tq2_0": {"bytes_per_token": 1.2e9, "load_s": 3.0, "rows": [_row(1, 30.0)]},
        },
        "peers": {},
    }
    bitnet_twin.report(res)
    lines = {" ".join(line.split()[:3]): line.split() for line in capsys.readouterr().out.splitlines()}
    assert lines["orcaserve tq2_0-q6_k 1"][7] == "4.50"
    assert lines["orcaserve tq2_0 1"][7] == "3.00"


@pytest.mark.parametrize("fmt", ["q4_0", "tq1_0-q6_k", "tq2_0-q4_0"])
def test_an_unknown_format_is_refused(fmt):
    with pytest.raises(SystemExit, match=fmt):
        bitnet_twin.model_path(fmt, 4)
