"""A transformers Llama decoding before and after :func:`normlib.swap_norms`: the time of a generated token.

Run on a machine with a CUDA GPU::

    python -m normlib.benchmark.decode --out book/data/decode_benchmark.json

Decoding hands each norm one row per sequence, so a norm's kernel finishes in
microseconds and what a token costs is mostly the host's work: this is
where a drop-in pays for every microsecond its Python adds (issue: a Llama
decoded 20 % slower after ``swap_norms`` on an H100). The model is built
from a config (random weights, no download), the same weights twice: as
transformers builds it, and a copy after ``swap_norms``. Each generates
``--tokens`` tokens greedily from the same prompt with its key/value cache,
interleaved round by round; the record holds the median milliseconds per
token of each, their ratio and its spread, whether the two produced the
same tokens, and the device, versions and date. ``--device cpu`` runs the
same on a CPU (tiny sizes: the test of the tool itself).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from typing import Any, Optional

import torch

from .. import _cli
from ._common import environment, provenance, write_json

__all__ = ["SIZES", "build", "measure", "main"]

MAX_POSITIONS, PROMPT = 2048, 32  # the model's positions, and the prompt's length
# (hidden, layers, heads, kv heads, intermediate, vocab): a ~1B-parameter Llama on a GPU, a toy on CPU
SIZES = {
    "cuda": (2048, 16, 32, 8, 5632, 32000),
    "cpu": (64, 2, 4, 2, 128, 256),
}


def build(device: str, dtype: torch.dtype):
    """The original model and its swapped copy (same weights), in eval mode on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..interop.swap import swap_norms

    hidden, layers, heads, kv, inter, vocab = SIZES[device]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=MAX_POSITIONS)
    torch.manual_seed(0)
    original: Any = LlamaForCausalLM(config)  # transformers types .to() as its own wrapper's
    original = original.to(device, dtype).eval()
    swapped = copy.deepcopy(original)
    report = swap_norms(swapped, warn=False)
    return original, swapped, report


def _generate(model, prompt: torch.Tensor, tokens: int) -> tuple[torch.Tensor, float]:
    """The generated tokens and the seconds they took (the device synchronized before and after)."""
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    with torch.no_grad():
        sync()
        t = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=0)
        sync()
    return out[:, prompt.shape[1]:], time.perf_counter() - t


def measure(device: str = "cuda", tokens: int = 64, rounds: int = 5, batch: int = 1, prompt_len: int = PROMPT) -> dict:
    """Median ms per token of the original and the swapped model, interleaved; and whether they agree."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    original, swapped, report = build(device, dtype)
    prompt = torch.randint(1, SIZES[device][5], (batch, prompt_len), device=device)
    runs: dict[str, list[float]] = {"transformers": [], "swap_norms": []}
    outputs = {}
    models = {"transformers": original, "swap_norms": swapped}
    for name, model in models.items():  # warm-up: caches, kernels compiled
        outputs[name] = _generate(model, prompt, tokens)[0]
    for r in range(rounds):
        for name in (("transformers", "swap_norms") if r % 2 == 0 else ("swap_norms", "transformers")):
            runs[name].append(_generate(models[name], prompt, tokens)[1] / tokens)
    ratios = [a / b for a, b in zip(runs["swap_norms"], runs["transformers"])]
    return {
        "provenance": environment(device) if device == "cuda" else provenance(),
        "model": dict(zip(("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"), SIZES[device])),
        "dtype": str(dtype).replace("torch.", ""), "batch": batch, "prompt": prompt_len, "tokens": tokens,
        "rounds": rounds, "swapped": str(report),
        "ms_per_token": {k: 1e3 * statistics.median(v) for k, v in runs.items()},
        "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        "same_tokens": bool(torch.equal(outputs["transformers"], outputs["swap_norms"])),
    }


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark.decode``."""
    p = _cli.Parser(prog="python -m normlib.benchmark.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=_cli.output_file((".json",)), default="decode_benchmark.json",
                   help="where to write the JSON record")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu runs a toy model")
    p.add_argument("--tokens", type=_cli.int_at_least(1, MAX_POSITIONS - PROMPT), default=64,
                   help=f"tokens generated per round (the model holds {MAX_POSITIONS} positions, {PROMPT} of them the prompt)")
    p.add_argument("--rounds", type=_cli.int_at_least(1, 1000), default=5, help="interleaved rounds (median taken)")
    p.add_argument("--batch", type=_cli.int_at_least(1, 1024), default=1, help="sequences decoded at once")
    return p


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        return _cli.fail("normlib.benchmark.decode", "no CUDA device here; nothing measured (--device cpu runs the toy model)")
    data = measure(args.device, args.tokens, args.rounds, args.batch)
    write_json(data, args.out, newline=True)
    ms = data["ms_per_token"]
    print(f"{data['provenance'].get('device', data['provenance'].get('cpu_model'))}: transformers "
          f"{ms['transformers']:.2f} ms/token, after swap_norms {ms['swap_norms']:.2f} ms/token, ratio "
          f"{data['ratio']:.3f} [{data['ratio_range'][0]:.3f}, {data['ratio_range'][1]:.3f}], same tokens: "
          f"{data['same_tokens']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
