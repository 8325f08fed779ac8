"""`gateway table` / `gateway sweep` through register(subparsers), as the main CLI wires them."""
import argparse
import csv
import json

from shadowprefill.gateway.cli import register


def _parser():
    p = argparse.ArgumentParser(prog="shadowprefill")
    register(p.add_subparsers(dest="cmd", required=True))
    return p


def test_table_prints_table_iv(capsys):
    args = _parser().parse_args(["gateway", "table"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "Workload" not in line]
    assert len(rows) == 8
    coding = next(r for r in rows if r.startswith("| Long-horizon coding agent"))
    assert "5.01× / 8.97× / 12.87×" in coding and "2.39× / 3.79× / 5.18×" in coding
    args = _parser().parse_args(["gateway", "table", "--compare"])
    args.func(args)
    assert "13.28→13.28" in capsys.readouterr().out


def test_sweep_writes_png_csv_json(tmp_path):
    args = _parser().parse_args(["gateway", "sweep", "--param", "context", "--out", str(tmp_path)])
    assert args.func(args) == 0
    png = tmp_path / "gateway_sweep_context.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "gateway_sweep_context.csv") as f:
        rows = list(csv.DictReader(f))
    data = json.loads((tmp_path / "gateway_sweep_context.json").read_text())
    assert len(rows) == len(data["rows"]) > 0 and data["param"] == "context"
    profiles = {r["profile"] for r in rows}
    assert profiles == {r["profile"] for r in data["rows"]} and len(profiles) == 8
    assert all(float(r["ttft_speedup"]) >= 1.0 for r in rows)
