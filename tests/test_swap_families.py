"""swap_norms on ~50 transformers families, as a user would: tiny configs, random weights, no download.

For each family: which kinds it swaps and what it leaves alone (by class, with
the reason's key word), and that eval outputs stay bitwise equal in float32 and
bfloat16 (on CPU a swapped module runs its class's forward). Families with the
kinds added for this issue also train one AdamW step to identical losses and
parameters, and run through the kernels (Triton's interpreter) within rounding.
A family the installed transformers does not have is skipped (4.x lacks some).
"""

import copy
from dataclasses import dataclass, field

import pytest
import torch

import normlib as nl
from normlib import ops

from _helpers import assert_no_worse

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 64
LM = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
          intermediate_size=32, max_position_embeddings=64)
ENC = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
           max_position_embeddings=64)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)


@dataclass
class Family:
    config: str
    model: str
    kwargs: dict
    kinds: set  # the kinds its norms are swapped as
    left: dict = field(default_factory=dict)  # class name -> a word its reason must contain
    inputs: str = "ids"  # ids | seq2seq | image | clip | whisper
    new: bool = False  # a family with a kind added for the issue: also trained and run through the kernels


FAMILIES = {
    # decoder-only language models
    "llama": Family("LlamaConfig", "LlamaForCausalLM", LM, {"llama_rms_norm"}),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(LM, pad_token_id=0), {"llama_rms_norm"}),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(LM, head_dim=8), {"llama_rms_norm"}),  # + q/k norms
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(LM, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
                        {"llama_rms_norm"}),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(LM, **MOE), {"llama_rms_norm"}),
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM",
                          dict(LM, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=8,
                               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                               n_group=1, topk_group=1), {"llama_rms_norm"}),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", LM, {"llama_rms_norm"}),
    "glm4": Family("Glm4Config", "Glm4ForCausalLM", dict(LM, head_dim=8, pad_token_id=0), {"llama_rms_norm"}),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", dict(LM, head_dim=8), {"gemma_rms_norm"}),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(LM, head_dim=8), {"gemma_rms_norm"}),
    "phi": Family("PhiConfig", "PhiForCausalLM", LM, {"layer_norm"}),
    "stablelm": Family("StableLmConfig", "StableLmForCausalLM", dict(LM, num_key_value_heads=2, qk_layernorm=True),
                       {"layer_norm"}),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", ENC, {"layer_norm"}),
    "falcon": Family("FalconConfig", "FalconForCausalLM", dict(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                                                                num_attention_heads=2), {"layer_norm"}),
    "gptj": Family("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=V, n_embd=16, n_layer=2, n_head=2, rotary_dim=4,
                                                         n_positions=64), {"layer_norm"}),
    "bloom": Family("BloomConfig", "BloomForCausalLM", dict(vocab_size=V, hidden_size=16, n_layer=2, n_head=2),
                    {"layer_norm"}),
    "opt": Family("OPTConfig", "OPTForCausalLM", dict(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                                                      num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16,
                                                      max_position_embeddings=64), {"layer_norm"}),
    "jamba": Family("JambaConfig", "JambaForCausalLM",
                    dict(LM, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=2,
                         mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False), {"llama_rms_norm"}),
    "mamba": Family("MambaConfig", "MambaForCausalLM",
                    dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=2,
                         use_mambapy=False), {"llama_rms_norm"}),
    # the kinds added for the issue
    "olmo": Family("OlmoConfig", "OlmoForCausalLM", LM, {"float32_layer_norm"}, new=True),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", LM, {"float32_rms_norm"}, new=True),
    "olmo3": Family("Olmo3Config", "Olmo3ForCausalLM", LM, {"float32_rms_norm"}, new=True),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM",
                      dict(LM, head_dim=8, num_local_experts=4, num_experts_per_tok=2, layer_types=None),
                      {"float32_rms_norm"}, new=True),
    "helium": Family("HeliumConfig", "HeliumForCausalLM", dict(LM, head_dim=8), {"float32_rms_norm"}, new=True),
    "gemma3n": Family("Gemma3nTextConfig", "Gemma3nForCausalLM",
                      dict(LM, head_dim=8, laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=0,
                           hidden_size_per_layer_input=4, vocab_size_per_layer_input=V,
                           intermediate_size=[32, 32], activation_sparsity_pattern=[0.0, 0.0],
                           layer_types=["sliding_attention", "full_attention"]),
                      {"float32_rms_norm"}, new=True),
    "llama4": Family("Llama4TextConfig", "Llama4ForCausalLM",
                     dict(LM, head_dim=8, intermediate_size_mlp=32, num_local_experts=2, num_experts_per_tok=1,
                          interleave_moe_layer_step=1, no_rope_layers=[1, 1], attention_chunk_size=64),
                     {"llama_rms_norm", "float32_rms_norm"}, new=True),  # + Llama4TextL2Norm (q/k)
    "cohere": Family("CohereConfig", "CohereForCausalLM", dict(LM, num_key_value_heads=2, use_qk_norm=True),
                     {"float32_layer_norm"}, left={"CohereLayerNorm": "per head"}, new=True),
    "cohere2": Family("Cohere2Config", "Cohere2ForCausalLM", LM, {"float32_layer_norm"}, new=True),
    "nemotron": Family("NemotronConfig", "NemotronForCausalLM", dict(LM, head_dim=8, partial_rotary_factor=0.5),
                       {"layer_norm_1p"}, new=True),
    "deberta": Family("DebertaConfig", "DebertaForMaskedLM", dict(ENC, type_vocab_size=0),
                      {"deberta_layer_norm", "layer_norm"}, new=True),  # its LM head has a torch LayerNorm
    # gated RMSNorms: left alone, and the reason says so
    "mamba2": Family("Mamba2Config", "Mamba2ForCausalLM",
                     dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=2,
                          num_heads=4, head_dim=8, n_groups=1, chunk_size=8), {"llama_rms_norm"},
                     left={"MambaRMSNormGated": "gated"}),
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM",
                         dict(LM, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                              linear_value_head_dim=8, linear_conv_kernel_dim=2, num_experts=2, num_experts_per_tok=1,
                              moe_intermediate_size=16, shared_expert_intermediate_size=16,
                              layer_types=["linear_attention", "full_attention"]),
                         {"gemma_rms_norm"}, left={"Qwen3NextRMSNormGated": "gated"}),
    "zamba2": Family("Zamba2Config", "Zamba2ForCausalLM",
                     dict(LM, num_key_value_heads=2, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_headdim=8,
                          n_mamba_heads=4, num_mem_blocks=1, layers_block_type=["mamba", "hybrid"],
                          use_mem_rope=False, adapter_rank=4), {"llama_rms_norm"}, left={"Zamba2RMSNormGated": "gated"}),
    # encoders
    "bert": Family("BertConfig", "BertForMaskedLM", ENC, {"layer_norm"}),
    "roberta": Family("RobertaConfig", "RobertaForMaskedLM", dict(ENC, max_position_embeddings=70), {"layer_norm"}),
    "deberta_v2": Family("DebertaV2Config", "DebertaV2ForMaskedLM", dict(ENC, type_vocab_size=0), {"layer_norm"}),
    "modernbert": Family("ModernBertConfig", "ModernBertForMaskedLM",
                         dict(ENC, global_attn_every_n_layers=1, local_attention=16, pad_token_id=0,
                              attn_implementation="eager"),
                         {"layer_norm"}),
    "albert": Family("AlbertConfig", "AlbertForMaskedLM", dict(ENC, embedding_size=8), {"layer_norm"}),
    # encoder-decoders
    "t5": Family("T5Config", "T5ForConditionalGeneration",
                 dict(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0),
                 {"t5_layer_norm"}, inputs="seq2seq"),
    "bart": Family("BartConfig", "BartForConditionalGeneration",
                   dict(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64),
                   {"layer_norm"}, inputs="seq2seq"),
    "whisper": Family("WhisperConfig", "WhisperForConditionalGeneration",
                      dict(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
                           max_source_positions=8, max_target_positions=16, decoder_start_token_id=0,
                           pad_token_id=0, bos_token_id=0, eos_token_id=0, suppress_tokens=None,
                           begin_suppress_tokens=None), {"layer_norm"}, inputs="whisper"),
    # vision
    "vit": Family("ViTConfig", "ViTForImageClassification",
                  dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=16,
                       patch_size=4, num_labels=3), {"layer_norm"}, inputs="image"),
    "dinov2": Family("Dinov2Config", "Dinov2Model",
                     dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=16,
                          patch_size=4), {"layer_norm"}, inputs="image"),
    "swin": Family("SwinConfig", "SwinForImageClassification",
                   dict(embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2, image_size=16, patch_size=2,
                        num_labels=3), {"layer_norm"}, inputs="image"),
    "convnext": Family("ConvNextConfig", "ConvNextForImageClassification",
                       dict(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=16,
                            patch_size=2), {"channels_first_layer_norm", "layer_norm"}, inputs="image"),
    "convnextv2": Family("ConvNextV2Config", "ConvNextV2ForImageClassification",
                         dict(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=16,
                              patch_size=2), {"channels_first_layer_norm", "layer_norm"}, inputs="image"),
    "clip": Family("CLIPConfig", "CLIPModel",
                   dict(text_config=dict(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=16),
                        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=32, image_size=16, patch_size=4),
                        projection_dim=8), {"layer_norm"}, inputs="clip"),
    "siglip": Family("SiglipConfig", "SiglipModel",
                     dict(text_config=dict(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=32, max_position_embeddings=16),
                          vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, image_size=16, patch_size=4)),
                     {"layer_norm"}, inputs="clip"),
}


