"""The decoder-layer kernels (RMSNorm with an optional residual add, RoPE, RoPE with the KV
append, SiLU * up; Triton, interpreted on CPU) equal their torch paths, which are Llama's
arithmetic, on many shapes and adversarial values; all compile for sm_90.

RMSNorm may differ from torch by the order of its fp32 sum of squares, which can move the
normalized row's rounding by one unit; the product with the weight is rounded again, so the
bound is two units in the last place of the output dtype (fp32: a relative 1e-5, its sum
and rsqrt). RoPE rounds exactly as torch does: equal bit for bit, except that Triton's
interpreter converts fp32 to bf16 by truncation where the GPU rounds to nearest even (seen
with triton 3.6), so interpreted bf16 may differ by a unit per rounding. On a GPU the tests
run the compiled kernels on CUDA tensors and require bf16 equality too.
"""


import pytest
import torch

from agspec_gpu.kernels.rms_norm import MAX_BLOCK_N, _rms_norm_kernel, rms_norm, rms_norm_torch
from agspec_gpu.kernels.rope import _rope_kernel, rope, rope_torch
from agspec_gpu.kernels.rope_append import _rope_append_kernel, rope_append, rope_append_torch
from agspec_gpu.kernels.silu_mul import _silu_mul_kernel, silu_mul, silu_mul_torch
from kernel_compile import NoLaunch, compile_all_for_sm90

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of ``x`` (in x's dtype), as fp32."""
    bits = torch.finfo(x.dtype).eps
    return (x.float().abs() * bits).clamp(min=torch.finfo(x.dtype).tiny)


def values(kind: str, shape, dtype, g):
    if kind == "random":
        x = torch.randn(shape, generator=g)
    elif kind == "zeros":  # rms 0: rsqrt(eps)
        x = torch.zeros(shape)
    elif kind == "large":  # squares overflow fp16, not the fp32 sum
        x = torch.randn(shape, generator=g) * 200
    elif kind == "repeated":  # one value in every column
        x = torch.full(shape, 0.37)
    else:  # periodic rows with a spike
        x = torch.sin(torch.arange(shape[-1]).float() * 0.5).expand(shape).clone()
        x[..., 0] = 60.0
    return x.to(dtype)


# "large" inputs overflow in the interpreter's numpy (exp, fp16 casts): by design
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N", [(0, 64), (1, 1), (1, 64), (3, 96), (17, 128), (5, 4096)])
@pytest.mark.parametrize("kind", ["random", "zeros", "large", "repeated", "periodic"])
def test_rms_norm_matches_torch(dtype, M, N, kind):
    g = torch.Generator().manual_seed(M * 1000 + N)
    x = values(kind, (M, N), dtype, g).to(DEV)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).to(DEV)
    want = rms_norm_torch(x, w, 1e-5)
    got = rms_norm(x, w, 1e-5, use_triton=True)
    assert got.dtype == dtype and got.shape == (M, N) and got.is_contiguous()
    diff = (got.float() - want.float()).abs()
    units = 2 if dtype != torch.float32 else 1e-5 / torch.finfo(dtype).eps
    assert (diff <= units * ulp(want) + 1e-30).all(), (diff.max(), kind)
    assert not got.isnan().any()


# "large" inputs overflow in the interpreter's numpy (exp, fp16 casts): by design
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N", [(0, 64), (1, 1), (3, 96), (17, 4096)])
@pytest.mark.parametrize("kind", ["random", "large", "periodic"])
def test_rms_norm_with_residual_matches_torch(dtype, M, N, kind):
    """The fused residual add: the sum equals torch's add exactly, the norm within bounds."""
    g = torch.Generator().manual_seed(M * 7 + N)
    x = values(kind, (M, N), dtype, g).to(DEV)
    res = values("random", (M, N), dtype, g).to(DEV)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).to(DEV)
    want, want_sum = rms_norm_torch(x, w, 1e-5, residual=res)
    got, got_sum = rms_norm(x, w, 1e-5, residual=res, use_triton=True)
    if dtype == torch.bfloat16 and DEV.type == "cpu":  # interpreter: truncating bf16 cast
        assert ((got_sum.float() - want_sum.float()).abs() <= ulp(want_sum) + 1e-30).all()
    else:
        assert torch.equal(got_sum, want_sum)
    units = 3 if dtype != torch.float32 else 1e-5 / torch.finfo(dtype).eps
    assert ((got.float() - want.float()).abs() <= units * ulp(want) + 1e-30).all()
    with pytest.raises(ValueError, match="residual: expected shape"):
        rms_norm(x, w, 1e-5, residual=res[:, :N - 1] if N > 1 else res[:0])


