"""Every ``python -m normlib...`` command follows one convention (``normlib/_cli.py``).

A bad argument is refused before any work starts, with one line on standard
error that names the argument and what it allows, exit status 2, no
traceback, and nothing written. Every option of every tool has a bad value
below; ``test_every_option_has_a_bad_value`` keeps it that way when a tool
gains an option.
"""

import importlib
import json
import os
import stat
import subprocess
import sys

import pytest

from normlib import _cli

# tool -> module with parser() and main(argv)
TOOLS = {
    "normlib.benchmark": "normlib.benchmark.gpu",
    "normlib.benchmark --device cpu": "normlib.benchmark.cpu",
    "normlib.benchmark.crossover": "normlib.benchmark.crossover",
    "normlib.benchmark.host": "normlib.benchmark.host",
    "normlib.benchmark.swap_cpu": "normlib.benchmark.swap_cpu",
    "normlib.benchmark.resources": "normlib.benchmark.resources",
    "normlib.benchmark.tune": "normlib.benchmark.tune",
    "normlib.benchmark.model": "normlib.benchmark.model",
    "normlib.benchmark.decode": "normlib.benchmark.decode",
    "normlib.examples.sync_bn": "normlib.examples.sync_bn",
}

MISSING_DIR = os.path.join("no", "such", "folder")

