"""What fused normalization buys a whole model: training-step throughput and memory on a GPU.

Run on a machine with a CUDA GPU::

    python -m normlib.benchmark.model --out book/data/model_benchmark.json

Four model families, each trained for a few steps from identical weights on
identical random tokens (bf16 autocast, AdamW), under several providers:

* ``gpt`` — a GPT-2-small-sized decoder (12 Pre-Norm blocks, d_model 768,
  12 heads, 1024 positions) built from :class:`normlib.TransformerBlock`,
  LayerNorm; ``llama-style`` — the same with RMSNorm. Providers: ``torch``
  (every norm is ``torch.nn``'s and every residual add a separate op),
  ``normlib`` (normlib's norms, each residual add fused with the norm that
  follows it), ``torch.compile`` of the first, and ``torch.compile+normlib``
  (the second compiled, the kernels kept as custom operators).
* ``hf-gpt2`` and ``hf-llama`` — ``transformers`` models built from configs of
  the same size (random weights, no download): as they are (``torch``) and
  after :func:`normlib.swap_norms` (``normlib``).

Every provider runs the same number of steps, interleaved round by round
(a round times a few consecutive steps with CUDA events); the figure is the
median over rounds, and the ratios are against ``torch`` of the same family.
Losses of the first steps are recorded for every provider (the fused path
must train like eager), and one profiled step per provider counts the norm
kernels by name (normlib's ``_norm_fwd_kernel``/``_norm_bwd_kernel``,
torch's layer/RMS-norm kernels) and their share of GPU time.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Iterable, Literal, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import _cli, ops
from ..normalization import LayerNorm, RMSNorm
from ..transformer import TransformerBlock
from ._common import environment, warm_up_gpu, write_json

FAMILIES = ("hf-llama", "hf-gpt2", "gpt", "llama-style")
COMPILE_BACKEND = "inductor"  # the tests swap in "aot_eager" to exercise the machinery on CPU
PROVIDERS = ("torch", "normlib", "torch.compile", "torch.compile+normlib")


class GPT(nn.Module):
    """A GPT-2-shaped decoder built from :class:`~normlib.TransformerBlock` (Pre-Norm), with tied embeddings.

    The residual stream runs through the model's own loop, so that each
    residual add meets the norm after it (the next block's ``norm1``, or the
    final norm): with ``fused=True`` the two are one kernel
    (:func:`normlib.ops.add_layer_norm` / ``add_rms_norm``); with
    ``fused=False`` the norms are ``torch.nn``'s and the add is a separate op.
    """

    def __init__(self, vocab: int = 50304, d_model: int = 768, n_layer: int = 12, n_head: int = 12,
                 seq_len: int = 1024, norm: Literal["layer", "rms"] = "layer", fused: bool = True):
        super().__init__()
        self.fused = fused
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, n_head, norm_first=True, norm=norm, attn_impl="sdpa") for _ in range(n_layer)
        )
        self.ln_f = (LayerNorm if norm == "layer" else RMSNorm)(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's initialisation: N(0, 0.02) weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if not fused:  # torch.nn norms holding the same parameters
            for parent in [*self.blocks, self]:
                for name, child in list(parent.named_children()):
                    if isinstance(child, (LayerNorm, RMSNorm)):
                        setattr(parent, name, _torch_norm(child))

    def _add_norm(self, branch, h, norm):
        if branch is None:
            return norm(h), h
        if self.fused:
            if isinstance(norm, LayerNorm):
                return ops.add_layer_norm(branch, h, norm.weight, norm.bias, norm.eps)
            return ops.add_rms_norm(branch, h, norm.weight, norm.eps)
        h = h + branch
        return norm(h), h

    def forward(self, idx, targets):
        B, T = idx.shape
        h = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        branch = None
        for blk in cast("Iterable[TransformerBlock]", self.blocks):  # a ModuleList iterates as plain Modules
            y, h = self._add_norm(branch, h, blk.norm1)
            branch = blk.attn(y, y, y, causal=True)
            y, h = self._add_norm(branch, h, blk.norm2)
            branch = blk.ff(y)
        y, h = self._add_norm(branch, h, self.ln_f)
        logits = self.lm_head(y)  # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def _torch_norm(m: LayerNorm | RMSNorm) -> nn.Module:
    t: nn.Module
    if isinstance(m, LayerNorm):
        t = nn.LayerNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.weight is not None, bias=m.bias is not None)
    else:
        t = nn.RMSNorm(m.normalized_shape, eps=m.eps, elementwise_affine=m.weight is not None)
    for name, p in m.named_parameters(recurse=False):
        setattr(t, name, p)
    return t


def build(family: str, provider: str, cfg: dict, device: str = "cuda") -> nn.Module:
    """One model of ``family`` for ``provider``, with the weights every provider of the family shares."""
    torch.manual_seed(0)
    if family in ("gpt", "llama-style"):
        model = GPT(cfg["vocab"], cfg["d_model"], cfg["n_layer"], cfg["n_head"], cfg["seq_len"],
                    norm="layer" if family == "gpt" else "rms", fused="normlib" in provider)
    else:
        import transformers

        conf: transformers.PreTrainedConfig
        if family == "hf-gpt2":
            conf = transformers.GPT2Config(vocab_size=cfg["vocab"], n_embd=cfg["d_model"], n_layer=cfg["n_layer"],
                                           n_head=cfg["n_head"], n_positions=cfg["seq_len"])
        else:
            conf = transformers.LlamaConfig(vocab_size=cfg["vocab_llama"], hidden_size=cfg["d_model"],
                                            intermediate_size=cfg["ffn_llama"], num_hidden_layers=cfg["n_layer"],
                                            num_attention_heads=cfg["n_head"], num_key_value_heads=cfg["n_head"],
                                            max_position_embeddings=cfg["seq_len"])
        model = transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa")
        if "normlib" in provider:
            from ..interop.swap import swap_norms

            model.normlib_report = str(swap_norms(model))
    return model.to(device).train()


def _loss(model, family, idx, tgt):
    if family.startswith("hf-"):
        return model(input_ids=idx, labels=tgt).loss
    return model(idx, tgt)


def _step(model, opt, family, idx, tgt):
    with torch.autocast(idx.device.type, dtype=torch.bfloat16):
        loss = _loss(model, family, idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _norm_kernels(model, opt, family, idx, tgt) -> dict:
    """Profile one step: the norm kernels by name and their share of GPU time."""
    from torch.profiler import ProfilerActivity, profile

    if not idx.is_cuda:
        return dict(kernels={}, normlib_kernel_calls=None, share_of_gpu_time=None, gpu_time_us=None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(model, opt, family, idx, tgt)
        torch.cuda.synchronize()
    total = 0.0
    norms: dict = {}
    for ev in prof.key_averages():
        t = ev.device_time_total
        if t <= 0:
            continue
        total += t
        if is_norm_kernel(ev.key):
            norms[ev.key[:80]] = dict(calls=ev.count, us=round(t, 1))
    return summarize_norm_kernels(norms, total)


NORMLIB_KERNELS = ("_norm_fwd_kernel", "_norm_bwd_kernel", "_col_sum_kernel")


def is_norm_kernel(name: str) -> bool:
    """A GPU kernel that normalizes, by name: normlib's, torch's layer/RMS-norm kernels, inductor's fused ones."""
    low = name.lower()
    return name in NORMLIB_KERNELS or any(k in low for k in ("layer_norm", "layernorm", "rms_norm", "rmsnorm"))