# "large" inputs overflow in the interpreter's numpy (exp, fp16 casts): by design
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,I", [(0, 8), (1, 1), (3, 100), (5, 1024), (2, 3000)])
@pytest.mark.parametrize("kind", ["random", "large", "zeros"])
def test_silu_mul_matches_torch(dtype, M, I, kind):
    g = torch.Generator().manual_seed(M * 13 + I)
    base = values(kind, (M, 2 * I + 6), dtype, g).to(DEV)
    gate_up = base[:, 3:3 + 2 * I]  # strided rows: a view into a wider buffer
    want = silu_mul_torch(gate_up)
    got = silu_mul(gate_up, use_triton=True)
    assert got.shape == (M, I) and got.dtype == dtype and got.is_contiguous()
    # the exponential may round differently; the interpreter also truncates to bf16
    units = 2 if dtype != torch.float32 else 1e-5 / torch.finfo(dtype).eps
    diff = torch.where(got == want, 0.0, (got.float() - want.float()).abs())  # equal infs
    assert (diff <= units * ulp(want) + 1e-30).all()
    assert torch.equal(silu_mul(gate_up.cpu()), silu_mul_torch(gate_up.cpu()))  # CPU: torch
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.zeros(2, 3, device=DEV))
    with pytest.raises(ValueError, match="gate_up: expected a floating dtype"):
        silu_mul(torch.zeros(2, 4, dtype=torch.int64, device=DEV))


def test_rms_norm_strided_rows_and_default_path():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 80, generator=g).to(torch.bfloat16).to(DEV)
    x = base[::2, 8:72]  # rows at stride 160, 64 contiguous columns
    w = torch.ones(64, dtype=torch.bfloat16, device=DEV)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, use_triton=True),
                               rms_norm_torch(x, w, 1e-6), atol=0, rtol=2 ** -6)
    xc, wc = x.cpu(), w.cpu()
    assert torch.equal(rms_norm(xc, wc, 1e-6), rms_norm_torch(xc, wc, 1e-6))  # CPU: torch


def test_rms_norm_rejects_bad_inputs():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="x: expected"):
        rms_norm(torch.zeros(8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="x: expected a floating dtype"):
        rms_norm(x.long(), torch.ones(8).long(), 1e-5)
    with pytest.raises(ValueError, match="weight: expected shape"):
        rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="weight: expected"):
        rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.zeros(8, 2, device=DEV).t(), torch.ones(8, device=DEV), 1e-5,
                 use_triton=True)
    with pytest.raises(ValueError, match="^weight: .* on meta"):
        rms_norm(x, torch.ones(8, device="meta"), 1e-5, use_triton=True)
    with pytest.raises(ValueError, match="^residual: .* on meta"):
        rms_norm(x, torch.ones(8), 1e-5, residual=x.to("meta"), use_triton=True)


def _qkv_views(Q, H, Hkv, D, dtype, g, kind):
    """q, k as strided views of one fused projection, like the runner's."""
    qkv = values(kind, (Q, (H + 2 * Hkv) * D), dtype, g)
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(Q, H, D), k.view(Q, Hkv, D)