# tool -> (argv, the option the error must name, words the error must contain)
BAD = {
    "normlib.benchmark": [
        (["--device", "gpu"], "--device", "choose from"),
        (["--dtype", "fp8"], "--dtype", "choose from"),
        (["--rows", "0"], "--rows", "from 1 to 1048576"),
        (["--rows", "many"], "--rows", "from 1 to 1048576"),
        (["--widths", "-4"], "--widths", "from 1 to 1048576"),
        (["--ops", "batch_norm"], "--ops", "choose from"),
        (["--providers", "apex"], "--providers", "choose from"),
        (["--out", "."], "--out", ".json"),
        (["--out", "a_folder.json"], "--out", "folder"),
        (["--out", os.path.join(MISSING_DIR, "b.json")], "--out", "does not exist"),
        (["--resume", "--out", "corrupt.json"], "--resume", "not a JSON record"),
        (["--resume", "--out", "other.json"], "--resume", "not a record of this benchmark"),
        (["--plot", "figure.txt"], "--plot", ".png"),
    ],
    "normlib.benchmark --device cpu": [
        (["--out", "a_folder.json"], "--out", "folder"),
        (["--plot", "ratios.jpeg"], "--plot", ".svg"),
        (["--rounds", "0"], "--rounds", "from 1 to 1000"),
        (["--budget", "-1"], "--budget", "> 0"),
        (["--budget", "nan"], "--budget", "> 0"),
        (["--budget", "1e9"], "--budget", "<= 60"),
        (["--cases", "LayerNorm(76)"], "--cases", "choose from"),
        (["--scale", "0"], "--scale", "from 1 to 1024"),
    ],
    "normlib.benchmark.crossover": [
        (["--out", "a_folder.json"], "--out", "folder"),
        (["--rounds", "0"], "--rounds", "from 1 to 1000"),
        (["--device", "mps"], "--device", "choose from"),
    ],
    "normlib.benchmark.host": [
        (["--out", os.path.join(MISSING_DIR, "h.json")], "--out", "does not exist"),
        (["--rounds", "-3"], "--rounds", "from 1 to 1000"),
        (["--threads", "0"], "--threads", "from 1 to 1024"),
    ],
    "normlib.benchmark.swap_cpu": [
        (["--out", "a_folder.json"], "--out", "folder"),
        (["--rounds", "0"], "--rounds", "from 1 to 1000"),
        (["--budget", "0"], "--budget", "> 0"),
    ],
    "normlib.benchmark.resources": [
        (["--arch", "0"], "--arch", "choose from"),
        (["--arch", "ninety"], "--arch", "invalid int"),
        (["bf16:fp32:layer"], "specs", "4 fields"),
        (["bf8:fp32:layer:1024"], "specs", "the field dtype must be one of"),
        (["bf16:fp32:batch:1024"], "specs", "the field kind must be one of"),
        (["bf16:none:rms:0"], "specs", "the field N must be an integer >= 1"),
        (["bf16:none:rms:65536"], "specs", "at most 32768"),
        (["bf16:fp32:layer:32768"], "specs", "at most 16384 for bf16 with residual fp32"),
    ],
    "normlib.benchmark.tune": [
        (["--out", "a_folder.json"], "--out", "folder"),
        (["--baseline", "missing_kernels.py"], "--baseline", "existing file"),
        (["--baseline", "notes.txt"], "--baseline", ".py"),
        (["--cases", "layer_norm:bf16:16384"], "--cases", "4 fields"),
        (["--cases", "group_norm:bf16:8:1024"], "--cases", "the field op must be one of"),
        (["--cases", "rms_norm:fp32:8:16385"], "--cases", "at most 16384"),
        (["--directions", "sideways"], "--directions", "choose from"),
        (["--sweeps", "0"], "--sweeps", "from 1 to 100"),
    ],
    "normlib.benchmark.model": [
        (["--out", "a_folder.json"], "--out", "folder"),
        (["--families", "bert"], "--families", "choose from"),
        (["--batch", "0"], "--batch", "from 1 to 1024"),
        (["--rounds", "0"], "--rounds", "from 1 to 1000"),
    ],
    "normlib.benchmark.decode": [
        (["--out", "a_folder.json"], "--out", "folder"),
        (["--device", "tpu"], "--device", "choose from"),
        (["--tokens", "0"], "--tokens", "from 1 to 2016"),
        (["--tokens", "100000000000000000000000000"], "--tokens", "from 1 to 2016"),
        (["--rounds", "0"], "--rounds", "from 1 to 1000"),
        (["--batch", "-1"], "--batch", "from 1 to 1024"),
        (["--batch", "99999999999999"], "--batch", "from 1 to 1024"),
        (["--out", "a" * 300 + ".json"], "--out", "longer than"),
    ],
    "normlib.examples.sync_bn": [
        (["--nproc", "0"], "--nproc", "from 1 to 64"),
        (["--per-rank", "0"], "--per-rank", "from 1 to 4096"),
        (["--per-rank", "99999999999999"], "--per-rank", "from 1 to 4096"),
        (["--steps", "-2"], "--steps", "from 1 to 100000"),
        (["--time-steps", "-1"], "--time-steps", "from 0 to 100000"),
        (["--time-batch", "0"], "--time-batch", "from 1 to 4096"),
        (["--seed", "-1"], "--seed", "from 0 to"),
        (["--timeout", "0"], "--timeout", "> 0"),
        (["--timeout", "inf"], "--timeout", "> 0"),
        (["--timeout", "1e9"], "--timeout", "<= 86400"),
        (["--json", os.path.join(MISSING_DIR, "r.json")], "--json", "does not exist"),
        (["--json", "a_folder.json"], "--json", "folder"),
    ],
}


def _options(module: str) -> set:
    """The options (and positional arguments) a tool's parser takes values for."""
    parser = importlib.import_module(module).parser()
    return {(a.option_strings[0] if a.option_strings else a.dest) for a in parser._actions
            if a.dest != "help" and a.nargs != 0}


def _workdir(tmp_path):
    (tmp_path / "a_folder.json").mkdir()
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"cases": []}))
    (tmp_path / "notes.txt").write_text("")
    return sorted(os.listdir(tmp_path))


def test_every_tool_is_listed():
    """Every module under normlib that runs as ``python -m`` is in TOOLS."""
    import normlib

    root = os.path.dirname(normlib.__file__)
    runnable = set()
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py") and "__name__ == \"__main__\"" in open(os.path.join(folder, f)).read():
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(root))[:-3].replace(os.sep, ".")
                runnable.add(rel.removesuffix(".__main__"))
    assert runnable <= set(TOOLS.values()) | {"normlib.benchmark"}, runnable - set(TOOLS.values())


@pytest.mark.parametrize("tool", list(TOOLS))
def test_every_option_has_a_bad_value(tool):
    covered = {opt for argv, opt, _ in BAD[tool]}
    assert _options(TOOLS[tool]) <= covered, f"{tool}: no bad value tried for {_options(TOOLS[tool]) - covered}"