def _build(name, dtype=torch.float32, seed=0):
    fam = FAMILIES[name]
    config_cls = getattr(transformers, fam.config, None)
    model_cls = getattr(transformers, fam.model, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {fam.config}/{fam.model}")
    kwargs = dict(fam.kwargs)
    if "attn_implementation" not in kwargs:
        kwargs["attn_implementation"] = "eager"
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    try:
        model = model_cls(config).to(dtype)
    except AttributeError as e:  # transformers 4.x: StableLM's _init_weights zeroes the bias its q/k norms lack
        if name == "stablelm" and transformers.__version__.startswith("4."):
            pytest.skip(f"transformers {transformers.__version__} cannot build StableLM with qk_layernorm: {e}")
        raise
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _inputs(name, dtype, seed=1):
    fam = FAMILIES[name]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, 8), generator=g)
    image = torch.randn(2, 3, 16, 16, generator=g).to(dtype)
    if fam.inputs == "ids":
        return dict(input_ids=ids, labels=ids)
    if fam.inputs == "seq2seq":
        return dict(input_ids=ids, labels=ids)
    if fam.inputs == "image":
        return dict(pixel_values=image)
    if fam.inputs == "clip":
        return dict(input_ids=ids, pixel_values=image)
    if fam.inputs == "whisper":
        return dict(input_features=torch.randn(2, 8, 16, generator=g).to(dtype), labels=ids[:, :4])
    raise ValueError(fam.inputs)


