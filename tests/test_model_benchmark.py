"""The model benchmark's models and machinery, exercised on CPU with a tiny configuration.

Its measurements need a GPU (``python -m normlib.benchmark.model``); here the
same code builds every family and provider, trains a few steps and checks
what must hold for the comparison to be fair: every provider starts from the
same weights, and the fused and eager models train alike.
"""

import pytest
import torch

from normlib.benchmark import model as MB
from normlib.testing.tolerance import close

TINY = dict(batch=2, seq_len=16, d_model=32, n_layer=2, n_head=4, vocab=64, vocab_llama=64, ffn_llama=48)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_eager_and_fused_gpt_share_weights_and_compute_the_same(norm):
    family = "gpt" if norm == "layer" else "llama-style"
    a = MB.build(family, "torch", TINY, "cpu")
    b = MB.build(family, "normlib", TINY, "cpu")
    assert a.state_dict().keys() == b.state_dict().keys()
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    norm_cls = torch.nn.LayerNorm if norm == "layer" else torch.nn.RMSNorm
    assert sum(type(m) is norm_cls for m in a.modules()) == 2 * TINY["n_layer"] + 1
    assert a.lm_head.weight is a.wte.weight  # tied, and the torch norms hold the same parameter objects
    assert a.blocks[0].norm1.weight is not None
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(a(idx, idx), b(idx, idx), **close(torch.float32))


def test_gpt_starts_near_log_vocab():
    m = MB.build("gpt", "torch", TINY, "cpu")
    g = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    with torch.no_grad():
        assert abs(float(m(idx, tgt)) - torch.log(torch.tensor(64.0)).item()) < 0.2  # GPT-2's init: near-uniform


def test_run_family_machinery_on_cpu(monkeypatch):
    monkeypatch.setattr(MB, "COMPILE_BACKEND", "aot_eager")
    rec = MB.run_family("gpt", MB.PROVIDERS, TINY, rounds=2, steps_per_round=1, loss_steps=2, device="cpu",
                        log=lambda line: None)
    provs = rec["providers"]
    assert list(provs) == list(MB.PROVIDERS)
    for r in provs.values():
        assert len(r["losses"]) == 2 and len(r["step_ms_by_round"]) == 2 and r["tokens_per_s"] > 0
        assert r["max_abs_loss_difference_vs_torch"] < 1e-2  # bf16 autocast: the fused path trains like eager
    assert provs["torch"]["throughput_vs_torch"] == 1.0


def test_hf_families_are_swapped():
    pytest.importorskip("transformers")
    for family, kind in (("hf-llama", "llama_rms_norm"), ("hf-gpt2", "layer_norm")):
        m = MB.build(family, "normlib", TINY, "cpu")
        assert kind in m.normlib_report and "swapped" in m.normlib_report
        assert MB.build(family, "torch", TINY, "cpu").state_dict().keys() == m.state_dict().keys()


def test_norm_kernel_names():
    assert MB.is_norm_kernel("_norm_fwd_kernel") and MB.is_norm_kernel("triton_per_fused_add_native_layer_norm_0")
    s = MB.summarize_norm_kernels({"_norm_fwd_kernel": dict(calls=3, us=30.0),
                                   "void at::native::vectorized_layer_norm_kernel<float>": dict(calls=5, us=20.0)}, 100.0)
    assert s["normlib_kernel_calls"] == 3 and s["share_of_gpu_time"] == 0.5


def test_the_decoding_benchmark_runs_its_toy_model_on_cpu(tmp_path):
    """``python -m normlib.benchmark.decode --device cpu``: the tool's own plumbing, end to end, on a toy Llama
    (a GPU run measures the ~1B one); on CPU the swapped model runs its own forward, so the tokens agree."""
    pytest.importorskip("transformers")
    from normlib.benchmark import decode

    out = tmp_path / "decode.json"
    assert decode.main(["--device", "cpu", "--tokens", "3", "--rounds", "2", "--out", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert data["same_tokens"] is True and data["tokens"] == 3 and "llama_rms_norm" in data["swapped"]
    assert data["ratio_range"][0] <= data["ratio"] <= data["ratio_range"][1]
    assert set(data["ms_per_token"]) == {"transformers", "swap_norms"}
    with pytest.raises(SystemExit):
        decode.main(["--device", "cpu", "--tokens", "0"])