def summarize_norm_kernels(norms: dict, total_us: float) -> dict:
    """Calls of normlib's own kernels (exact names), and the share of GPU time spent in norm kernels."""
    return dict(kernels=norms, normlib_kernel_calls=sum(v["calls"] for k, v in norms.items() if k in NORMLIB_KERNELS),
                share_of_gpu_time=round(sum(v["us"] for v in norms.values()) / total_us, 4) if total_us else None,
                gpu_time_us=round(total_us, 1))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_family(family: str, providers, cfg: dict, *, rounds: int = 6, steps_per_round: int = 3, loss_steps: int = 5,
               device: str = "cuda", log=print) -> dict:
    """Build, check and time every provider of one family; returns its JSON-ready record."""
    B, T = cfg["batch"], cfg["seq_len"]
    vocab = cfg["vocab_llama"] if family == "hf-llama" else cfg["vocab"]
    g = torch.Generator(device=device).manual_seed(1)
    batches = [(torch.randint(0, vocab, (B, T), device=device, generator=g),
                torch.randint(0, vocab, (B, T), device=device, generator=g)) for _ in range(loss_steps)]
    models: dict[str, Any] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    rec: dict[str, Any] = {"providers": {}}
    for prov in providers:
        t0 = time.perf_counter()
        base = build(family, prov, cfg, device)
        model = torch.compile(base, backend=COMPILE_BACKEND) if prov.startswith("torch.compile") else base
        opt = torch.optim.AdamW(base.parameters(), lr=3e-4, fused=device == "cuda")
        # the first steps, from the shared initial weights, double as warm-up (and compilation)
        losses = [float(_step(model, opt, family, idx, tgt)) for idx, tgt in batches]
        _sync(device)
        h = torch.randn(2, 8, cfg["d_model"], device=device)
        rec["providers"][prov] = dict(
            losses=losses, setup_and_first_steps_s=round(time.perf_counter() - t0, 1),
            params=sum(p.numel() for p in base.parameters()),
            swap_report=getattr(base, "normlib_report", None), path_for_hidden=ops.path_for(h),
        )
        models[prov], opts[prov] = model, opt
        log(f"{family:12s} {prov:22s} losses {' '.join(f'{x:.4f}' for x in losses)}")
    idx, tgt = batches[0]
    step_ms: dict[str, list[float]] = {p: [] for p in providers}
    for r in range(rounds):
        order = list(providers)[r % len(providers):] + list(providers)[: r % len(providers)]
        for prov in order:
            _sync(device)
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                _step(models[prov], opts[prov], family, idx, tgt)
            if device == "cuda":
                end.record()
                torch.cuda.synchronize()
                step_ms[prov].append(start.elapsed_time(end) / steps_per_round)
            else:
                step_ms[prov].append((time.perf_counter() - t0) * 1e3 / steps_per_round)
    for prov in providers:
        r = rec["providers"][prov]
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            _step(models[prov], opts[prov], family, idx, tgt)
            torch.cuda.synchronize()
            r["step_peak_mb_above_resident"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
            r["resident_mb"] = round(before / 2**20, 1)
        else:
            r["step_peak_mb_above_resident"] = r["resident_mb"] = None
        r["step_ms_by_round"] = [round(x, 3) for x in step_ms[prov]]
        r["step_ms"] = statistics.median(step_ms[prov])
        r["tokens_per_s"] = B * T / (r["step_ms"] / 1e3)
        r["norms"] = _norm_kernels(models[prov], opts[prov], family, idx, tgt)
    ref = rec["providers"].get("torch")
    for prov, r in rec["providers"].items():
        if ref is not None:
            r["throughput_vs_torch"] = r["tokens_per_s"] / ref["tokens_per_s"]
            if ref["step_peak_mb_above_resident"]:
                r["peak_memory_vs_torch"] = r["step_peak_mb_above_resident"] / ref["step_peak_mb_above_resident"]
            r["max_abs_loss_difference_vs_torch"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        log(f"{family:12s} {prov:22s} {r['tokens_per_s']:10.0f} tok/s  step {r['step_ms']:7.2f} ms  "
            f"peak +{r['step_peak_mb_above_resident']} MB  x{r.get('throughput_vs_torch', 1):.3f}  "
            f"norm kernels {r['norms']['share_of_gpu_time']}  normlib calls {r['norms']['normlib_kernel_calls']}")
    del models, opts
    if device == "cuda":
        torch.cuda.empty_cache()
    return rec


def plot(data: dict, path: Optional[str] = None):
    """Throughput and step peak memory of every provider, as ratios to eager torch of the same family.

    Returns the matplotlib figure; saves it to ``path`` if given.
    """
    import matplotlib.pyplot as plt

    rows = [(fam, prov, r) for fam, rec in data["families"].items() for prov, r in rec["providers"].items()]
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.32 * len(rows) + 1.2), sharey=True)
    labels = [f"{fam}: {prov}" for fam, prov, _ in rows]
    ys = range(len(rows))[::-1]
    for ax, key, title in ((axes[0], "throughput_vs_torch", "tokens/s, ratio to eager torch"),
                           (axes[1], "peak_memory_vs_torch", "step peak memory, ratio to eager torch")):
        vals = [r.get(key, 1.0) for _, _, r in rows]
        colors = ["0.6" if prov == "torch" else ("C1" if "compile" in prov else "C0") for _, prov, _ in rows]
        ax.barh(list(ys), vals, color=colors)
        ax.axvline(1.0, color="k", lw=0.8)
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, max(vals) * 1.18)
    axes[0].set_yticks(list(ys), labels, fontsize=8)
    env = data["environment"]
    cfg = data["config"]
    fig.suptitle(f"training step, batch {cfg['batch']} x {cfg['seq_len']} tokens, bf16 autocast: {env['device']}, "
                 f"torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}", fontsize=8)
    fig.tight_layout()
    if path is not None:
        _cli.save_figure(fig, path, dpi=150)
    return fig


