"""MultiHeadAttention and TransformerBlock against torch."""

import math

import pytest
import torch
import torch.nn.functional as TF

import normlib as nl


def _torch_mha_like(ours: nl.MultiHeadAttention) -> torch.nn.MultiheadAttention:
    ref = torch.nn.MultiheadAttention(ours.d_model, ours.n_head, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
        ref.out_proj.weight.copy_(ours.w_o.weight)
        ref.out_proj.bias.copy_(ours.w_o.bias)
    return ref


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,T,S,d,h", [(2, 5, 5, 16, 4), (3, 7, 7, 24, 3), (1, 1, 1, 8, 8), (2, 4, 9, 12, 2)])
def test_matches_torch_multihead_attention(B, T, S, d, h, causal):
    if causal and T != S:
        pytest.skip("nn.MultiheadAttention's causal mask is for square self-attention")
    ours = nl.MultiHeadAttention(d, h)
    ref = _torch_mha_like(ours)
    q, k, v = torch.randn(B, T, d), torch.randn(B, S, d), torch.randn(B, S, d)
    mask = torch.triu(torch.ones(T, S, dtype=torch.bool), 1) if causal else None
    expect, _ = ref(q, k, v, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(ours(q, k, v, causal=causal), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_scaled_dot_product_attention(causal):
    B, T, S, d, h = 2, 6, 6 if causal else 9, 20, 5
    ours = nl.MultiHeadAttention(d, h)
    q, k, v = torch.randn(B, T, d), torch.randn(B, S, d), torch.randn(B, S, d)

    def split(t, w):
        return w(t).view(B, t.shape[1], h, d // h).transpose(1, 2)

    heads = TF.scaled_dot_product_attention(split(q, ours.w_q), split(k, ours.w_k), split(v, ours.w_v), is_causal=causal)
    expect = ours.w_o(heads.transpose(1, 2).reshape(B, T, d))
    torch.testing.assert_close(ours(q, k, v, causal=causal), expect, rtol=1e-5, atol=1e-5)


def test_gradients_match_torch_and_gradcheck():
    ours = nl.MultiHeadAttention(8, 2).double()
    ref = _torch_mha_like(ours.float()).double()
    ours = ours.double()
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
    ours(x, x, x, causal=True).sum().backward()
    ref(x2, x2, x2, attn_mask=mask, need_weights=False)[0].sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    small = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ours(t, t, t, causal=True), (small,))


def test_causal_mask_blocks_the_future_exactly():
    attn = nl.MultiHeadAttention(8, 2)
    x = torch.randn(1, 5, 8)
    y = attn(x, x, x, causal=True)
    x2 = x.clone()
    x2[:, 3:] += 100.0  # change only the future of positions 0..2
    torch.testing.assert_close(attn(x2, x2, x2, causal=True)[:, :3], y[:, :3])


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_block_formulas(norm_first, norm):
    block = nl.TransformerBlock(16, 4, norm_first=norm_first, norm=norm).eval()
    x = torch.randn(3, 5, 16)
    Norm = nl.LayerNorm if norm == "layer" else nl.RMSNorm
    assert isinstance(block.norm1, Norm) and isinstance(block.norm2, Norm)
    sa = lambda t: block.attn(t, t, t)  # noqa: E731
    if norm_first:
        h = x + sa(block.norm1(x))
        expect = h + block.ff(block.norm2(h))
    else:
        h = block.norm1(x + sa(x))
        expect = block.norm2(h + block.ff(h))
    torch.testing.assert_close(block(x), expect)


def test_transformer_block_matches_torch_encoder_layer():
    for norm_first in (True, False):
        ours = nl.TransformerBlock(16, 4, d_ff=24, norm_first=norm_first).eval()
        ref = torch.nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first).eval()
        with torch.no_grad():
            ref.self_attn.in_proj_weight.copy_(torch.cat([ours.attn.w_q.weight, ours.attn.w_k.weight, ours.attn.w_v.weight]))
            ref.self_attn.in_proj_bias.copy_(torch.cat([ours.attn.w_q.bias, ours.attn.w_k.bias, ours.attn.w_v.bias]))
            ref.self_attn.out_proj.load_state_dict(ours.attn.w_o.state_dict())
            ref.linear1.load_state_dict(ours.ff[0].state_dict())
            ref.linear2.load_state_dict(ours.ff[2].state_dict())
            ref.norm1.load_state_dict(ours.norm1.state_dict())
            ref.norm2.load_state_dict(ours.norm2.state_dict())
        x = torch.randn(2, 6, 16)
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_impl_computes_the_same_attention(causal):
    torch.manual_seed(11)
    math_attn = nl.MultiHeadAttention(32, 4)
    sdpa_attn = nl.MultiHeadAttention(32, 4, impl="sdpa")
    sdpa_attn.load_state_dict(math_attn.state_dict())
    q, kv = torch.randn(2, 7, 32, requires_grad=True), torch.randn(2, 7, 32)
    a = math_attn(q, kv, kv, causal=causal)
    b = sdpa_attn(q, kv, kv, causal=causal)
    torch.testing.assert_close(a, b)
    (ga,) = torch.autograd.grad(a.sum(), q)
    (gb,) = torch.autograd.grad(b.sum(), q)
    torch.testing.assert_close(ga, gb)
    with pytest.raises(ValueError, match='impl must be "math" or "sdpa"'):
        nl.MultiHeadAttention(32, 4, impl="flash")
