"""Which printed lines of a chapter change with the CPU or the thread count?

    python book/_tools/stability.py book/05b_does_normalization_help.ipynb ...
    python book/_tools/stability.py --jobs 2 book/*.ipynb          # two executions at a time
    python book/_tools/stability.py --capabilities default,avx2 --threads 1 --blas auto book/01_layer_norm.ipynb

nbval compares every stored output line with a fresh execution, and the
stored outputs were made on one machine. Floating-point results depend on the
vector kernels ATen picks for the CPU (``default``, ``avx2``, ``avx512``: how
reductions are split into lanes), on the code path MKL picks for matrix
products (by instruction set *and* vendor: an Intel and an AMD CPU with the
same AVX-512 flags round a product differently) and on the thread count (how
a reduction is split between threads), so a line printed at too many digits
passes where it was made and fails on the next machine.

This tool executes each chapter under every ATen CPU capability this CPU can
run (``ATEN_CPU_CAPABILITY``; ``avx512`` only where the CPU has the AVX-512
subsets ATen's kernels need) times one and two threads times MKL's code paths
(``--blas``: ``auto``, MKL's own choice here; ``avx2``, the path of a CPU
without AVX-512, ``MKL_ENABLE_INSTRUCTIONS=AVX2``, run where the CPU has
AVX-512; ``compatible``, MKL's path that is the same on every x86-64 CPU,
``MKL_CBWR=COMPATIBLE``), each in a fresh kernel, and lists every output line
that differs between those runs or from the stored output — the same lines nbval compares: cells tagged
``nbval-ignore-output`` and figures are left out, and the sanitizing patterns
of tests/nbval_sanitize.cfg are applied first. A chapter passes when every
run prints what is stored. Exit status 0 when every chapter passes, 1 when a
line differs or an execution fails, 2 for bad arguments.

A capability this CPU lacks cannot be run here (forcing it is an illegal
instruction); the header says which were run. A machine with AVX-512 runs all
three, the superset of what an AVX2-only machine can run.
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"
sys.path.insert(0, str(HERE))
from execute_notebooks import cpu  # noqa: E402 (the CPU model and its ISA flags, read once for both tools)

CAPABILITIES = ("default", "avx2", "avx512")
# MKL's code paths for matrix products, and the environment that selects each
BLAS = {"auto": {}, "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "compatible": {"MKL_CBWR": "COMPATIBLE"}}
# The CPU flags ATen checks before it runs a capability's kernels (aten/src/ATen/cpu/Utils.cpp and
# c10's cpuinfo checks): AVX2 with FMA; AVX-512 F, BW, VL and DQ.
NEEDS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
SKIPPED_MIME = ("image/",)  # figures: nbval does not compare them either (book/conftest.py)


def runnable_capabilities(flags: set[str]) -> list[str]:
    return [c for c in CAPABILITIES if NEEDS[c] <= flags]


def distinct_blas(flags: set[str]) -> list[str]:
    """MKL's code paths that differ on this CPU: ``avx2`` only where MKL would otherwise use AVX-512."""
    return [b for b in BLAS if b != "avx2" or "avx512f" in flags]


