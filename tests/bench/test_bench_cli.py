"""`orcaserve-bench`: every registered subcommand (and every step of `kernels` and `gpu`) builds its
parser, `--out` writes the result with where and how it was measured, `--json` still works."""

from __future__ import annotations

import json

import pytest

from orcaserve.bench import cli


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_subcommand_builds_its_parser(name, capsys):
    steps = cli.STEPS.get(name, {})
    parser = cli.parser_for([name, *steps])  # every step's module imported, as when it is chosen
    with pytest.raises(SystemExit) as e:
        parser.parse_args([name, "--help"])
    assert e.value.code == 0
    assert "--out" in capsys.readouterr().out or steps  # steps take --out after the step's name
    for step in steps:
        with pytest.raises(SystemExit):
            parser.parse_args([name, step, "--help"])
        assert "--out" in capsys.readouterr().out


def test_out_records_the_run_and_json_is_an_alias(tmp_path):
    out = tmp_path / "pre.json"
    with pytest.warns(FutureWarning, match="--json"):
        assert cli.main(["gpu", "preflight", "--repo", str(tmp_path), "--dry", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "versions" in res  # the subcommand's own dict, at the top level
    run = res["run"]
    assert run["command"][:3] == ["orcaserve-bench", "gpu", "preflight"]
    assert {"vendor", "family", "model", "flags"} <= set(run["cpu"]) or run["cpu"]["machine"] != "x86_64"
    assert "commit" in run and "date_utc" in run
