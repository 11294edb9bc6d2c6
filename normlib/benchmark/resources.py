"""Compile normlib's kernels for a GPU that need not be here, and read ptxas's resource report.

Triton compiles ahead of time without a device: its compiler lowers a kernel
to PTX for a chosen target and its bundled ``ptxas`` assembles that PTX and
reports registers and spills per thread. This catches what the interpreter
cannot (the kernels must pass Triton's type checks and code generation for a
real GPU), and shows the register pressure of the launcher's configurations.

Run it with the interpreter off (it refuses otherwise: the interpreter
replaces the kernels with Python functions)::

    TRITON_INTERPRET=0 python -m normlib.benchmark.resources --arch 90 bf16:fp32:layer:1024 ...

Each spec is ``dtype:residual_dtype:kind:N`` (``none`` for no residual); with
no spec it reports bf16 LayerNorm with an fp32 residual (the widest register
set) at N = 1024 ... 16384 (the widest row whose fp32 residual the kernels
hold) and without a residual at N = 32768. N is bounded by the wider of the
two dtypes, as the route bounds it. It prints a table, or with ``--json`` one JSON
object per spec and kernel.
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional

from .. import _cli

_PTR = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16", "fp64": "*fp64"}


def ptxas_path() -> Optional[str]:
    """The ``ptxas`` that Triton's NVIDIA backend ships, or ``None`` where it has none."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


def _pointers(dt, rdt):
    """Pointer types of the input, the residual and the fp32/fp64 statistics."""
    return _PTR[dt], _PTR[rdt or dt], "*fp64" if dt == "fp64" else "*fp32"


def _fwd(dt, rdt, kind):
    p, r, acc = _pointers(dt, rdt)
    sig = {"X": p, "R": r, "W": p, "B": p, "Y": p, "RES_OUT": r, "MEAN": acc, "RSTD": acc,
           "stride_x": "i32", "stride_r": "i32", "stride_y": "i32", "stride_ro": "i32", "M": "i32", "N": "i32",
           "eps": "fp32"}
    flags = dict(IS_RMS=kind == "rms", HAS_RES=rdt is not None, HAS_W=True, HAS_B=kind == "layer", ACC_FP64=dt == "fp64")
    return sig, flags


def _bwd(dt, rdt, kind):
    p, r, acc = _pointers(dt, rdt)
    sig = {"X": r, "W": p, "DY": p, "DRES": r, "DX": p, "DRES_IN": r, "PARTS": acc, "MEAN": acc, "RSTD": acc,
           "stride_x": "i32", "stride_dy": "i32", "stride_dres": "i32", "stride_dx": "i32", "stride_dres_in": "i32",
           "M": "i32", "N": "i32", "rows_per_program": "i32"}
    flags = dict(IS_RMS=kind == "rms", HAS_W=True, HAS_B=kind == "layer", HAS_DRES=rdt is not None,
                 SPLIT_DRES=rdt is not None, ACC_FP64=dt == "fp64")
    return sig, flags


def resources(arch: int, spec: str, fwd: Optional[dict] = None, bwd: Optional[dict] = None) -> list[dict]:
    """Compile the forward and backward kernels for ``spec`` as the launcher would; registers and spills.

    ``fwd`` / ``bwd`` override the launch configuration (see ``normlib.ops._kernels.fwd_config``).
    """
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from normlib.ops import _kernels as K

    dt, rdt_name, kind, n = spec.split(":")
    rdt = None if rdt_name == "none" else rdt_name
    esize = int(_PTR[dt][-2:]) // 8
    ptxas = ptxas_path()
    if ptxas is None:
        raise RuntimeError("Triton's NVIDIA backend (with its ptxas) is not installed")
    out = []
    kernels = (
        ("fwd", K._norm_fwd_kernel, _fwd(dt, rdt, kind), K.fwd_config(int(n), esize, **(fwd or {}))),
        ("bwd", K._norm_bwd_kernel, _bwd(dt, rdt, kind), K.bwd_config(int(n), esize, kind == "rms", **(bwd or {}))),
    )
    for name, kernel, (sig, flags), cfg in kernels:
        block_n, num_warps = cfg["block_n"], cfg["num_warps"]
        consts = dict(flags, BLOCK_N=block_n, ROWS=cfg["rows"], W_PLUS_ONE=False, ROUND_XHAT=0)
        if name == "fwd":
            consts.update(ROUND_PRODUCT=False)
        if name == "bwd":
            consts.update(NUM_STAGES=cfg["num_stages"], XDT=tl.float32)
        src = ASTSource(fn=kernel, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "k.ptx")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            arch_flag = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            report = subprocess.run([ptxas, f"-arch={arch_flag}", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                                    capture_output=True, text=True, check=True).stderr
        used = re.search(r"Used (\d+) registers", report)
        if used is None:
            raise RuntimeError(f"ptxas -v reported no register count for the {name} kernel of {spec}:\n{report}")
        out.append(dict(
            spec=spec, kernel=name, block_n=block_n, num_warps=num_warps, rows=cfg["rows"],
            registers=int(used.group(1)),
            shared_bytes=int(compiled.metadata.shared),
            num_stages=cfg.get("num_stages", 1),
            spill_bytes=sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)),
        ))
    return out


