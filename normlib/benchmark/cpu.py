"""CPU benchmark of normlib's modules, and of the reference math behind them, against ``torch.nn``.

Run it with::

    python -m normlib.benchmark --device cpu --out book/data/cpu_benchmark.json --plot book/data/cpu_benchmark.svg

For each case (a norm layer and an input shape) four candidates run the
same computation with the same parameters: ``torch.nn`` (the eager module),
``normlib`` (normlib's module, on whatever path :func:`normlib.ops.routing.route`
picks: torch's op with its statistics checked, or the reference),
``reference`` (the function of :mod:`normlib.functional`, the book's math)
and ``compiled`` (that function under ``torch.compile(fullgraph=True)``,
showing what fusing the reference's elementwise passes buys). Each is timed
for the forward alone (under ``torch.no_grad``) and for forward + backward,
and autograd's saved tensors are counted with
:func:`torch.autograd.graph.saved_tensors_hooks` (distinct storages,
parameters excluded).

A shared CPU makes absolute times meaningless, so the candidates are
interleaved: each *round* times every candidate back to back (the fastest of
a few calls each, since load only ever adds time), and the ratio
candidate / torch.nn is formed within the round; the reported ratio is the
median over the rounds. Targets (issue #24): normlib's modules within 1.2x
torch.nn's time, forward and forward + backward, and saved activations
within 1.25x. The small-BERT case times a ``transformers`` ``BertModel``
built from a config (no download) before and after
:func:`normlib.swap_norms`, and with every LayerNorm running
:func:`normlib.functional.layer_norm`.

The JSON records the machine, CPU model, thread count, versions, date and
the load average before and after the run.
"""

from __future__ import annotations

import copy
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
from torch import nn

from .. import _cli
from .. import batchnorm as _bn
from .. import functional as nf
from .. import normalization as _norm
from ._common import fastest, loadavg, provenance, reps_for, write_json

__all__ = ["Case", "CASES", "TARGETS", "saved_bytes", "run_case", "run_bert", "provenance", "main"]

TARGETS = {"time": 1.2, "time_aim": 1.2, "saved": 1.25, "bert": 1.1}
CANDIDATES = ("torch.nn", "normlib", "reference", "compiled")


@dataclass
class Case:
    """One layer at one shape. ``build()`` returns ``(module, normlib_module, reference_fn)``, all with one set of parameters."""

    name: str
    shape: tuple
    build: Callable[[], tuple[nn.Module, nn.Module, Callable]]
    target: bool = False  # one of the five, judged against the targets


def _twin(m: nn.Module, ours: nn.Module) -> nn.Module:
    """normlib's module with the torch module's state (its own buffers: each updates its own running statistics)."""
    ours.load_state_dict(m.state_dict())
    return ours.train(m.training)


def _layer_norm(d):
    def build():
        m = nn.LayerNorm(d)
        return m, _twin(m, _norm.LayerNorm(d)), lambda x: nf.layer_norm(x, (d,), m.weight, m.bias, m.eps)
    return build


def _rms_norm(d):
    def build():
        m = nn.RMSNorm(d)
        return m, _twin(m, _norm.RMSNorm(d)), lambda x: nf.rms_norm(x, (d,), m.weight, m.eps)
    return build


_T = TypeVar("_T")


def _present(value: Optional[_T], what: str) -> _T:
    """``value``, which the torch module's defaults guarantee is not ``None``."""
    if value is None:
        raise RuntimeError(f"the torch module's {what} is None")
    return value


def _batch_norm(c, training):
    def build():
        m = nn.BatchNorm2d(c).train(training)
        running_mean, running_var = _present(m.running_mean, "running_mean"), _present(m.running_var, "running_var")
        momentum = _present(m.momentum, "momentum")
        with torch.no_grad():  # non-trivial running statistics for eval
            running_mean.uniform_(-0.5, 0.5)
            running_var.uniform_(0.5, 2.0)
        rm, rv = running_mean.clone(), running_var.clone()  # the reference updates its own copies
        ours = _twin(m, _bn.BatchNorm2d(c))
        return m, ours, lambda x: nf.batch_norm(x, rm, rv, m.weight, m.bias, training, momentum, m.eps)
    return build


def _group_norm(g, c):
    def build():
        m = nn.GroupNorm(g, c)
        return m, _twin(m, _norm.GroupNorm(g, c)), lambda x: nf.group_norm(x, g, m.weight, m.bias, m.eps)
    return build


def _instance_norm(c):
    def build():
        m = nn.InstanceNorm2d(c, affine=True)
        momentum = _present(m.momentum, "momentum")
        ours = _twin(m, _bn.InstanceNorm2d(c, affine=True))
        return m, ours, lambda x: nf.instance_norm(x, None, None, m.weight, m.bias, True, momentum, m.eps)
    return build


