"""MultiHeadAttention and TransformerBlock against torch."""


import pytest
import torch
import torch.nn.functional as TF

import normlib as nl
from normlib.testing.tolerance import close


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
    torch.testing.assert_close(ours(q, k, v, causal=causal), expect, **close(torch.float32))


@pytest.mark.parametrize("causal", [False, True])
def test_matches_scaled_dot_product_attention(causal):
    B, T, S, d, h = 2, 6, 6 if causal else 9, 20, 5
    ours = nl.MultiHeadAttention(d, h)
    q, k, v = torch.randn(B, T, d), torch.randn(B, S, d), torch.randn(B, S, d)

    def split(t, w):
        return w(t).view(B, t.shape[1], h, d // h).transpose(1, 2)

    heads = TF.scaled_dot_product_attention(split(q, ours.w_q), split(k, ours.w_k), split(v, ours.w_v), is_causal=causal)
    expect = ours.w_o(heads.transpose(1, 2).reshape(B, T, d))
    torch.testing.assert_close(ours(q, k, v, causal=causal), expect, **close(torch.float32))


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
        torch.testing.assert_close(ours(x), ref(x), **close(torch.float32))


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


# ---------------------------------------------------------------------------
# key_padding_mask and attn_mask, as in torch.nn.MultiheadAttention

IMPLS = ["math", "sdpa"]


def _pair(d, h, impl, seed=0):
    """A normlib attention with the given impl and an nn.MultiheadAttention holding its weights."""
    torch.manual_seed(seed)
    ours = nl.MultiHeadAttention(d, h, impl=impl)
    return ours, _torch_mha_like(ours)


def _masks(kind, B, T, S, h, gen):
    """Masks of one kind; key 0 is never masked, so every query keeps a key."""
    kpm = torch.rand(B, S, generator=gen) < 0.4
    kpm[:, 0] = False
    am2 = torch.rand(T, S, generator=gen) < 0.4
    am2[:, 0] = False
    am3 = torch.rand(B * h, T, S, generator=gen) < 0.4
    am3[..., 0] = False

    def additive(m):  # a float mask: -inf where masked, plus finite biases elsewhere
        bias = torch.randn(m.shape, generator=gen)
        return bias.masked_fill(m, float("-inf"))

    return {
        "kpm-bool": dict(key_padding_mask=kpm),
        "kpm-float": dict(key_padding_mask=additive(kpm)),
        "attn2d-bool": dict(attn_mask=am2),
        "attn2d-float": dict(attn_mask=additive(am2)),
        "attn3d-bool": dict(attn_mask=am3),
        "attn3d-float": dict(attn_mask=additive(am3)),
        "both-bool": dict(key_padding_mask=kpm, attn_mask=am3),
        "both-float": dict(key_padding_mask=additive(kpm), attn_mask=additive(am2)),
        "finite-float": dict(attn_mask=torch.randn(T, S, generator=gen) * 3),
    }[kind]


MASK_KINDS = ["kpm-bool", "kpm-float", "attn2d-bool", "attn2d-float", "attn3d-bool",
              "attn3d-float", "both-bool", "both-float", "finite-float"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("B,T,S,d,h", [(2, 5, 7, 12, 3), (3, 4, 4, 16, 4)])
def test_masks_match_torch_multihead_attention(B, T, S, d, h, kind, impl):
    ours, ref = _pair(d, h, impl)
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(B, T, d), torch.randn(B, S, d), torch.randn(B, S, d)
    masks = _masks(kind, B, T, S, h, gen)
    for need_weights in (False, True):  # torch's SDPA path and its step-by-step path
        expect, _ = ref(q, k, v, need_weights=need_weights, **masks)
        torch.testing.assert_close(ours(q, k, v, **masks), expect, **close(torch.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_gradients_match_torch(impl):
    B, T, S, d, h = 2, 4, 6, 12, 3
    ours, ref = _pair(d, h, impl)
    ours, ref = ours.double(), ref.double()
    gen = torch.Generator().manual_seed(2)
    masks = {n: m.double() if m.is_floating_point() else m for n, m in _masks("both-float", B, T, S, h, gen).items()}
    q = torch.randn(B, T, d, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, S, d, dtype=torch.float64, requires_grad=True)
    y = ours(q, kv, kv, **masks)
    y_ref, _ = ref(q, kv, kv, need_weights=False, **masks)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [q, kv, *ours.parameters()], g)
    grads_ref = torch.autograd.grad(y_ref, [q, kv, ref.in_proj_weight, ref.in_proj_bias, ref.out_proj.weight, ref.out_proj.bias], g)
    torch.testing.assert_close(grads[0], grads_ref[0])
    torch.testing.assert_close(grads[1], grads_ref[1])
    w_qkv = torch.cat([grads[2], grads[4], grads[6]])  # w_q, w_k, w_v weights
    b_qkv = torch.cat([grads[3], grads[5], grads[7]])
    torch.testing.assert_close(w_qkv, grads_ref[2])
    torch.testing.assert_close(b_qkv, grads_ref[3])
    torch.testing.assert_close(grads[8], grads_ref[4])
    torch.testing.assert_close(grads[9], grads_ref[5])


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_combines_with_the_other_masks(impl):
    B, T, S, d, h = 2, 5, 7, 12, 3
    ours, ref = _pair(d, h, impl)
    gen = torch.Generator().manual_seed(3)
    q, kv = torch.randn(B, T, d), torch.randn(B, S, d)
    masks = _masks("both-bool", B, T, S, h, gen)
    future = torch.ones(T, S, dtype=torch.bool).tril().logical_not()  # (T, S), True = may not attend
    combined = masks["attn_mask"] | future
    expect, _ = ref(q, kv, kv, key_padding_mask=masks["key_padding_mask"], attn_mask=combined, need_weights=False)
    torch.testing.assert_close(ours(q, kv, kv, causal=True, **masks), expect, **close(torch.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_keys_have_no_influence_at_all(impl):
    torch.manual_seed(4)
    attn = nl.MultiHeadAttention(16, 4, impl=impl)
    x = torch.randn(2, 6, 16)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    y = attn(x, x, x, key_padding_mask=pad)
    x2 = x.clone()
    x2[1, 4:] = 1e4 * torch.randn(2, 16)  # garbage in the padding
    y2 = attn(x2, x2, x2, key_padding_mask=pad)
    assert torch.equal(y[:, :4], y2[:, :4]) and torch.equal(y[0], y2[0])


def _fully_masked_cases(B, T, S, h):
    """Masks that leave some queries with no key at all, and the (b, t) rows they empty."""
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True  # a sequence that is all padding: every query of batch 1
    am = torch.zeros(T, S, dtype=torch.bool)
    am[2] = True  # query 2 may attend to nothing, in every sequence
    am3 = torch.zeros(B * h, T, S, dtype=torch.bool)
    am3[0 * h:1 * h, 1] = True  # batch 0, query 1, in all heads
    am3[1 * h + 0, 3] = True  # batch 1, query 3, in head 0 only: not empty
    left_pad = torch.zeros(B, S, dtype=torch.bool)
    left_pad[0, :2] = True  # left padding + causal: queries 0 and 1 of batch 0 see only padding
    return [
        (dict(key_padding_mask=kpm), False, [(1, t) for t in range(T)]),
        (dict(attn_mask=am), False, [(b, 2) for b in range(B)]),
        (dict(attn_mask=am.float().masked_fill(am, float("-inf"))), False, [(b, 2) for b in range(B)]),
        (dict(attn_mask=am3), False, [(0, 1)]),
        (dict(key_padding_mask=left_pad), True, [(0, 0), (0, 1)]),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(5))
def test_fully_masked_rows_attend_to_nothing(impl, case):
    B, T, S, d, h = 2, 4, 4, 12, 3
    ours, ref = _pair(d, h, impl)
    masks, causal, empty = _fully_masked_cases(B, T, S, h)[case]
    q = torch.randn(B, T, d, requires_grad=True)
    kv = torch.randn(B, S, d, requires_grad=True)
    y = ours(q, kv, kv, causal=causal, **masks)
    assert torch.isfinite(y).all()
    for b, t in empty:  # heads are zero: the output is w_o's bias
        torch.testing.assert_close(y[b, t], ours.w_o.bias.detach().expand(d) + 0 * y[b, t])
    # the other rows are torch's (whose answer on the empty rows depends on its
    # release: the bias in recent ones, NaN in older ones, so those are checked above)
    attn_mask = masks.get("attn_mask")
    if causal:
        attn_mask = torch.ones(T, S, dtype=torch.bool).tril().logical_not()
    expect, _ = ref(q, kv, kv, key_padding_mask=masks.get("key_padding_mask"), attn_mask=attn_mask, need_weights=False)
    answered = torch.ones(B, T, dtype=torch.bool)
    for b, t in empty:
        answered[b, t] = False
    torch.testing.assert_close(y[answered], expect[answered], **close(torch.float32))
    # no NaN in any gradient, and nothing flows back from an empty row
    g = torch.zeros_like(y)
    for b, t in empty:
        g[b, t] = 1.0
    gq, gkv = torch.autograd.grad(y, [q, kv], g)
    assert torch.equal(gq, torch.zeros_like(gq)) and torch.equal(gkv, torch.zeros_like(gkv))
    gq, gkv = torch.autograd.grad(ours(q, kv, kv, causal=causal, **masks).square().sum(), [q, kv])
    assert torch.isfinite(gq).all() and torch.isfinite(gkv).all()


def test_fully_masked_rows_in_torch_are_as_the_docstring_says():
    """MultiHeadAttention's docstring describes torch 2.13; if this fails, update it."""
    torch.manual_seed(5)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        ref.out_proj.bias.fill_(0.5)
    x = torch.randn(2, 3, 8)
    pad = torch.tensor([[False] * 3, [True] * 3])
    sdpa_path, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    assert torch.equal(sdpa_path[1], torch.full((3, 8), 0.5))
    step_path, _ = ref(x, x, x, key_padding_mask=pad, need_weights=True)
    assert step_path[1].isnan().all() and torch.isfinite(step_path[0]).all()
    ref.eval()
    with torch.no_grad():  # the inference fast path
        fast, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    assert fast[1].isnan().all()
    q = torch.randn(1, 1, 2, 4)
    heads = TF.scaled_dot_product_attention(q, q, q, attn_mask=torch.tensor([[True, False], [False, False]]))
    assert torch.equal(heads[0, 0, 1], torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_math_and_sdpa_agree_on_masks(dtype):
    B, T, S, d, h = 3, 5, 6, 16, 4
    torch.manual_seed(6)
    math_attn = nl.MultiHeadAttention(d, h).to(dtype)
    sdpa_attn = nl.MultiHeadAttention(d, h, impl="sdpa").to(dtype)
    sdpa_attn.load_state_dict(math_attn.state_dict())
    gen = torch.Generator().manual_seed(7)
    q, kv = torch.randn(B, T, d, dtype=dtype), torch.randn(B, S, d, dtype=dtype)
    kpm = torch.rand(B, S, generator=gen) < 0.5
    kpm[2] = True  # one sequence all padding
    am = torch.randn(B * h, T, S, generator=gen).to(dtype)
    tol = {} if dtype != torch.bfloat16 else dict(rtol=2e-2, atol=2e-2)
    for causal in (False, True):
        torch.testing.assert_close(
            math_attn(q, kv, kv, causal=causal, key_padding_mask=kpm, attn_mask=am),
            sdpa_attn(q, kv, kv, causal=causal, key_padding_mask=kpm, attn_mask=am),
            **tol,
        )


@pytest.mark.parametrize("impl", IMPLS)
def test_gradcheck_with_masks_and_an_empty_row(impl):
    attn = nl.MultiHeadAttention(8, 2, impl=impl).double()
    kpm = torch.tensor([[False, False, True], [True, True, True]])
    am = torch.tensor([[0.0, -1.5, 0.0], [float("-inf"), 0.3, 0.0]], dtype=torch.float64)
    q = torch.randn(2, 2, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: attn(a, b, b, key_padding_mask=kpm, attn_mask=am), (q, kv))


def test_mask_errors_name_the_argument():
    attn = nl.MultiHeadAttention(8, 2)
    q, kv = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, S\) = \[2, 5\] \(got \[2, 3\]\)"):
        attn(q, kv, kv, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(T, S\) or \(B \* n_head, T, S\) = \[3, 5\] or \[4, 3, 5\] \(got \[5, 3\]\)"):
        attn(q, kv, kv, attn_mask=torch.zeros(5, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must have shape .* \(got \[2, 3, 5\]\)"):
        attn(q, kv, kv, attn_mask=torch.zeros(2, 3, 5))  # one mask per sequence, not per head
    with pytest.raises(TypeError, match=r"key_padding_mask must be a bool tensor .* \(got dtype torch.int64\)"):
        attn(q, kv, kv, key_padding_mask=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match=r"attn_mask must be a bool tensor .* \(got dtype torch.uint8\); .* attn_mask.bool\(\)"):
        attn(q, kv, kv, attn_mask=torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"attn_mask must be a torch.Tensor \(got list\)"):
        attn(q, kv, kv, attn_mask=[[True] * 5] * 3)
    with pytest.raises(ValueError, match=r"key_padding_mask must be on the device of q \(cpu\), got meta"):
        attn(q, kv, kv, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match=r"causal must be a bool \(got Tensor\); pass masks by keyword"):
        attn(q, kv, kv, torch.zeros(2, 5, dtype=torch.bool))  # torch's positional key_padding_mask