DEFAULT_CONFIG = dict(batch=16, seq_len=1024, d_model=768, n_layer=12, n_head=12, vocab=50304,
                      vocab_llama=32000, ffn_llama=2048)


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark.model``."""
    p = _cli.Parser(prog="python -m normlib.benchmark.model", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=_cli.output_file((".json",)), default="model_benchmark.json",
                   help="where to write the JSON record")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--batch", type=_cli.int_at_least(1, 1024), default=DEFAULT_CONFIG["batch"], help="sequences per step")
    p.add_argument("--rounds", type=_cli.int_at_least(1, 1000), default=6, help="interleaved rounds (median taken)")
    p.add_argument("--hf-compile", action="store_true", help="also time torch.compile of the transformers models")
    return p


def main(argv=None) -> int:
    """The command line: ``python -m normlib.benchmark.model --help``."""
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("normlib.benchmark.model: no CUDA GPU is available; nothing is measured.", file=sys.stderr)
        return 2
    cfg = dict(DEFAULT_CONFIG, batch=args.batch)
    env = environment("cuda")
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    data: dict[str, Any] = {"environment": env, "config": cfg, "autocast": "bfloat16", "optimizer": "AdamW(lr=3e-4, fused=True)",
            "compile_mode": ops.compile_mode(), "families": {}}
    warm_up_gpu()
    for fam in args.families:
        provs = PROVIDERS if (not fam.startswith("hf-") or args.hf_compile) else PROVIDERS[:2]
        data["families"][fam] = run_family(fam, provs, cfg, rounds=args.rounds)
        write_json(data, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