def _tables(Q, D, dtype, g):
    pos = torch.randint(0, 100_000, (Q,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rope_truncating_bf16(x, cos, sin):
    """The kernel's roundings with the interpreter's fp32 -> bf16 cast (truncation)."""
    def t(v):  # fp32 -> bf16 by dropping the low 16 bits, back to fp32
        return (v.float().contiguous().view(torch.int32) & -65536).view(torch.float32)

    x1, x2 = (h.float() for h in x.chunk(2, dim=-1))
    c, s_ = cos.float()[:, None, :], sin.float()[:, None, :]
    half = x.shape[-1] // 2
    lo = t(t(x1 * c[..., :half]) + t(-x2 * s_[..., :half]))
    hi = t(t(x2 * c[..., half:]) + t(x1 * s_[..., half:]))
    return torch.cat((lo, hi), dim=-1).to(torch.bfloat16)


def rope_cases(test):
    """The RoPE kernels' cases: every dtype, shapes from empty to GQA at head_dim 128, and
    adversarial values ("large" overflows the interpreter's numpy fp16 casts: by design)."""
    marks = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
             pytest.mark.parametrize("dtype", DTYPES),
             pytest.mark.parametrize("Q,H,Hkv,D", [(0, 4, 2, 8), (1, 1, 1, 2), (1, 4, 2, 64),
                                                   (7, 4, 1, 16), (33, 8, 2, 128)]),
             pytest.mark.parametrize("kind", ["random", "large", "repeated", "periodic"])]
    for mark in marks:
        test = mark(test)
    return test


@rope_cases
def test_rope_equals_torch(dtype, Q, H, Hkv, D, kind):
    g = torch.Generator().manual_seed(Q * 100 + D)
    q, k = (t.to(DEV) for t in _qkv_views(Q, H, Hkv, D, dtype, g, kind))
    cos, sin = (t.to(DEV) for t in _tables(Q, D, dtype, g))
    for x in (q, k):
        got = rope(x, cos, sin, use_triton=True)
        want = rope_torch(x, cos, sin)
        assert got.is_contiguous() and got.shape == x.shape and got.dtype == dtype
        if dtype == torch.bfloat16 and DEV.type == "cpu":  # interpreter: truncating casts
            want = _rope_truncating_bf16(x, cos, sin)
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_rope_is_llamas_rotation():
    """Position 0 leaves a head unchanged; the torch path is transformers' apply_rotary."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    q, k = (t.to(DEV) for t in _qkv_views(5, 4, 2, 16, torch.float32, g, "random"))
    cos, sin = (t.to(DEV) for t in _tables(5, 16, torch.float32, g))
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                  cos[None], sin[None])
    torch.testing.assert_close(rope(q, cos, sin, use_triton=True), hq[0].transpose(0, 1))
    torch.testing.assert_close(rope(k, cos, sin, use_triton=True), hk[0].transpose(0, 1))
    ones, zeros = torch.ones(5, 16, device=DEV), torch.zeros(5, 16, device=DEV)
    assert torch.equal(rope(q, ones, zeros, use_triton=True), q.contiguous())
    del transformers


def test_rope_rejects_bad_inputs_and_falls_back_for_odd_halves():
    x = torch.zeros(3, 2, 8)
    c = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="D even"):
        rope(torch.zeros(3, 2, 7), torch.zeros(3, 7), torch.zeros(3, 7))
    with pytest.raises(ValueError, match="cos: expected shape"):
        rope(x, torch.zeros(2, 8), c)
    with pytest.raises(ValueError, match="sin: expected"):
        rope(x, c, torch.zeros(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="^cos: .* on meta"):
        rope(x, c.to("meta"), c, use_triton=True)
    y = torch.randn(2, 3, 12, device=DEV)  # D / 2 = 6, not a power of two: the torch path
    cy, sy = torch.randn(2, 12, device=DEV), torch.randn(2, 12, device=DEV)
    assert torch.equal(rope(y, cy, sy, use_triton=True), rope_torch(y, cy, sy))


def _slots(Q, page_size, g):
    """Distinct slots for the rows of a step, the last two rows (when Q >= 3) padding rows on
    the null page (the last one), as ``PagedKVCache.slots_of`` gives them."""
    num_pages = Q // page_size + 3
    flat = torch.randperm((num_pages - 1) * page_size, generator=g)[:Q]
    page, offset = flat // page_size, flat % page_size
    if Q >= 3:
        page[-2:], offset[-2:] = num_pages - 1, 0
    return num_pages, page, offset


@rope_cases
def test_rope_append_equals_rope_and_indexed_writes(dtype, Q, H, Hkv, D, kind):
    """One kernel: the queries equal ``rope``'s, the cache holds the rotated keys and the
    values at each row's slot exactly as the torch path writes them (the null page, which
    padding rows share, aside), and nothing else of the cache changes."""
    g = torch.Generator().manual_seed(Q * 100 + D + H)
    width = (H + 2 * Hkv) * D
    qkv = values(kind, (Q, width + 8), dtype, g)[:, :width]  # rows strided, as a view may be
    cos, sin = _tables(Q, D, dtype, g)
    num_pages, page, offset = _slots(Q, 4, g)
    page, offset = torch.stack([page, offset], 1).unbind(1)  # strided views, as may come
    cache = torch.randn(num_pages, 2, 4, Hkv, D, generator=g).to(dtype)
    qkv, cos, sin, page, offset, cache = (t.to(DEV) for t in (qkv, cos, sin, page, offset,
                                                                cache))
    got_cache, want_cache = cache.clone(), cache.clone()
    got = rope_append(qkv, cos, sin, page, offset, got_cache, H, Hkv, use_triton=True)
    want = rope_append_torch(qkv, cos, sin, page, offset, want_cache, H, Hkv)
    if dtype == torch.bfloat16 and DEV.type == "cpu":  # interpreter: truncating casts
        want = _rope_truncating_bf16(qkv[:, :H * D].view(Q, H, D), cos, sin)
        want_cache[page, 0, offset] = _rope_truncating_bf16(
            qkv[:, H * D:(H + Hkv) * D].view(Q, Hkv, D), cos, sin)
    assert got.is_contiguous() and got.shape == (Q, H, D) and got.dtype == dtype
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert torch.equal(got_cache[:-1], want_cache[:-1])
    if Q:  # the values went in unrotated
        v = qkv[:, (H + Hkv) * D:].view(Q, Hkv, D)
        real = slice(0, Q - 2) if Q >= 3 else slice(0, Q)
        assert torch.equal(got_cache[page[real], 1, offset[real]], v[real])


def test_rope_append_names_bad_arguments():
    qkv, cos = torch.zeros(3, 4 * 8), torch.zeros(3, 8)
    page = offset = torch.zeros(3, dtype=torch.int64)
    cache = torch.zeros(2, 2, 4, 1, 8)
    with pytest.raises(ValueError, match="qkv"):
        rope_append(torch.zeros(3, 30), cos, cos, page, offset, cache, 2, 1)
    with pytest.raises(ValueError, match="sin"):
        rope_append(qkv, cos, torch.zeros(2, 8), page, offset, cache, 2, 1)
    with pytest.raises(ValueError, match="page"):
        rope_append(qkv, cos, cos, page.int(), offset, cache, 2, 1)
    with pytest.raises(ValueError, match="cache"):
        rope_append(qkv, cos, cos, page, offset, torch.zeros(2, 2, 4, 2, 8), 2, 1)
    with pytest.raises(ValueError, match="num_qo_heads"):
        rope_append(qkv, cos, cos, page, offset, cache, 0, 1)
    with pytest.raises(ValueError, match="^offset: expected torch.int64"):
        rope_append(qkv, cos, cos, page, offset.int(), cache, 2, 1)
    for name, args in (("sin", (qkv, cos, cos.to("meta"), page, offset, cache)),
                       ("page", (qkv, cos, cos, page.to("meta"), offset, cache)),
                       ("offset", (qkv, cos, cos, page, offset.to("meta"), cache)),
                       ("cache", (qkv, cos, cos, page, offset, cache.to("meta")))):
        with pytest.raises(ValueError, match=f"^{name}: .*meta"):
            rope_append(*args, 2, 1, use_triton=True)
    # D / 2 = 3, not a power of two: the torch path, on any request
    q2, c2 = torch.randn(3, 4 * 6), torch.randn(3, 6)
    a, b = torch.zeros(2, 2, 4, 1, 6), torch.zeros(2, 2, 4, 1, 6)
    torch.testing.assert_close(rope_append(q2, c2, c2, page, offset, a, 2, 1, use_triton=True),
                               rope_append_torch(q2, c2, c2, page, offset, b, 2, 1))
    assert torch.equal(a, b)


def test_float64_and_empty_rows_run_the_torch_path():
    """float64 (the kernels compute in float32) and rows of width 0 (no block to launch) run
    the torch path, equal to it exactly, whatever ``use_triton`` says."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 64, generator=g).double(), torch.randn(64, generator=g).double()
    r = torch.randn(3, 64, generator=g).double()
    for got, want in zip(rms_norm(x, w, 1e-6, residual=r, use_triton=True),
                         rms_norm_torch(x, w, 1e-6, r)):
        assert torch.equal(got, want)
    assert torch.equal(rms_norm(x, w, 1e-6, use_triton=True), rms_norm_torch(x, w, 1e-6))
    assert rms_norm(x[:, :0], w[:0], 1e-6, use_triton=True).shape == (3, 0)
    gu = torch.randn(4, 2 * 48, generator=g).double()
    assert torch.equal(silu_mul(gu, use_triton=True), silu_mul_torch(gu))
    q, cs = torch.randn(3, 2, 16, generator=g).double(), torch.randn(3, 16, generator=g).double()
    assert torch.equal(rope(q, cs, cs, use_triton=True), rope_torch(q, cs, cs))
    assert rope(q[..., :0], cs[:, :0], cs[:, :0], use_triton=True).shape == (3, 2, 0)
    page = offset = torch.arange(3, dtype=torch.int64)
    qkv = torch.randn(3, 4 * 16, generator=g).double()
    a, b = torch.zeros(4, 2, 4, 1, 16).double(), torch.zeros(4, 2, 4, 1, 16).double()
    assert torch.equal(rope_append(qkv, cs, cs, page, offset, a, 2, 1, use_triton=True),
                       rope_append_torch(qkv, cs, cs, page, offset, b, 2, 1))
    assert torch.equal(a, b)