CASES = [
    Case("LayerNorm(768)", (32, 128, 768), _layer_norm(768), True),
    Case("RMSNorm(768)", (32, 128, 768), _rms_norm(768), True),
    Case("BatchNorm2d(64) train", (32, 64, 56, 56), _batch_norm(64, True), True),
    Case("BatchNorm2d(64) eval", (32, 64, 56, 56), _batch_norm(64, False), True),
    Case("GroupNorm(32, 64)", (32, 64, 56, 56), _group_norm(32, 64), True),
    Case("InstanceNorm2d(64)", (32, 64, 56, 56), _instance_norm(64)),
    Case("LayerNorm(768), small", (4, 128, 768), _layer_norm(768)),
    Case("LayerNorm(4096), large", (16, 256, 4096), _layer_norm(4096)),
]


def saved_bytes(fn: Callable, x: torch.Tensor, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves for the backward of ``fn(x)``.

    Tensors in ``exclude`` (the parameters, which exist anyway) are not counted;
    the input is, when it is saved (it is an activation the model keeps alive).
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and t.numel():
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(seen.values())


def _fwd(fn, x):
    def run():
        with torch.no_grad():
            fn(x)
    return run


def _fwd_bwd(fn, x, params, dy):
    def run():
        x.grad = None
        for p in params:
            p.grad = None
        fn(x).backward(dy)
    return run


def _ratios(times: dict, name: str, ref: str = "torch.nn") -> list:
    return [a / b for a, b in zip(times[name], times[ref])]


def run_case(case: Case, rounds: int = 7, budget: float = 0.1, compile: bool = True, seed: int = 0) -> dict:
    """Time every candidate on ``case``, interleaved round by round; ratios are medians over rounds."""
    torch.manual_seed(seed)
    module, ours, reference = case.build()
    params = [p for p in module.parameters()]
    x = torch.randn(case.shape)
    dy = torch.randn(case.shape)
    fns: dict[str, Callable] = {"torch.nn": module, "normlib": ours, "reference": reference}
    notes = {}
    if compile:
        try:
            torch._dynamo.reset()
            fns["compiled"] = torch.compile(reference, fullgraph=True)
        except Exception as e:  # pragma: no cover - depends on the machine's compiler
            notes["compiled"] = f"torch.compile failed: {type(e).__name__}: {e}"
    xg = x.clone().requires_grad_()
    runs = {}
    for name, fn in list(fns.items()):
        try:
            own = list(fn.parameters()) if isinstance(fn, nn.Module) else params
            f, fb = _fwd(fn, x), _fwd_bwd(fn, xg, own, dy)
            runs[name] = {"fwd": (f, reps_for(f, budget)), "fwd+bwd": (fb, reps_for(fb, budget))}
        except Exception as e:  # a compile that fails only when first run
            if name != "compiled":
                raise
            notes["compiled"] = f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in runs} for m in ("fwd", "fwd+bwd")}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))  # no candidate always goes first
        for mode in times:
            for n in order:
                run, reps = runs[n][mode]
                times[mode][n].append(fastest(run, reps))
    out: dict[str, Any] = {
        "case": case.name,
        "shape": list(case.shape),
        "target": case.target,
        "rounds": rounds,
        "median_ms": {m: {n: 1e3 * statistics.median(t) for n, t in times[m].items()} for m in times},
        "ratio": {
            m: {n: statistics.median(_ratios(times[m], n)) for n in runs if n != "torch.nn"} for m in times
        },
        "ratio_range": {
            m: {n: [min(_ratios(times[m], n)), max(_ratios(times[m], n))] for n in runs if n != "torch.nn"}
            for m in times
        },
        "saved_bytes": {
            "torch.nn": saved_bytes(module, xg, params),
            "normlib": saved_bytes(ours, xg, list(ours.parameters())),
            "reference": saved_bytes(reference, xg, params),
        },
        "notes": notes,
    }
    out["ratio"]["saved"] = {"normlib": out["saved_bytes"]["normlib"] / max(out["saved_bytes"]["torch.nn"], 1)}
    out["met"] = {
        "fwd": out["ratio"]["fwd"]["normlib"] <= TARGETS["time"],
        "fwd+bwd": out["ratio"]["fwd+bwd"]["normlib"] <= TARGETS["time"],
        "saved": out["ratio"]["saved"]["normlib"] <= TARGETS["saved"],
    }
    out["aim_met"] = {m: out["ratio"][m]["normlib"] <= TARGETS["time_aim"] for m in ("fwd", "fwd+bwd")}
    if not (out["met"]["fwd"] and out["met"]["fwd+bwd"]):
        out["profile"] = profile(ours, xg, params, dy)
    return out