@pytest.mark.parametrize(("tool", "argv", "option", "words"),
                         [(t, a, o, w) for t, cases in BAD.items() for a, o, w in cases],
                         ids=[f"{t}:{' '.join(a)}" for t, cases in BAD.items() for a, _, _ in cases])
def test_a_bad_argument_is_one_line_and_status_2(tool, argv, option, words, tmp_path, monkeypatch, capsys):
    before = _workdir(tmp_path)
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(TOOLS[tool])
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    prog = "python -m " + tool
    assert lines[0].startswith(f"{prog}: error: argument {option}"), lines[0]
    assert words in lines[0], lines[0]
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no temporary file left


@pytest.mark.slow
@pytest.mark.parametrize("tool", list(TOOLS))
def test_the_real_command_exits_2_without_a_traceback(tool, tmp_path):
    argv, option, _ = BAD[tool][0]
    _workdir(tmp_path)
    cmd = [sys.executable, "-m", *tool.split(), *argv]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and f"argument {option}" in proc.stderr, proc.stderr


def test_a_link_is_checked_where_it_leads(tmp_path, capsys):
    """A dangling symbolic link into a missing folder is refused up front (it failed after the work before)."""
    from normlib.benchmark import host

    (tmp_path / "out.json").symlink_to(tmp_path / "missing" / "out.json")
    with pytest.raises(SystemExit) as exit_:
        host.main(["--out", str(tmp_path / "out.json")])
    assert exit_.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_sync_bn_checks_its_record_before_starting_processes(tmp_path, monkeypatch):
    """The record's path is checked first: a run that cannot write its record never starts (data lost before)."""
    from normlib.examples import launch, sync_bn

    def no_spawn(*args, **kwargs):
        raise AssertionError("processes were started for a run whose record cannot be written")

    monkeypatch.setattr(launch, "spawn", no_spawn)
    (tmp_path / "a_file").write_text("")
    for path in (tmp_path / "a_file" / "r.json", tmp_path):  # a folder that is a file; a folder
        with pytest.raises(SystemExit) as exit_:
            sync_bn.main(["--json", str(path)])
        assert exit_.value.code == 2


def test_write_text_is_atomic_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "record.json"
    _cli.write_text(str(target), "first")
    target.chmod(0o640)
    _cli.write_text(str(target), "second")
    assert target.read_text() == "second"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # an existing file keeps its permissions
    assert sorted(os.listdir(tmp_path)) == ["record.json"]

    folder = tmp_path / "now_a_folder.json"
    folder.mkdir()  # became a folder after the check, say
    with pytest.raises(OSError):
        _cli.write_text(str(folder), "x")
    assert sorted(os.listdir(tmp_path)) == ["now_a_folder.json", "record.json"]

    with pytest.raises(TypeError):
        _cli.write_text(str(target), 3)  # type: ignore[arg-type]  # fails while writing
    assert target.read_text() == "second"
    assert sorted(os.listdir(tmp_path)) == ["now_a_folder.json", "record.json"]


def test_a_new_file_gets_the_umask_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        _cli.write_text(str(tmp_path / "new.json"), "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640


def test_save_figure_is_atomic(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    _cli.save_figure(fig, str(tmp_path / "f.svg"))
    assert (tmp_path / "f.svg").read_text().lstrip().startswith("<?xml")
    (tmp_path / "g.png").mkdir()
    with pytest.raises(OSError):
        _cli.save_figure(fig, str(tmp_path / "g.png"))
    plt.close(fig)
    assert sorted(os.listdir(tmp_path)) == ["f.svg", "g.png"]


def test_a_symbolic_link_is_written_through(tmp_path):
    (tmp_path / "records").mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "records" / "run.json")
    _cli.write_text(str(link), "{}")
    assert link.is_symlink() and (tmp_path / "records" / "run.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["latest.json", "records"]


@pytest.mark.slow
def test_sync_bn_that_runs_out_of_time_says_so_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "normlib.examples.sync_bn", "--timeout", "0.5", "--steps", "1",
                           "--time-steps", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "did not finish within 0.5 s" in proc.stderr, proc.stderr