def test_kernels_compile_for_sm90():
    norm_sig = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                    sum_ptr="*bf16", stride_x="i64", N="i32", eps="fp32", BLOCK_N="constexpr",
                    HAS_RESIDUAL="constexpr")
    compile_all_for_sm90([
        (_rms_norm_kernel, norm_sig, dict(BLOCK_N=4096, HAS_RESIDUAL=False)),
        (_rms_norm_kernel, norm_sig, dict(BLOCK_N=4096, HAS_RESIDUAL=True)),
        (_rms_norm_kernel, norm_sig, dict(BLOCK_N=MAX_BLOCK_N, HAS_RESIDUAL=True)),
        (_rms_norm_kernel, {**norm_sig, **{k: "*fp32" for k in ("x_ptr", "res_ptr", "w_ptr",
                                                                "out_ptr", "sum_ptr")}},
         dict(BLOCK_N=4096, HAS_RESIDUAL=True)),
        (_rms_norm_kernel, {**norm_sig, **{k: "*fp16" for k in ("x_ptr", "res_ptr", "w_ptr",
                                                                "out_ptr", "sum_ptr")}},
         dict(BLOCK_N=4096, HAS_RESIDUAL=True)),
        *((_silu_mul_kernel, dict(gate_up_ptr=ptr, out_ptr=ptr, stride_m="i64", I="i32",
                                  BLOCK_I="constexpr"), dict(BLOCK_I=1024))
          for ptr in ("*bf16", "*fp16", "*fp32")),
        (_rope_kernel, dict(x_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", out_ptr="*bf16",
                            stride_xq="i64", stride_xh="i64", H="i32", HALF="constexpr"),
         dict(HALF=64)),
        (_rope_append_kernel, dict(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16",
                                   page_ptr="*i64", offset_ptr="*i64", q_out_ptr="*bf16",
                                   cache_ptr="*bf16", stride_qkv="i64", stride_page="i64",
                                   stride_kv="i64", stride_slot="i64", H="i32", Hkv="i32",
                                   num_pages="i32", page_size="i32", HALF="constexpr"),
         dict(HALF=64)),
    ])