def profile(fn: Callable, x: torch.Tensor, params, dy: torch.Tensor, top: int = 8) -> list:
    """Where forward + backward spends its time: the ``top`` ops by self CPU time, as shares of the total."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as _profile

    run = _fwd_bwd(fn, x, params, dy)
    run()
    with _profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            run()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [
        {"op": e.key, "calls_per_iter": e.count / 3, "share": round(e.self_cpu_time_total / total, 3)}
        for e in events[:top]
    ]


def _bert(hidden: int = 256, layers: int = 4):
    from transformers import BertConfig, BertModel

    # attn_implementation goes to __post_init__'s **kwargs, which dataclass_transform hides from mypy
    cfg = BertConfig(  # type: ignore[call-arg]
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=4 * hidden, vocab_size=1000, max_position_embeddings=256,
        attn_implementation="eager",
    )
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
    return BertModel(cfg)


class _FunctionalLayerNorm:
    """An instance ``forward`` for an ``nn.LayerNorm`` that calls :func:`normlib.functional.layer_norm`."""

    def __init__(self, m):
        self.m = m

    def __call__(self, x):
        m = self.m
        return nf.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)


def run_bert(batch: int = 8, seq: int = 128, hidden: int = 256, layers: int = 4,
             rounds: int = 7, budget: float = 2.0, seed: int = 0) -> dict:
    """Forward + backward of a small BERT: original, after ``swap_norms``, and with normlib's functional LayerNorm."""
    from .. import swap_norms

    torch.manual_seed(seed)
    original = _bert(hidden, layers).train()
    swapped = copy.deepcopy(original)
    report = swap_norms(swapped, warn=False)
    functional = copy.deepcopy(original)
    n_ln = 0
    for mod in functional.modules():
        if type(mod) is nn.LayerNorm:
            mod.forward = _FunctionalLayerNorm(mod)  # type: ignore[method-assign]  # an instance forward, on purpose
            n_ln += 1
    ids = torch.randint(0, 1000, (batch, seq))
    models = {"original": original, "swap_norms": swapped, "functional LayerNorm": functional}

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids).last_hidden_state.square().mean().backward()
        return run

    runs = {n: step(m) for n, m in models.items()}
    reps = {n: reps_for(r, budget) for n, r in runs.items()}
    times: dict[str, list[float]] = {n: [] for n in runs}
    for r in range(rounds):
        for n in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            times[n].append(fastest(runs[n], reps[n]))
    ratio = {n: statistics.median(_ratios(times, n, "original")) for n in runs if n != "original"}
    # the three give the same gradients: the comparison is of equal work
    grads = []
    for m in models.values():
        m.zero_grad(set_to_none=True)
        m(input_ids=ids).last_hidden_state.square().mean().backward()
        grads.append(m.embeddings.word_embeddings.weight.grad)
    same = all(torch.allclose(g, grads[0], atol=1e-5, rtol=1e-4) for g in grads[1:])
    return {
        "config": {"batch": batch, "seq": seq, "hidden": hidden, "layers": layers},
        "layer_norms": n_ln,
        "swap_norms_swapped": report.count,
        "rounds": rounds,
        "median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
        "ratio": ratio,
        "met": {n: v <= TARGETS["bert"] for n, v in ratio.items()},
        "same_gradients": bool(same),
    }


def _fmt(r: float, limit: float) -> str:
    return f"{r:5.2f}x {'met' if r <= limit else 'MISSED'}"


def report(data: dict) -> str:
    """The ratio table, each target marked met or missed."""
    p = data['provenance']
    lines = [
        f"normlib / torch.nn on {p['cpu_model']}, {p['threads']} threads, torch {p['torch']}, "
        f"load average {p['loadavg_before'][0]:.1f}; medians of {data['rounds']} interleaved rounds",
        f"targets: time <= {TARGETS['time']}x (aim {TARGETS['time_aim']}x), saved activations <= {TARGETS['saved']}x",
        f"{'case':<24}{'shape':<18}{'forward':<14}{'fwd+bwd':<14}{'saved':<14}"
        f"{'reference fwd':>14}{'ref f+b':>9}{'compiled fwd':>13}{'compiled f+b':>13}",
    ]
    for c in data["cases"]:
        r = c["ratio"]
        other = [r[m].get(n) for n in ("reference", "compiled") for m in ("fwd", "fwd+bwd")]
        cols = [f"{v:{w}.2f}x" for v, w in zip(other, (13, 8, 12, 12)) if v is not None]
        mark = "" if c["target"] else "  (no target)"
        lines.append(
            f"{c['case']:<24}{'x'.join(map(str, c['shape'])):<18}"
            f"{_fmt(r['fwd']['normlib'], TARGETS['time']):<14}{_fmt(r['fwd+bwd']['normlib'], TARGETS['time']):<14}"
            f"{_fmt(r['saved']['normlib'], TARGETS['saved']):<14}{''.join(cols)}{mark}"
        )
    b = data.get("bert")
    if b:
        for n, v in b["ratio"].items():
            lines.append(f"small BERT fwd+bwd, {n} / original: {_fmt(v, TARGETS['bert'])} (target {TARGETS['bert']}x)")
    return "\n".join(lines)


