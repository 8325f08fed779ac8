"""The command line: every command turns a bad argument or input file into one line
`shadowprefill <command>: error: ...` on stderr and exit status 2, before it starts any work; errors of the
work itself keep their traceback; `python -m shadowprefill` is the same command. And it explains itself:
`--version`, help and a shown default on every option, one warm-up default, results on stdout with a
`wrote FILE` line per file, a progress bar through the drain, PASS/FAIL from `selfcheck`."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shadowprefill.cli import main

PAIR = "Q2.5-7B/L3.1-70B"
SIM = ["--pair", PAIR, "--duration", "5", "--warmup", "1", "--instances", "1",
       "--capacity", "Qwen2.5-7B=2,Llama-3.1-70B=2"]


@pytest.fixture
def bad_files(tmp_path):
    files = {
        "wrong_csv": "a,b\n1,2\n",
        "bad_stamp_csv": "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,5\n",
        "bad_json": "{not json",
        "bad_config": json.dumps({"models": {"small": ["ftp://x"]}}),
        "unknown_key_config": json.dumps({"models": {"small": ["http://127.0.0.1:1"]}, "colour": "red"}),
        "bad_port_config": json.dumps({"models": {"small": ["http://127.0.0.1:1"]}, "port": "eighty"}),
        "bad_sessions": '{"session_id": "s0"}\n',
    }
    out = {}
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text)
        out[name] = str(path)
    out["missing"] = str(tmp_path / "missing.file")
    out["dir"] = str(tmp_path)
    return out


def one_line_error(capsys, argv, command):
    """Run `shadowprefill ARGV`; assert exit status 2 and exactly one stderr line naming the command;
    return that line."""
    rc = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, (argv, captured)
    assert len(lines) == 1, (argv, captured.err)
    assert lines[0].startswith(f"shadowprefill {command}: error: "), lines[0]
    return lines[0]


def listening_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, needle", [
    (["--pair", "X/Y"], "unknown model 'X'; known:"),
    (["--pair", PAIR, "--duration", "-5"], "argument --duration: must be > 0, got '-5'"),
    (["--pair", PAIR, "--duration", "abc"], "argument --duration: expected a number, got 'abc'"),
    (["--pair", PAIR, "--instances", "0"], "argument --instances"),
    (["--pair", PAIR, "--seed", "-1"], "argument --seed"),
    (["--pair", PAIR, "--policies", "no-shadow,nope"], "nope"),
    (["--pair", PAIR, "--workload", "nope"], "unknown workload 'nope'"),
    (["--pair", PAIR, "--capacity", "Qwen2.5-7B=fast"], "--capacity: 'Qwen2.5-7B=fast'"),
    (["--pair", PAIR, "--capacity", "Qwen2.5-7B=-3"], "must be > 0"),
    (["--pair", PAIR, "--router", "markov", "--router-knob", "0.5"], "--router-knob needs --router sticky"),
    (["--pair", PAIR, "--pd-prefill", "4"], "pd_prefill"),
    (["--pair", PAIR, "--bogus"], "unrecognized arguments: --bogus"),
])
def test_simulate_rejects_bad_arguments(capsys, tmp_path, argv, needle):
    line = one_line_error(capsys, ["simulate", *argv, "--out", str(tmp_path / "o.json")], "simulate")
    assert needle in line
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("option, file, needle", [
    ("--trace", "wrong_csv", "missing column(s)"),
    ("--trace", "bad_stamp_csv", ":2: TIMESTAMP 'yesterday' is not a timestamp"),
    ("--trace", "missing", "No such file or directory"),
    ("--sessions", "bad_json", "invalid JSON"),
    ("--sessions", "bad_sessions", "bad_sessions:1"),
    ("--sessions", "missing", "No such file or directory"),
    ("--out", "dir", "is a directory"),
    ("--plot", "wrong_csv", "is not a directory"),
])
def test_simulate_rejects_bad_input_files(capsys, bad_files, option, file, needle):
    argv = ["simulate", *SIM, "--out", bad_files["dir"] + "/o.json", option, bad_files[file]]
    if option == "--out":
        argv = ["simulate", *SIM, "--out", bad_files[file]]
    line = one_line_error(capsys, argv, "simulate")
    assert needle in line and (bad_files[file] in line or option == "--sessions")


def test_a_failure_inside_a_run_keeps_its_traceback(monkeypatch, tmp_path):
    """Only argument and input checks become one-line errors: a ValueError raised by the simulation itself
    is a bug and propagates."""
    import shadowprefill.sim.experiment as experiment

    def broken(*args, **kwargs):
        raise ValueError("a bug inside the run")

    monkeypatch.setattr(experiment, "run_experiment", broken)
    with pytest.raises(ValueError, match="a bug inside the run"):
        main(["simulate", *SIM, "--out", str(tmp_path / "o.json"), "--quiet"])


@pytest.mark.parametrize("argv, needle", [
    (["--param", "nope"], "argument --param: invalid choice: 'nope'"),
    (["--param", "beta", "--values", "a,b"], "--values float"),
    (["--param", "instances", "--values", "2,0"], "--param instances value 0: instances must be an int >= 1"),
    (["--param", "rho", "--values", "0.5,-1"], "rho must be >= 0"),
    (["--param", "beta", "--values", "0.5,-1"], "--param beta value -1.0: beta"),
    (["--param", "pcie_gbps", "--values", "0"], "pcie_bw must be > 0"),
    (["--param", "beta", "--jobs", "0"], "argument --jobs"),
])
def test_sweep_rejects_bad_arguments(capsys, tmp_path, argv, needle):
    line = one_line_error(capsys, ["sweep", *SIM, *argv, "--out", str(tmp_path / "s.json")], "sweep")
    assert needle in line


@pytest.mark.parametrize("command", ["sweep", "demo"])
def test_ray_without_ray_installed(capsys, monkeypatch, tmp_path, command):
    import shadowprefill.sim.runner as runner
    monkeypatch.setattr(runner, "ray_available", lambda: False)
    argv = ["sweep", *SIM, "--param", "beta", "--out", str(tmp_path / "s.json")] if command == "sweep" else ["demo"]
    line = one_line_error(capsys, [*argv, "--ray"], command)
    assert "Ray is not installed" in line


@pytest.mark.parametrize("argv, needle", [
    (["--duration", "-1"], "argument --duration"),
    (["--seeds", "a"], "--seeds"),
    (["--seeds", "0,-2"], "--seeds"),
    (["--workloads", "nope"], "unknown workload 'nope'"),
    (["--windows", "noon"], "noon"),
    (["--policies", "foo"], "foo"),
    (["--pair", "X/Y"], "unknown model 'X'"),
    (["--jobs", "0"], "argument --jobs"),
])
def test_demo_rejects_bad_arguments(capsys, argv, needle):
    assert needle in one_line_error(capsys, ["demo", *argv], "demo")


def test_demo_rejects_an_out_path_that_is_a_file(capsys, bad_files):
    assert "is not a directory" in one_line_error(capsys, ["demo", "--out", bad_files["wrong_csv"]], "demo")


@pytest.mark.parametrize("argv, needle", [(["--sessions", "0"], "argument --sessions: must be > 0"),
                                          (["--seed", "x"], "argument --seed"), (["--what"], "--what")])
def test_engine_demo_rejects_bad_arguments(capsys, argv, needle):
    assert needle in one_line_error(capsys, ["engine-demo", *argv], "engine-demo")


def test_selfcheck_rejects_arguments(capsys):
    assert "unrecognized arguments: --device" in one_line_error(capsys, ["selfcheck", "--device", "tpu"], "selfcheck")


def test_gateway_rejects_bad_arguments(capsys, bad_files):
    assert "--compare" not in one_line_error(capsys, ["gateway", "table", "--bogus"], "gateway table")
    assert "invalid choice: 'nope'" in one_line_error(capsys, ["gateway", "nope"], "gateway")
    line = one_line_error(capsys, ["gateway", "sweep", "--param", "nope"], "gateway sweep")
    assert "argument --param" in line
    line = one_line_error(capsys, ["gateway", "sweep", "--param", "hit_rate", "--out", bad_files["wrong_csv"]],
                          "gateway sweep")
    assert line.endswith(f"--out: {bad_files['wrong_csv']}: File exists")


def test_serve_engine_rejects_bad_arguments(capsys):
    assert "model must be one of" in one_line_error(capsys, ["serve-engine", "--model", "nope"], "serve-engine")
    assert "argument --port" in one_line_error(capsys, ["serve-engine", "--port", "70000"], "serve-engine")
    assert "argument --num-blocks" in one_line_error(capsys, ["serve-engine", "--num-blocks", "0"], "serve-engine")
    with listening_port() as busy:
        port = busy.getsockname()[1]
        line = one_line_error(capsys, ["serve-engine", "--port", str(port)], "serve-engine")
    assert f"cannot listen on 127.0.0.1:{port}" in line


@pytest.mark.parametrize("file, needle", [
    ("missing", "No such file or directory"),
    ("bad_json", "invalid JSON"),
    ("bad_config", "endpoint must be a URL"),
    ("unknown_key_config", "unknown keys ['colour']"),
    ("bad_port_config", "port must be an int"),
])
def test_serve_manager_rejects_a_bad_config(capsys, bad_files, file, needle):
    line = one_line_error(capsys, ["serve-manager", "--config", bad_files[file]], "serve-manager")
    assert needle in line and bad_files[file] in line


def test_serve_manager_needs_a_config(capsys):
    assert "--config" in one_line_error(capsys, ["serve-manager"], "serve-manager")


def test_replay_rejects_bad_arguments(capsys, bad_files, tmp_path):
    from shadowprefill.cluster.traces import save_sessions
    from shadowprefill.cluster.workloads import generate_sessions

    good = tmp_path / "sessions.jsonl"
    save_sessions(good, generate_sessions("fusionbench", ("small", "large"), num_sessions=2, seed=0))
    url = f"http://127.0.0.1:{closed_port()}"
    cases = [
        (["--manager", url, "--sessions", bad_files["missing"]], "No such file or directory"),
        (["--manager", url, "--sessions", bad_files["bad_json"]], "invalid JSON"),
        (["--manager", url, "--sessions", str(good), "--model-map", "small"], "--model-map: 'small' is not"),
        (["--manager", url, "--sessions", str(good), "--model-map", "small=a"], "lacks the recorded model(s) ['large']"),
        (["--manager", "127.0.0.1:8000", "--sessions", str(good)], "--manager must be an http(s) URL"),
        (["--manager", url, "--sessions", str(good)], f"--manager {url}: GET /v1/models failed"),
        (["--manager", url, "--sessions", str(good), "--vocab-size", "5"], "argument --vocab-size"),
        (["--manager", url, "--sessions", str(good), "--min-gap-s", "3"], "--min-gap-s 3.0 must be <="),
    ]
    for argv, needle in cases:
        assert needle in one_line_error(capsys, ["replay", *argv], "replay"), argv


def test_calibrate_capacity_rejects_bad_arguments(capsys):
    assert "unknown model 'nope'" in one_line_error(capsys, ["calibrate-capacity", "--models", "nope"],
                                                    "calibrate-capacity")
    assert "unknown gpu 'tpu'" in one_line_error(capsys, ["calibrate-capacity", "--gpu", "tpu"],
                                                 "calibrate-capacity")
    assert "exclude each other" in one_line_error(capsys, ["calibrate-capacity", "--write", "--check"],
                                                  "calibrate-capacity")


def test_unknown_command(capsys):
    rc = main(["nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("shadowprefill: error: argument COMMAND: invalid choice")


def test_python_dash_m_is_the_command(tmp_path):
    """`python -m shadowprefill` lists the same commands and reports a bad argument the same way."""
    ok = subprocess.run([sys.executable, "-m", "shadowprefill", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0
    for command in ("demo", "engine-demo", "selfcheck", "gateway", "serve-engine", "serve-manager", "replay",
                    "simulate", "sweep", "calibrate-capacity"):
        assert command in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "shadowprefill", "simulate", "--pair", "X/Y", "--out",
                          str(tmp_path / "o.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith("shadowprefill simulate: error: unknown model 'X'; known: [")


# ---- a command line that explains itself ------------------------------------------------------------------
def _parsers(parser, prefix=()):
    """(command words, parser) of the top-level parser and every sub-command, recursively."""
    import argparse
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, prefix + (name,))


def test_version(capsys):
    import re

    import shadowprefill
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == shadowprefill.__version__
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"shadowprefill {shadowprefill.__version__}"


def test_every_option_has_help_and_shows_its_default():
    import argparse
    import re

    from shadowprefill.cli import build_parser
    missing, undefaulted, numbered = [], [], []
    for words, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            name = " ".join(words + (action.option_strings[-1],))
            if not (action.help or "").strip():
                missing.append(name)
            shown = formatter._get_help_string(action)
            if action.default not in (None, False) and "default" not in shown:
                undefaulted.append(name)
            if re.search(r"issue\s*#?\d", shown, re.IGNORECASE):
                numbered.append(name)
        if re.search(r"issue\s*#?\d", (parser.description or "") + str(getattr(parser, "help", "")), re.I):
            numbered.append(" ".join(words))
    assert not missing, f"options without help: {missing}"
    assert not undefaulted, f"options whose default is not shown: {undefaulted}"
    assert not numbered, f"issue numbers in help: {numbered}"
    text = "\n".join(p.format_help() for _, p in _parsers(build_parser()))
    assert "(default: 120.0)" in text and "%(default)" not in text


def test_one_warmup_default_for_every_simulator_command():
    from shadowprefill.cli import build_parser
    from shadowprefill.sim.args import WARMUP_S
    from shadowprefill.sim.study import StudySpec
    parser = build_parser()
    defaults = {cmd: parser.parse_args([cmd, "--pair", PAIR, "--out", "x", *extra]).warmup
                for cmd, extra in (("simulate", []), ("sweep", ["--param", "beta"]), ("demo", []))}
    assert set(defaults.values()) == {WARMUP_S} == {StudySpec().warmup_s} == {120.0}, defaults


@pytest.mark.parametrize("command, pair", [("simulate", "Q2.5-7B"), ("simulate", "Qwen2.5-7B/Qwen2.5-7B"),
                                           ("sweep", "Q2.5-7B"), ("demo", "Q2.5-7B")])
def test_a_pair_names_two_different_models(capsys, tmp_path, command, pair):
    argv = [command, "--pair", pair, "--out", str(tmp_path / "o")]
    argv += ["--param", "beta"] if command == "sweep" else []
    line = one_line_error(capsys, argv, command)
    assert "--pair must name two different models" in line and repr(pair) in line
    assert not (tmp_path / "o").exists()


def test_simulate_prints_results_to_stdout_and_names_every_file(capsys, tmp_path):
    out, records = tmp_path / "run.json", tmp_path / "calls.jsonl"
    rc = main(["simulate", *SIM, "--policies", "no-shadow,harvest-slo+host", "--out", str(out),
               "--records", str(records), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.out.strip().splitlines()
    assert lines[0].split() == ["metric", "no-shadow", "harvest-slo+host"]
    assert any(line.startswith("switch-call latency red. (%)") for line in lines)
    n_records = sum(1 for _ in records.open())
    assert lines[-2:] == [f"wrote {out}", f"wrote {records} ({n_records} calls)"]
    assert set(json.loads(out.read_text())["policies"]) == {"no-shadow", "harvest-slo+host"}
    assert captured.err == ""                                      # --quiet: no bar, no log lines


def test_the_progress_bar_counts_the_drain():
    """Simulated seconds up to the window's end, then the window's calls still running until they finish."""
    import io

    from tqdm import tqdm

    from shadowprefill.sim.simulator import _advance
    screen = io.StringIO()
    bar = tqdm(total=30, file=screen, mininterval=0, miniters=1, desc="p")
    for t, open_calls in ((0.5, 2), (12.3, 4), (29.9, 6)):
        assert _advance(bar, t, 30.0, open_calls) is bar
    assert bar.n == 29 and bar.total == 30
    _advance(bar, 30.2, 30.0, 5)                 # the window ends with 5 measured calls open: the drain starts
    assert (bar.n, bar.total, bar.desc) == (0, 5, "p drain")
    for t, open_calls, done in ((31.0, 5, 0), (40.0, 3, 2), (95.0, 0, 5)):
        _advance(bar, t, 30.0, open_calls)
        assert bar.n == done
    assert "5/5 calls finished" in screen.getvalue()


def test_simulate_shows_the_drain_on_its_bar(capsys, tmp_path):
    rc = main(["simulate", *SIM, "--policies", "no-shadow", "--out", str(tmp_path / "o.json")])
    captured = capsys.readouterr()
    assert rc == 0
    assert "no-shadow drain" in captured.err and "calls finished" in captured.err
    assert "metric" not in captured.err and captured.out.startswith("metric")


def test_sweep_and_gateway_sweep_name_their_files(capsys, tmp_path):
    out = tmp_path / "sweep.json"
    assert main(["sweep", *SIM, "--param", "beta", "--values", "0.5", "--policies", "no-shadow",
                 "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {out} (1 points of --param beta)"
    assert main(["gateway", "sweep", "--param", "hit_rate", "--out", str(tmp_path / "gw")]) == 0
    stem = tmp_path / "gw" / "gateway_sweep_hit_rate"
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"wrote {stem}.{ext}" for ext in ("png", "csv", "json")]
    assert all(Path(line.split()[1]).is_file() for line in lines)


def test_selfcheck_ends_with_one_verdict_line(capsys, monkeypatch):
    from shadowprefill import selfcheck
    assert main(["selfcheck"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "PASS: all 10 checks on cpu"
    real = selfcheck.run

    def one_failure(device):
        rows = real(device)
        return [rows[0][:1] + (False,) + rows[0][2:]] + rows[1:]
    monkeypatch.setattr(selfcheck, "run", one_failure)
    assert main(["selfcheck"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "FAIL: 1 of 10 checks on cpu: write_kv"


def test_no_import_circle_between_the_simulator_commands():
    """sim/study.py (the demo command) uses the shared arguments module, never sim/cli.py."""
    import ast
    from pathlib import Path

    import shadowprefill.sim.study as study
    tree = ast.parse(Path(study.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "shadowprefill.sim.cli" not in imported and "shadowprefill.sim.args" in imported