class _LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's keyword options, then launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.options = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.options.append({k: v for k, v in kwargs.items() if k.islower()})
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_rope_kernels_round_like_torch_in_float32_on_the_gpu(monkeypatch):
    """In fp32 the rotation's casts are no-ops, so the compiler would contract a product into
    the sum (one rounding where torch's ops round twice: a quarter of the elements differ
    on a GPU, which the interpreter never shows); the launchers turn fusion off and the
    sm_90 PTX has no fused multiply-add."""
    rope_sig = dict(x_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*fp32",
                    stride_xq="i64", stride_xh="i64", H="i32", HALF="constexpr")
    append_sig = dict(qkv_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", page_ptr="*i64",
                      offset_ptr="*i64", q_out_ptr="*fp32", cache_ptr="*fp32",
                      stride_qkv="i64", stride_page="i64", stride_kv="i64", stride_slot="i64",
                      H="i32", Hkv="i32", num_pages="i32", page_size="i32", HALF="constexpr")
    off = {"enable_fp_fusion": False}
    fused, rope32, append32 = compile_all_for_sm90([
        (_rope_kernel, rope_sig, dict(HALF=64), {}), (_rope_kernel, rope_sig, dict(HALF=64), off),
        (_rope_append_kernel, append_sig, dict(HALF=64), off)])
    assert fused["fma_f32"] > 0  # the check sees a contraction where one is allowed
    assert rope32["fma_f32"] == 0 and append32["fma_f32"] == 0
    # the launchers pass the option on every launch
    import agspec_gpu.kernels.rope as rope_mod
    import agspec_gpu.kernels.rope_append as append_mod

    rec = {m: _LaunchRecorder(k) for m, k in ((rope_mod, _rope_kernel),
                                              (append_mod, _rope_append_kernel))}
    monkeypatch.setattr(rope_mod, "_rope_kernel", rec[rope_mod])
    monkeypatch.setattr(append_mod, "_rope_append_kernel", rec[append_mod])
    Q, H, Hkv, D = 3, 2, 1, 8
    cos, sin = torch.randn(Q, D, device=DEV), torch.randn(Q, D, device=DEV)
    rope(torch.randn(Q, H, D, device=DEV), cos, sin, use_triton=True)
    page = torch.tensor([0, 0, 1], device=DEV)
    offset = torch.tensor([0, 1, 0], device=DEV)
    rope_append(torch.randn(Q, (H + 2 * Hkv) * D, device=DEV), cos, sin, page, offset,
                torch.zeros(2, 2, 4, Hkv, D, device=DEV), H, Hkv, use_triton=True)
    for r in rec.values():
        assert r.options == [{"enable_fp_fusion": False}]