def sanitizers() -> list[tuple[re.Pattern, str]]:
    """tests/nbval_sanitize.cfg's patterns, as nbval applies them."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(SANITIZE)
    return [(re.compile(cfg[s]["regex"]), cfg[s]["replace"]) for s in cfg.sections()]


def compared_lines(nb: dict, subs) -> dict[int, list[str]]:
    """Per code cell (by index), the output lines nbval compares, sanitized."""
    out: dict[int, list[str]] = {}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        tags = set(cell.get("metadata", {}).get("tags", []))
        if tags & {"nbval-ignore-output", "nbval-skip"}:
            continue
        lines: list[str] = []
        outputs: list[dict] = []
        for o in cell.get("outputs", []):  # consecutive writes to one stream are one text, as nbval joins them
            if (o["output_type"] == "stream" and outputs and outputs[-1]["output_type"] == "stream"
                    and outputs[-1]["name"] == o["name"]):
                outputs[-1] = {**outputs[-1], "text": "".join(outputs[-1]["text"]) + "".join(o["text"])}
            else:
                outputs.append(o)
        for o in outputs:
            if o["output_type"] == "stream":
                texts = [o["text"]]
            elif o["output_type"] == "error":
                texts = [f"{o['ename']}: {o['evalue']}"]
            else:
                texts = [v for k, v in o.get("data", {}).items() if k.startswith("text/") and k != "text/html"
                         and not k.startswith(SKIPPED_MIME)]
            for t in texts:
                t = "".join(t) if isinstance(t, list) else t
                for pattern, replace in subs:
                    t = pattern.sub(replace, t)
                lines += t.splitlines()
        out[i] = lines
    return out


def _execute_one(path: Path, capability: str, threads: int, blas: str, dest: Path) -> tuple[float, str]:
    """Execute ``path`` in a fresh process and kernel with the given ATen capability, thread count and MKL
    code path; write the executed notebook to ``dest``. Returns (seconds, error text or '')."""
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")}
    env.update(ATEN_CPU_CAPABILITY=capability, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               **BLAS[blas])
    code = ("import sys, nbformat; sys.path.insert(0, sys.argv[3]); from execute_notebooks import run; "
            "nbformat.write(run(__import__('pathlib').Path(sys.argv[1])), sys.argv[2])")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(dest), str(HERE)], env=env,
                          capture_output=True, text=True)
    err = "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return time.monotonic() - t0, err


def check(paths: list[Path], configs: list[tuple[str, int, str]], jobs: int) -> int:
    subs = sanitizers()
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = [(p, cap, t, b, Path(tmp) / f"{p.stem}.{cap}.{t}.{b}.ipynb") for p in paths for cap, t, b in configs]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            done = list(pool.map(lambda w: _execute_one(*w), work))
        results = {(p, cap, t, b): (dest, secs, err) for (p, cap, t, b, dest), (secs, err) in zip(work, done)}
        for p in paths:
            stored = compared_lines(json.loads(p.read_text()), subs)
            runs: dict[str, dict[int, list[str]]] = {}
            print(f"\n{os.path.relpath(p)}")
            for cap, t, b in configs:
                dest, secs, err = results[(p, cap, t, b)]
                name = f"{cap}/{t}t/{b}"
                if err:
                    print(f"  {name}: execution FAILED ({secs:.0f} s): {err}")
                    status = 1
                    continue
                runs[name] = compared_lines(json.loads(dest.read_text()), subs)
                print(f"  {name}: executed in {secs:.0f} s")
            differing = 0
            for cell, want in stored.items():
                got = {name: r.get(cell, []) for name, r in runs.items()}
                for k in range(max([len(want), *(len(g) for g in got.values())])):
                    line = want[k] if k < len(want) else "<no line>"
                    others = {name: (g[k] if k < len(g) else "<no line>") for name, g in got.items()}
                    if all(o == line for o in others.values()):
                        continue
                    differing += 1
                    print(f"  cell {cell}, line {k + 1}:")
                    print(f"    {'stored':>22}  {line}")
                    for name, o in others.items():
                        mark = "" if o == line else "   <- differs"
                        print(f"    {name:>22}  {o}{mark}")
            if differing:
                status = 1
            verdict = "every line the same in every run" if not differing else f"{differing} line(s) differ"
            print(f"  {p.name}: {verdict}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="+", type=Path, help="notebooks to check")
    parser.add_argument("--capabilities", default=None,
                        help="comma-separated subset of default,avx2,avx512 (default: every one this CPU runs)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (default: 1,2)")
    parser.add_argument("--blas", default=None,
                        help="comma-separated subset of auto,avx2,compatible: MKL's code paths (default: every one "
                             "that differs on this CPU)")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="executions at a time (default: 1)")
    args = parser.parse_args(argv)

    machine = cpu()
    flags = set((machine["cpu_flags"] or "").split())
    runnable = runnable_capabilities(flags)
    if args.capabilities is None:
        capabilities = runnable
    else:
        capabilities = [c.strip() for c in args.capabilities.split(",") if c.strip()]
        unknown = [c for c in capabilities if c not in CAPABILITIES]
        if unknown or not capabilities:
            parser.error(f"--capabilities: expected a comma-separated subset of {','.join(CAPABILITIES)}, "
                         f"got {args.capabilities!r}")
        missing = [c for c in capabilities if c not in runnable]
        if missing:
            parser.error(f"--capabilities: this CPU cannot run {','.join(missing)} (it runs {','.join(runnable)})")
    try:
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        parser.error(f"--threads: expected comma-separated positive integers, got {args.threads!r}")
    if args.blas is None:
        blas = distinct_blas(flags)
    else:
        blas = [b.strip() for b in args.blas.split(",") if b.strip()]
        if not blas or any(b not in BLAS for b in blas):
            parser.error(f"--blas: expected a comma-separated subset of {','.join(BLAS)}, got {args.blas!r}")
    if args.jobs < 1:
        parser.error(f"--jobs: expected a positive integer, got {args.jobs}")
    bad = [str(p) for p in args.chapters if p.suffix != ".ipynb" or not p.is_file()]
    if bad:
        parser.error(f"chapters: not notebook files: {', '.join(bad)}")

    lacking = [c for c in CAPABILITIES if c not in runnable]
    print(f"CPU: {machine['cpu'] or 'unknown'}; ATen capabilities run here: {', '.join(capabilities)}"
          + (f" (this CPU cannot run {', '.join(lacking)})" if lacking else "")
          + f"; threads: {', '.join(map(str, threads))}; MKL code paths: {', '.join(blas)}")
    configs = [(c, t, b) for c in capabilities for t in threads for b in blas]
    return check([p.resolve() for p in args.chapters], configs, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