# the widest register set: bf16 LayerNorm with an fp32 residual, up to the widest row the route sends to the
# kernels (16384: the fp32 residual row is 64 KiB), and the widest bf16 row without a residual
DEFAULT_SPECS = [f"bf16:fp32:layer:{n}" for n in (1024, 2048, 4096, 8192, 16384)] + ["bf16:none:layer:32768"]


# compute capabilities ptxas assembles for (sm_XX)
ARCHS = (75, 80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)
_SPEC_FORM = "dtype:residual_dtype:kind:N"


def parse_spec(text: str) -> str:
    """A spec ``dtype:residual_dtype:kind:N``, checked: dtypes of the kernels, kind layer or rms, a row that fits."""
    from ..ops.routing import MAX_ROW_BYTES

    dt, rdt, kind, n = _cli.spec(_SPEC_FORM, (
        _cli.one_of(tuple(_PTR)), _cli.one_of(("none",) + tuple(_PTR)), _cli.one_of(("layer", "rms")),
        _cli.field_int(1)))(text)
    size = max(int(_PTR[d][-2:]) // 8 for d in (dt, rdt) if d != "none")  # the residual's row is held too
    widest = MAX_ROW_BYTES // size
    if n > widest:
        raise argparse.ArgumentTypeError(f"{text!r}: the field N must be at most {widest} for {dt} with residual "
                                         f"{rdt} (the kernels hold a row of up to {MAX_ROW_BYTES} bytes), got {n}")
    return text


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark.resources``."""
    p = _cli.Parser(prog="python -m normlib.benchmark.resources", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, choices=ARCHS, default=90, metavar="ARCH",
                   help="compute capability, e.g. 90 for H100, 80 for A100; one of " + ", ".join(map(str, ARCHS)))
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("specs", nargs="*", type=parse_spec, default=DEFAULT_SPECS,
                   help=f"{_SPEC_FORM}: dtype and residual_dtype from {', '.join(_PTR)} (residual_dtype also none), "
                        "kind layer or rms")
    return p


def main(argv=None) -> int:
    """The command line: ``python -m normlib.benchmark.resources --help``."""
    args = parser().parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("normlib.benchmark.resources: run with TRITON_INTERPRET=0; the interpreter replaces the kernels "
              "with Python functions", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError as e:
        print(f"normlib.benchmark.resources: needs Triton ({e}); install it with pip install 'normlib[triton]'", file=sys.stderr)
        return 2
    if ptxas_path() is None:
        print("normlib.benchmark.resources: Triton's NVIDIA backend (with its ptxas) is not installed", file=sys.stderr)
        return 2
    if not args.json:
        print(f"{'dtype:residual:kind:N':24s} {'kernel':6s} {'BLOCK_N':>7s} {'warps':>5s} {'registers':>9s} {'spill B':>7s} {'shared B':>8s}")
    for spec in args.specs:
        for row in resources(args.arch, spec):
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{row['spec']:24s} {row['kernel']:6s} {row['block_n']:7d} {row['num_warps']:5d} "
                      f"{row['registers']:9d} {row['spill_bytes']:7d} {row['shared_bytes']:8d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