def test_both_paths_name_what_only_the_kernels_refused():
    """The kernels' contracts on either path: a last dimension that is not contiguous, an
    integer ``x`` or ``qkv``, head counts that are not ints (a CPU caller once got a strided
    or an int result where a GPU raised); the torch paths' outputs are contiguous."""
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="x: the last dimension"):
            rms_norm(torch.randn(8, 3).t(), torch.ones(8), 1e-6, use_triton=use_triton)
        with pytest.raises(ValueError, match="gate_up: the last dimension"):
            silu_mul(torch.randn(8, 4).t(), use_triton=use_triton)
        x = torch.randn(2, 3, 4)
        with pytest.raises(ValueError, match="x: the last dimension"):
            rope(x.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :4],
                 torch.ones(2, 4), torch.zeros(2, 4), use_triton=use_triton)
        with pytest.raises(ValueError, match="x: expected a floating dtype"):
            rope(x.long(), torch.ones(2, 4).long(), torch.ones(2, 4).long(),
                 use_triton=use_triton)
        qkv, tab = torch.randn(2, 3 * 4), torch.ones(2, 4)
        cache, page, off = torch.zeros(2, 2, 4, 1, 4), torch.zeros(2).long(), torch.arange(2)
        with pytest.raises(ValueError, match="qkv: expected a floating dtype"):
            rope_append(qkv.long(), tab.long(), tab.long(), page, off, cache.long(), 1, 1,
                        use_triton=use_triton)
        with pytest.raises(ValueError, match="num_qo_heads"):
            rope_append(qkv, tab, tab, page, off, cache, 1.0, 1, use_triton=use_triton)
    assert rms_norm_torch(torch.randn(3, 8)[:, :5], torch.ones(5), 1e-6).is_contiguous()
    out, total = rms_norm_torch(torch.randn(3, 8)[:, :5], torch.ones(5), 1e-6,
                                torch.randn(3, 5))
    assert out.is_contiguous() and total.is_contiguous()
    assert silu_mul_torch(torch.randn(3, 8)[:, 2:6]).is_contiguous()


