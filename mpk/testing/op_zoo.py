"""A zoo of elementwise ops, reductions, sorts, indexing and fills, traced as one graph: the
cases the elementwise tests compare with eager PyTorch and the codegen tests build with nvcc."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _narrow_ints(x, y, i, j, k, v):
    """uint8 and int16 results wrap as torch's do (not through float32), numbers meet int32 in
    its width (2**33 wraps to 0) and bool masks in int64 (a mask times 2 is 2, not True)."""
    u, s = k.to(torch.uint8), i.to(torch.int16)
    b = x > 0
    return (~u, u - 1, -u, s * s, (s.long() * 2 ** 24 + 1).to(torch.int16), k < 2 ** 33, u == 259, u.amin(-1),
            s.sum(-1), s.argmax(0), b * 2 - 1, b != 2, torch.add(b, 3), b & True, torch.clamp_min(b, 3))


def _fills_and_scalars(x, y, i, j, k, v):
    """Fill values converted to the tensor's dtype, integer aranges from fractional bounds, a fill
    from a 0-d tensor, bool min / max with indices, reductions of a 0-d tensor."""
    d = x.device
    return (i.masked_fill(i < 0, 0.7), torch.arange(0, 5, 1.5, dtype=torch.int64, device=d),
            torch.arange(-2.5, 2, dtype=torch.int64, device=d), torch.empty_like(x).fill_(x[0, 0, 0]),
            *(x > 0).min(0), *(x > 0).max(-1), x[0, 0, 0].sum(0), x[0, 0, 0].argmax(0), torch.softmax(x[0, 0, 0], 0))


def _indexing(x, y, i, j, k, v):
    """gather, index_select, x[i], x[i, j] (negative entries from the end; index tensors that
    broadcast, adjacent or apart), constant, reflect and replicate padding."""
    rows = k.abs().clamp(max=5).long()
    return (torch.gather(x, 1, rows), torch.index_select(x, 2, k[0, 0, :5].abs()), x[:, k[0, 0, :4].clamp(-6, 5)],
            x[k[0, :2, :3].clamp(-4, 3)], i[..., rows[0, 0, :3]], F.pad(x, (1, 2)),
            F.pad(y, (0, 0, -1, 3), value=-2.0), F.pad(i, (2, 1), value=7), F.pad(x, (0, 0)), x[:, k[0, 0, :0]],
            torch.gather(x[0, 0, 0], 0, k[0, 0, 0].clamp(0, 0).long()),
            x[k[:, :1, :1].clamp(-4, 3), k[:1, :, :1].clamp(-6, 5)],  # two index tensors, broadcast
            x[k[0, 0, :3].clamp(0, 3), :, k[1, 1, :3].clamp(-10, 9)],  # apart: their shape comes first
            x[:, k[0, :2, :2].clamp(0, 5), k[1, :2, :1].clamp(-10, 9)], x.new_ones(2, 3) + x.new_zeros(3).sum(),
            F.pad(x, (3, 9), mode="reflect"), F.pad(x, (2, 1, 5, 0), mode="replicate"),
            F.pad(x.unsqueeze(0), (1, 2, 0, 3, 3, 1), mode="reflect"), F.pad(i, (4, 2), mode="replicate"))


def _sorting(x, y, i, j, k, v):
    """Stable sorts and argsorts over any dim, both orders: int32 entries of -6…6 and bfloat16
    values tie, NaN sorts as the largest value, -0 equals 0, int64 beyond 2^32, bool, a row of
    2048 (the longest sorted whole), a 0-d tensor. (topk: test_topk_matches_a_stable_sort.)"""
    zeros = torch.zeros_like(x)
    z = torch.where(y > 1.2, float("nan"), torch.where(y < -0.8, -zeros, torch.where(y > 0.6, zeros, x)))
    return (*torch.sort(x, dim=-1, stable=True), *torch.sort(x, dim=1, descending=True, stable=True),
            torch.argsort(k, dim=-1, stable=True), *torch.sort(k, dim=0, descending=True, stable=True),
            *torch.sort(i, dim=-1, stable=True), *torch.sort(z, dim=2, stable=True), *torch.sort(z, dim=0, descending=True, stable=True),
            torch.argsort(x > 0, dim=-1, stable=True), *torch.sort(v[:, :2048], dim=-1, descending=True, stable=True),
            *torch.sort(x[0, 0, 0], stable=True))


def _float64_precision(x, y, i, j, k, v):
    """What float32 would lose (run with float64 x and y): a small step beside x, int64 beyond
    2^24 into float64 and back, copies, indexing and a float64 embedding table; and what float64
    must not gain: a 0-d float64 tensor with float32 ones computes in float32, as in torch."""
    return ((x + 1e-9) - x, i.double() + 0.5, (i.double() * 0.5).long(), x.transpose(1, 2).contiguous(),
            x.float() == x[0, 0, 0], x.float() * y[0, 0, 0],  # a 0-d float64 meets float32 in float32
            torch.cat([x, y], 2)[:, k[0, 0, :3].clamp(-6, 5)], F.embedding(k.abs().long(), y.reshape(24, 10)),
            x.to(torch.float32), torch.where(x > 0, x * (1 + 2 ** -40), y))


# name -> f(x, y, i, j, k, v): x, y float [4, 6, 10]; i, j int64 of magnitude up to 2^40; k int32;
# v float rows long enough for the CTA-per-row tasks [3, 8192]
CASES = {
    "abs_log": lambda x, y, *_: x.abs().log(),
    "sin_cos": lambda x, y, *_: torch.sin(x) + torch.cos(y),
    "reciprocal": lambda x, y, *_: (x.abs() + 0.5).reciprocal(),
    "erf_log1p_expm1": lambda x, y, *_: torch.erf(x) + torch.log1p(y.abs()) + torch.expm1(x),
    "rounding": lambda x, y, *_: (torch.floor(x * 4), torch.ceil(y * 4), torch.round(x * 4), torch.trunc(y * 4)),
    "sign": lambda x, y, *_: torch.sign(x),
    "maximum_minimum": lambda x, y, *_: (torch.maximum(x, y), torch.minimum(x, y), x.clamp_min(0.2)),
    "clamp": lambda x, y, *_: (x.clamp(-0.5, 0.5), x.clamp(min=y), x.clamp(max=0.1), F.hardtanh(x), F.relu6(x * 4)),
    "comparisons": lambda x, y, *_: (((x > y) & (x < 1)) | (x == y), (x >= 0.5) ^ (y <= -0.5), x != y, ~(x > 0),
                                     # a number meets a 16-bit float tensor rounded to its dtype
                                     x.clamp(0.3, 0.3) == 0.3, x.clamp(-0.8, -0.8) < -0.8,
                                     x.clamp(0.3, 0.3) == torch.full((), 0.3, device=x.device),
                                     x.clamp(2048, 2048) == x.new_full((1,), 2049, dtype=torch.int32)),
    "where": lambda x, y, *_: (torch.where(x > 0, x, 0.0), torch.where(x > y, x, y), x.masked_fill(y > 0.5, -3.0)),
    "masked_softmax": lambda x, y, *_: torch.softmax(x.masked_fill(y > 0.5, float("-inf")), -1),
    "activations": lambda x, y, *_: (F.leaky_relu(x, 0.1), F.elu(x), F.selu(x), F.celu(x, 0.7), F.softplus(x, 2, 5),
                                     F.hardsigmoid(x), F.hardswish(x), F.mish(x), F.logsigmoid(x),
                                     F.threshold(x, 0.1, 2.0), F.glu(x, -1), F.hardshrink(x), F.softsign(y), F.prelu(x, y[0, :, :1].flatten()[:6])),
    "reductions": lambda x, y, *_: (x.sum(0), x.mean((0, 2)), x.amax(1), x.amin(-1, keepdim=True), x.sum(),
                                    x.max(), y.min()),
    "arg_reductions": lambda x, y, *_: (x.argmin(1), x.argmax(), y.argmax(0, keepdim=True), *x.max(dim=1),
                                        *x.min(dim=0)),
    "variance_norms": lambda x, y, *_: (x.var(1), x.std(-1, correction=0), torch.linalg.vector_norm(x, dim=-1),
                                        F.normalize(y, dim=1), torch.linalg.vector_norm(x, 1, dim=(0, 1)),
                                        torch.linalg.vector_norm(y, float("inf"), dim=0)),
    "softmax_dims": lambda x, y, *_: (F.softmax(x, 0), F.log_softmax(x, 1), F.log_softmax(y, -1)),
    "stack": lambda x, y, *_: torch.stack([x, y], 1),
    "cumsum": lambda x, y, i, j, k, v: (x.cumsum(-1), y.cumsum(0), (x > 0).cumsum(1), k.cumsum(-1),
                                        i.cumsum(2), x.cumsum(1, dtype=torch.float64).float(), v.cumsum(-1)),
    # (integer products of up to 10 factors of |k| ≤ 6 stay below 2^26; i's wrap in 64 bits, as eager's)
    "cumprod": lambda x, y, i, j, k, v: (x.cumprod(-1), (y * 0.5 + 1).cumprod(0), k.cumprod(-1), i.cumprod(2),
                                         (x > 0).cumprod(1)),
    "group_norm": lambda x, y, *_: (F.group_norm(x.reshape(2, 12, 10), 3, y.flatten()[:12] + 1, y.flatten()[12:24]),
                                    F.group_norm(x.reshape(4, 6, 10), 2)),
    "pixel_shuffle": lambda x, y, *_: F.pixel_shuffle(x.reshape(1, 4, 6, 10), 2) * 2,
    "long_rows": lambda *a: (a[5].argmin(-1), a[5].amin(-1, keepdim=True), F.log_softmax(a[5], -1),
                             a[5][:, 1:].argmin(-1)),
    "made_in_forward": lambda x, y, *_: (x + torch.zeros(10, device=x.device), torch.ones_like(x) * 2 + y,
                                         torch.full((4, 1, 1), 2.5, device=x.device) * x,
                                         x + torch.arange(10, device=x.device),
                                         torch.arange(2, 32, 3, device=x.device) * 2 ** 33,
                                         torch.arange(0.5, 3.0, 0.25, device=x.device) * y[0, 0],
                                         torch.empty(3, 2, device=x.device).fill_(1.5) + x[0, :3, :2],
                                         torch.zeros(2, dtype=torch.bool, device=x.device) | (x[0, 0, :2] > 0)),
    "int_arithmetic": lambda x, y, i, j, k, _: (i + j, i - 3, i * 3, -i, i.abs(), torch.sign(i), torch.maximum(i, j),
                                             i.clamp(-2 ** 39, 2 ** 39), k ** 3, torch.relu(i)),
    "int_logic": lambda x, y, i, j, k, _: (torch.where(i > j, i, j), (i == j) | (i < 0), i & j, i | 7, i ^ j, ~i,
                                        (k > 0) & (k < 5)),
    "int_casts": lambda x, y, i, j, k, _: (i.to(torch.int32), k.long() * 2 ** 33, (i > 0).long(), i.bool(), k.float()),
    "narrow_ints": _narrow_ints,
    "fills_and_scalars": _fills_and_scalars,
    "indexing": _indexing,
    "sorting": _sorting,
    "float64_precision": _float64_precision,
    # tril / triu (the triangle task) of floats and ints, through a strided view; repeat / tile
    # (an expand where strided, else a copy); a constant made in forward from data (lifted)
    "triangles_repeats": lambda x, y, i, j, k, _: (torch.tril(x, 1), torch.triu(y.transpose(1, 2), -2), torch.tril(i),
                                                torch.triu(x > 0, 3), x.repeat(1, 2, 1), torch.tile(k, (2, 1)),
                                                x[:1].repeat(3, 1, 1) - x[1:],
                                                x * torch.tensor([0.5, -1.0, 2.0, 3.0] * 2 + [1.0, 0.0],
                                                                 device=x.device, dtype=x.dtype)),
    "int_reductions": lambda x, y, i, j, k, _: (i.sum(-1), i.amax(0), i.amin(1), i.argmax(-1), i.argmin(0),
                                             (i > 0).sum(-1), k.sum(1), *i.max(dim=2)),
}


class Zoo(torch.nn.Module):
    """Every case's outputs, flattened, in one graph (one build on the GPU)."""

    def __init__(self, names):
        super().__init__()
        self.names = names

    def forward(self, x, y, i, j, k, v):
        outs = []
        for name in self.names:
            o = CASES[name](x, y, i, j, k, v)
            outs.extend(o if isinstance(o, tuple) else (o,))
        return tuple(outs)


def labels(names, args) -> list[str]:
    labels = []
    for name in names:
        o = CASES[name](*args)
        labels.extend(f"{name}[{n}]" for n in range(len(o) if isinstance(o, tuple) else 1))
    return labels


def zoo_inputs(dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    x, y = (torch.randn(4, 6, 10, generator=g).to(dtype) for _ in range(2))
    i, j = (torch.randint(-2 ** 40, 2 ** 40, (4, 6, 10), generator=g) for _ in range(2))
    j[0, 0, :4] = i[0, 0, :4]  # some equal pairs for ==, maximum and where
    k = torch.randint(-6, 7, (4, 6, 10), generator=g, dtype=torch.int32)
    v = torch.randn(3, 8192, generator=g).to(dtype)
    return [t.to(device) for t in (x, y, i, j, k, v)]