def plot(data: dict, path: str):
    """Horizontal bars of the normlib / torch.nn ratios per case, log axis, with the targets drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Text kept as text in an SVG (the book's Chinese edition translates its labels).
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "cpu_benchmark"}):
        return _plot(plt, data, path)


def _plot(plt, data: dict, path: str):
    import matplotlib
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    cases = data["cases"]
    kinds = [("fwd", "forward time"), ("fwd+bwd", "forward + backward time"), ("saved", "saved activations")]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(cases) * 1.4 + 1.6))
    h = 0.26
    for k, (key, label) in enumerate(kinds):
        vals = [c["ratio"][key]["normlib"] for c in cases]
        ax.barh([i + (k - 1) * h for i in range(len(cases))], vals, height=h, label=label)
    ax.set_xscale("log")
    ticks = [0.25, 0.5, 0.75, 1, 1.2, 1.5, 2, 3, 4]
    lo = min(min(c["ratio"][key]["normlib"] for c in cases for key, _ in kinds), 0.9)
    hi = max(max(c["ratio"][key]["normlib"] for c in cases for key, _ in kinds), 1.6)
    ax.set_xlim(lo / 1.15, hi * 1.15)
    ax.xaxis.set_major_locator(FixedLocator([t for t in ticks if lo / 1.15 <= t <= hi * 1.15]))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    for x, style in ((1.0, "-"), (TARGETS["time"], "--"), (TARGETS["saved"], ":")):
        ax.axvline(x, color="0.3", lw=0.8, ls=style)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels([f"{c['case']}\n{'×'.join(map(str, c['shape']))}" for c in cases], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("normlib module / torch.nn (ratio, log scale; lines at 1, the 1.2 time target and the 1.25 memory target)")
    p = data["provenance"]
    ax.set_title(
        f"normlib modules vs torch.nn on CPU: {p['cpu_model']}, {p['threads']} threads, torch {p['torch']}\n"
        f"median of {data['rounds']} interleaved rounds, {p['date']}, load average {p['loadavg_before'][0]:.1f}",
        fontsize=8,
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    _cli.save_figure(fig, path)
    plt.close(fig)
    return path


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark --device cpu``."""
    p = _cli.Parser(prog="python -m normlib.benchmark --device cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=_cli.output_file((".json",)), default="cpu_benchmark.json",
                   help="where to write the JSON record")
    p.add_argument("--plot", type=_cli.output_file((".svg", ".png", ".pdf")), default=None,
                   help="also draw the ratios into this figure (.svg, .png or .pdf)")
    p.add_argument("--rounds", type=_cli.int_at_least(1, 1000), default=7, help="interleaved rounds per case (median taken)")
    p.add_argument("--budget", type=_cli.positive_float(60.0), default=0.1,
                   help="seconds per measurement (repetitions chosen to fill it; at most 60)")
    p.add_argument("--cases", nargs="+", default=None, choices=[c.name for c in CASES], metavar="CASE",
                   help="case names to run (default: all): " + ", ".join(repr(c.name) for c in CASES))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidate")
    p.add_argument("--no-bert", action="store_true", help="skip the small-BERT measurement")
    p.add_argument("--scale", type=_cli.int_at_least(1, 1024), default=1, help="divide every batch size by this (quick runs)")
    return p


def main(argv: Optional[list] = None) -> int:
    """``python -m normlib.benchmark --device cpu [--out F.json] [--plot F.svg] [--rounds N] ...``."""
    args = parser().parse_args(argv)
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    if args.scale > 1:
        cases = [Case(c.name, (max(1, c.shape[0] // args.scale),) + tuple(c.shape[1:]), c.build, c.target) for c in cases]
    data = {"provenance": provenance(), "targets": TARGETS, "rounds": args.rounds, "cases": []}
    for c in cases:
        print(f"... {c.name} {list(c.shape)}", file=sys.stderr, flush=True)
        data["cases"].append(run_case(c, args.rounds, args.budget, compile=not args.no_compile))
        write_json(data, args.out)
    if not args.no_bert:
        print("... small BERT", file=sys.stderr, flush=True)
        data["bert"] = run_bert(rounds=args.rounds, batch=max(1, 8 // args.scale))
    data["provenance"]["loadavg_after"] = loadavg()
    write_json(data, args.out)
    if args.plot:
        plot(data, args.plot)
    print(report(data))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