def _tensors(out):
    values = out.to_tuple() if hasattr(out, "to_tuple") else (out,)
    flat = []
    for v in values:
        if isinstance(v, torch.Tensor):
            flat.append(v)
        elif isinstance(v, (tuple, list)):
            flat.extend(t for t in v if isinstance(t, torch.Tensor))
        elif hasattr(v, "to_tuple"):
            flat.extend(_tensors(v))
    return flat


def _run(model, inputs, seed=2):
    torch.manual_seed(seed)
    return model(**inputs)


def _first(out):
    for key in ("logits", "logits_per_image", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    return _tensors(out)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_swaps_its_norms_and_keeps_its_outputs(name, dtype):
    fam = FAMILIES[name]
    original = _build(name, dtype).eval()
    model = copy.deepcopy(original)
    report = nl.swap_norms(model, warn=False)
    kinds = {k for v in report.kinds.values() for k in v.split(", ")}
    assert kinds == fam.kinds, str(report)
    left = {n.rsplit(".", 1)[-1]: why for n, (_, why) in report.left.items()}
    assert set(left) == set(fam.left), str(report)
    for cls, word in fam.left.items():
        assert word in left[cls], left[cls]
    inputs = _inputs(name, dtype)
    with torch.no_grad():
        a, b = _run(original, inputs), _run(model, inputs)
    ta, tb = _tensors(a), _tensors(b)
    assert len(ta) == len(tb) > 0
    for x, y in zip(ta, tb):
        assert torch.equal(x, y)


NEW = [n for n, f in FAMILIES.items() if f.new]


@pytest.mark.parametrize("name", NEW)
def test_new_kinds_train_one_step_identically(name):
    models = []
    for swap in (False, True):
        model = _build(name).train()
        if swap:
            nl.swap_norms(model, warn=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = _run(model, _inputs(name, torch.float32)).loss
        loss.backward()
        opt.step()
        models.append((model, loss.detach()))
    (ref, ref_loss), (model, loss) = models
    assert torch.equal(loss, ref_loss)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.interpreter
@pytest.mark.parametrize("name", NEW + ["qwen3", "stablelm", "convnextv2"])
def test_family_through_the_kernels_agrees_to_rounding(name, kernels_on_cpu, monkeypatch):
    original = _build(name).eval()
    model = copy.deepcopy(original)
    exact = copy.deepcopy(original).double()
    nl.swap_norms(model, warn=False)
    kernels_on_cpu()
    calls = []
    fused = ops.dispatch.fused
    monkeypatch.setattr(ops.dispatch, "fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
    inputs = _inputs(name, torch.float32)
    with torch.no_grad():
        ours, theirs = _first(_run(model, inputs)), _first(_run(original, inputs))
        assert calls  # the kernels ran
        try:
            ref = _first(_run(exact, {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}))
        except RuntimeError:  # e.g. gpt-oss's grouped matmul has no float64 kernel: compare with the original
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
            return
    assert_no_worse(ours, theirs, ref, torch.float32, f"{name} output")