def test_rope_append_writes_no_slot_outside_the_cache():
    """A row whose page or offset is outside the cache (a caller's error) is not written by
    the kernel (it wrote before or past the cache); the other rows' keys and values land."""
    Q, H, Hkv, D = 3, 2, 1, 4
    qkv = torch.randn(Q, (H + 2 * Hkv) * D, device=DEV)
    cos, sin = torch.ones(Q, D, device=DEV), torch.zeros(Q, D, device=DEV)
    store = torch.zeros(4, 2, 4, Hkv, D, device=DEV)
    cache = store[1:3]  # two pages with a guard page on either side
    page = torch.tensor([0, 2, -1], device=DEV)
    offset = torch.tensor([1, 0, 3], device=DEV)
    rope_append(qkv, cos, sin, page, offset, cache, H, Hkv, use_triton=True)
    ref = torch.zeros_like(store)
    ref[1, 0, 1, 0], ref[1, 1, 1, 0] = qkv[0, H * D:(H + 1) * D], qkv[0, (H + 1) * D:]
    assert torch.equal(store, ref)



@pytest.mark.parametrize("page,offset", [
    ([-1, 0, 2, 1, 0, 1], [0, 0, 3, 3, 4, -1]),  # clamped onto the kept rows' slots
    ([1, 2, 0, -1], [3, 3, 0, 0]),  # each skipped row after the kept row it clamps onto
    ([-1, 2, 0], [0, 1, 4]),  # no row kept
])
def test_rope_append_torch_path_skips_slots_outside_the_cache_as_the_kernel(page, offset):
    """Rows whose page (-1, P) or offset (-1, page_size) is outside the cache (the torch
    path once wrapped or raised): neither path writes them, also where the clamped slot is
    a kept row's; the kept rows' keys and values land as in a step without the others."""
    Q, H, Hkv, D, P, ps = len(page), 2, 1, 4, 2, 4
    g = torch.Generator().manual_seed(Q)
    qkv = torch.randn(Q, (H + 2 * Hkv) * D, generator=g)
    cos, sin = _tables(Q, D, torch.float32, g)
    cache = torch.randn(P, 2, ps, Hkv, D, generator=g)
    page, offset = torch.tensor(page), torch.tensor(offset)
    ok = (page >= 0) & (page < P) & (offset >= 0) & (offset < ps)
    args = [t.to(DEV) for t in (qkv, cos, sin, page, offset)]
    got, want = cache.clone().to(DEV), cache.clone().to(DEV)
    q_got = rope_append(*args, got, H, Hkv, use_triton=True)
    q_want = rope_append_torch(*args, want, H, Hkv)
    assert torch.equal(q_got, q_want) and torch.equal(got, want)
    ref = cache.clone()
    rope_append_torch(qkv[ok], cos[ok], sin[ok], page[ok], offset[ok], ref, H, Hkv)
    assert torch.equal(want.cpu(), ref) and torch.equal(ref.eq(cache).all(), ~ok.any())

def test_rows_wider_than_the_kernels_block_run_the_torch_path(monkeypatch):
    import agspec_gpu.kernels.rms_norm as rms_norm_mod

    monkeypatch.setattr(rms_norm_mod, "_rms_norm_kernel", NoLaunch())
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, MAX_BLOCK_N + 1, generator=g) for _ in range(2))
    w = torch.randn(MAX_BLOCK_N + 1, generator=g)
    out, total = rms_norm(x.to(DEV), w.to(DEV), 1e-6, residual=r.to(DEV), use_triton=True)
    want, want_total = rms_norm_torch(x, w, 1e-6, r)
    assert torch.equal(out.cpu(), want) and torch.equal(total.cpu(), want_total)
