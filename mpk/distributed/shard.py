"""The tensor-parallel sharding pass: one rank's share of a ``DecoderLM`` step's OpGraph
(Megatron style), with the collectives (mpk.ops.collective) that join the ranks.

* column-parallel: the fused q|k|v projection (rank r keeps its query heads' rows of q, and of
  k and v its kv heads' rows: kv heads split across ranks, or, with fewer kv heads than ranks,
  each kv head replicated on the world / kv_heads ranks whose query heads use it) and the
  gate|up projection (its gate and up rows of the same intermediate range); RoPE and paged
  attention take the rank's heads and kv heads, and its KV cache holds only its kv heads;
* row-parallel: the o and down projections (the matching columns of their weights) write a
  partial product, and an ``all_reduce`` sums the ranks' partials and adds the residual the
  projection had fused (once: a residual in each rank's partial would be counted world times);
* vocabulary-parallel: the embedding looks up only its rank's vocabulary rows (others give
  zeros: ``attrs vocab_start / vocab``) and an ``all_reduce`` sums; the LM head computes its
  rank's vocabulary columns and an ``all_gather`` assembles [M, vocab] on every rank. An
  all-gather, not a distributed arg-max: the step's contract is logits, which the sampler
  needs whole (temperature, top-p), so a greedy-only shortcut would change what a step returns.

Fusions that do not commute with sharding: a residual add in a row-parallel projection moves
into its all_reduce; an RMSNorm prologue stays (it normalises the replicated input of a
column-parallel projection, which every rank has whole); the ``norm_stats`` split (the
residual projection writes the next norm's partial sums) cannot work on a partial product, so
the backend turns it off under tensor parallelism and the pass refuses a graph that has it.

**Inputs.** ``ShardedGraph.inputs[i]`` says how the sharded graph's input i derives from the
caller's full inputs: ``full`` (passed as is), ``slice`` (rows or columns of a full input,
concatenated ranges along one dim: made once from the full weights and cached by the runner;
``state``: an input the graph writes in place, the KV cache, bound live: see
mpk.distributed.binding for a rank-local cache), or a communication
buffer the runner makes once and keeps: ``symmetric`` (from the SymmetricAllocator: receive
slots and signals), ``peers`` (``peer_pointers`` of symmetric input ``of``) or ``local``
(zero-filled int64 sequence counters).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mpk.errors import ShardingError
from mpk.ir.opgraph import Op, OpGraph
from mpk.ir.views import View, identity_view

ATTENTION = ("rope_append", "rope_attn_partial")
ATTENTION_OUT = ("attn_partial", "rope_attn_partial", "attn_merge")


@dataclass(frozen=True)
class InputSpec:
    """How one input of a sharded graph comes from the caller's full inputs (module doc)."""

    kind: str  # "full" | "slice" | "symmetric" | "peers" | "local"
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: int | None = None  # full, slice: the caller's input index
    dim: int = 0  # slice: along this dim, the concatenation of ``ranges``
    ranges: tuple[tuple[int, int], ...] = ()
    state: bool = False  # slice: written in place by the graph (bind the live tensor)
    of: int | None = None  # peers: the sharded graph's input index of the symmetric buffer

    def take(self, full: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This input's shard of the full tensor: a contiguous copy, into ``out`` when given
        (a shard tensor of this spec's shape, whose address then stays bound)."""
        if out is None:
            return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges], self.dim).contiguous()
        at = 0
        for a, b in self.ranges:
            out.narrow(self.dim, at, b - a).copy_(full.narrow(self.dim, a, b - a))
            at += b - a
        return out


def kv_head_range(kv: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s kv heads [lo, hi) of ``kv``: its share, or with fewer kv heads than
    ranks the one its query heads use."""
    if kv >= world:
        if kv % world:
            raise ShardingError(f"kv_heads is {kv}, not divisible by the tensor-parallel degree {world}; "
                                f"expected a multiple of {world}")
        k = kv // world
        return rank * k, (rank + 1) * k
    if world % kv:
        raise ShardingError(f"kv_heads is {kv}, fewer than the tensor-parallel degree {world} and not a "
                            f"divisor of it; expected kv_heads a multiple or a divisor of {world}")
    j = rank // (world // kv)
    return j, j + 1


def default_comm_tiles(n: int) -> int:
    """Column tiles of a collective over ``n`` columns: up to 8 of ≥ 16 columns (a hidden-size
    all-reduce: its transfers start as the producer's tiles finish), and for wide ones (the LM
    head's vocabulary gather) one per ≥ 512 columns up to 64, so that more CTAs move them."""
    return max(1, min(64, max(min(8, n // 16), n // 512)))


@dataclass
class ShardedGraph:
    """Rank ``rank`` of ``world``'s graph and where each of its inputs comes from."""

    graph: OpGraph
    rank: int
    world: int
    inputs: list[InputSpec] = field(default_factory=list)


@dataclass
class _Pass:
    g: OpGraph
    rank: int
    world: int
    tiles: int | None
    specs: dict[int, InputSpec] = field(default_factory=dict)  # buffer id → its derivation
    new_ops: list[Op] = field(default_factory=list)
    heads: tuple[int, int, int] | None = None  # H, KV, D

    # --- sizes -------------------------------------------------------------------------------
    def part(self, n: int, what: str) -> tuple[int, int]:
        """This rank's range of ``n`` things split evenly over the ranks."""
        if n % self.world:
            raise ShardingError(f"{what} is {n}, not divisible by the tensor-parallel degree {self.world}; "
                                f"expected a multiple of {self.world}")
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k

    def kv_range(self, kv: int) -> tuple[int, int]:
        return kv_head_range(kv, self.rank, self.world)

    # --- buffers and views ------------------------------------------------------------------
    def reshape_buffer(self, b: int, shape: tuple[int, ...], spec: InputSpec | None = None) -> None:
        buf = self.g.buffers[b]
        if b in self.specs and (spec is None or self.specs[b] != spec):
            raise ShardingError(f"input {buf.name!r} would be sharded two ways ({self.specs[b]} and {spec})")
        self.g.buffers[b] = replace(buf, shape=tuple(shape))
        if spec is not None:
            self.specs[b] = spec

    def slice_input(self, b: int, dim: int, ranges, state: bool = False) -> None:
        buf = self.g.buffers[b]
        if buf.role != "input":
            raise ShardingError(f"{buf.name!r} is computed in the graph; expected a weight (a graph input) to shard")
        shape = list(buf.shape)
        shape[dim] = sum(b1 - a for a, b1 in ranges)
        spec = InputSpec("slice", tuple(shape), buf.dtype, buf.input_index, dim, tuple(ranges), state)
        if b in self.specs and self.specs[b] == spec:
            return
        self.reshape_buffer(b, tuple(shape), spec)

    def add_input(self, name: str, spec: InputSpec) -> int:
        n = len([x for x in self.g.buffers if x.role == "input"])
        buf = self.g.add_buffer(name, spec.shape, spec.dtype, "input", input_index=n)
        self.specs[buf.id] = spec
        return buf.id

    def index(self, b: int) -> int:
        return self.g.buffers[b].input_index

    def add_op(self, kind: str, inputs: list[View], out: int, attrs: dict, name: str, source: str) -> Op:
        op = Op(-1, kind, tuple(inputs), out, attrs, name, source)
        self.new_ops.append(op)
        return op

    def out_buffer(self, name: str, shape, dtype) -> int:
        return self.g.add_buffer(name, tuple(shape), dtype, "intermediate").id

    # --- collectives ------------------------------------------------------------------------
    def collective(self, kind: str, op: Op, local: int, out: int, residual: View | None) -> None:
        """comm_put + ``kind`` after ``op``, combining the ranks' ``local`` [M, N] into ``out``."""
        m, n = self.g.buffers[local].shape
        dtype = self.g.buffers[local].dtype
        tn = min(self.tiles, n) if self.tiles else default_comm_tiles(n)
        tiles, t = [1, tn], tn
        w = self.world
        recv = self.add_input(f"{op.name}.recv", InputSpec("symmetric", (2, w, m, n), dtype))
        signals = self.add_input(f"{op.name}.signals", InputSpec("symmetric", (w, t), torch.int64))
        peers_recv = self.add_input(f"{op.name}.recv_peers", InputSpec("peers", (w,), torch.int64, of=self.index(recv)))
        peers_sig = self.add_input(f"{op.name}.signal_peers", InputSpec("peers", (w,), torch.int64, of=self.index(signals)))
        seq = self.add_input(f"{op.name}.seq", InputSpec("local", (1 + w, t), torch.int64))
        attrs = {"rank": self.rank, "world": w, "tiles": tiles}
        def v(b: int) -> View:
            return identity_view(b, self.g.buffers[b].shape)

        token = self.out_buffer(f"{op.name}.sent", (1, tn), torch.int64)
        self.add_op("comm_put", [v(local), v(peers_recv), v(peers_sig), v(seq)], token, attrs, f"{op.name}.put",
                    op.source)
        ins = [v(local), v(token), v(recv), v(signals), v(seq)] + ([residual] if residual is not None else [])
        self.add_op(kind, ins, out, attrs, f"{op.name}.{kind}", op.source)


def shard_graph(graph: OpGraph, rank: int, world: int, comm_tiles: int | None = None) -> ShardedGraph:
    """Rank ``rank`` of ``world``'s share of a DecoderLM step's OpGraph (module doc); the input
    graph is not modified. ``comm_tiles``: column tiles of each collective (its transfers'
    granularity; default about one per 16 columns, at most 8). ShardingError names a size the
    degree does not divide or an op the pass cannot classify."""
    if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
        raise ShardingError(f"rank={rank!r}, world={world!r}; expected ints with 0 ≤ rank < world")
    p = _Pass(copy.deepcopy(graph), rank, world, comm_tiles)
    g = p.g
    readers: dict[int, list[Op]] = {}
    for op in g.ops:
        for v in op.inputs:
            readers.setdefault(v.buffer, []).append(op)
    producer = {op.output: op for op in g.ops}
    for op in list(g.ops):
        p.new_ops.append(op)
        if op.kind == "embedding":
            _embedding(p, op)
        elif op.kind == "matmul":
            _matmul(p, op, readers, producer)
        elif op.kind in ATTENTION + ATTENTION_OUT:
            _attention(p, op)
    g.ops = p.new_ops
    for i, op in enumerate(g.ops):
        op.id = i
    _refresh_views(p)
    specs = [p.specs.get(b.id) or InputSpec("full", b.shape, b.dtype, b.input_index) for b in g.inputs]
    _drop_unused(g)
    _check_shapes(g)
    return ShardedGraph(g, rank, world, specs)


def _embedding(p: _Pass, op: Op) -> None:
    w = op.inputs[0].buffer
    vocab = op.inputs[0].shape[0]
    lo, hi = p.part(vocab, "the vocabulary")
    p.slice_input(w, 0, [(lo, hi)])
    op.attrs = dict(op.attrs, vocab_start=lo, vocab=vocab)
    out = op.output
    local = p.out_buffer(f"{op.name}.local", p.g.buffers[out].shape, p.g.buffers[out].dtype)
    op.output = local
    p.collective("all_reduce", op, local, out, None)


def _weight(p: _Pass, op: Op) -> int:
    """The weight buffer of a projection: b = W^T, a graph input seen through a transpose."""
    v = op.inputs[1]
    if p.g.buffers[v.buffer].role != "input" or [s[0] for s in v.steps] != ["permute"]:
        raise ShardingError(f"projection {op.name!r} reads its weight {p.g.buffers[v.buffer].name!r} through "
                            f"{v.steps}; expected a linear layer's weight (a graph input, transposed)")
    return v.buffer


def _matmul(p: _Pass, op: Op, readers, producer) -> None:
    pro, epi = op.attrs.get("prologue"), op.attrs.get("epilogue")
    if "norm_stats" in (pro, epi):
        raise ShardingError(f"projection {op.name!r} has the norm_stats split (fuse_norm_stats), whose row sums "
                            "need the whole product; compile with options fuse_norm_stats=False under tensor_parallel")
    w = _weight(p, op)
    src = producer.get(op.inputs[0].buffer)
    users = [u.kind for u in readers.get(op.output, [])]
    out = p.g.buffers[op.output]
    if any(k in ATTENTION for k in users):
        _qkv(p, op, w, next(u for u in readers[op.output] if u.kind in ATTENTION))
    elif epi == "silu_mul":
        inter = _wshape(op)[0] // 2
        lo, hi = p.part(inter, "the intermediate size")
        p.slice_input(w, 0, [(lo, hi), (inter + lo, inter + hi)])
        p.reshape_buffer(op.output, (out.shape[0], hi - lo))
    elif src is not None and (src.kind in ATTENTION_OUT or src.attrs.get("epilogue") == "silu_mul"):
        _row_parallel(p, op, w)
    elif not users and (pro == "rms_norm" or (src is not None and src.kind == "rms_norm")):  # after the final norm
        _lm_head(p, op, w)
    else:
        raise ShardingError(f"cannot classify projection {op.name!r} (weight {p.g.buffers[w].name!r} "
                            f"{list(_wshape(op))}, reading {p.g.buffers[op.inputs[0].buffer].name!r}) as "
                            "q|k|v, gate|up, o, down or the LM head of a DecoderLM step")


def _wshape(op: Op) -> tuple[int, int]:
    """A projection's weight shape [out, in] as the graph had it (the buffer may be sharded
    already: a tied embedding)."""
    k, n = op.inputs[1].shape
    return n, k


def _qkv(p: _Pass, op: Op, w: int, rope: Op) -> None:
    H, KV, D = rope.attrs["heads"], rope.attrs["kv_heads"], rope.attrs["head_dim"]
    p.heads = (H, KV, D)
    q0, q1 = p.part(H, "the number of attention heads")
    k0, k1 = p.kv_range(KV)
    q, kv = H * D, KV * D
    p.slice_input(w, 0, [(q0 * D, q1 * D), (q + k0 * D, q + k1 * D), (q + kv + k0 * D, q + kv + k1 * D)])
    p.reshape_buffer(op.output, (p.g.buffers[op.output].shape[0], (q1 - q0 + 2 * (k1 - k0)) * D))


def _attention(p: _Pass, op: Op) -> None:
    if p.heads is None:
        raise ShardingError(f"attention op {op.name!r} before any q|k|v projection; cannot tell its heads")
    H, KV, _ = p.heads
    q0, q1 = p.part(H, "the number of attention heads")
    k0, k1 = p.kv_range(KV)
    hl, kvl = q1 - q0, k1 - k0
    if "heads" in op.attrs:
        op.attrs = dict(op.attrs, heads=hl, kv_heads=kvl)
    for v in op.inputs:
        if len(v.shape) == 6:  # the paged KV cache [L, 2, pages, kv_heads, page_size, D]
            p.slice_input(v.buffer, 3, [(k0, k1)], state=True)
    out = list(p.g.buffers[op.output].shape)
    if op.kind in ("rope_append", "attn_merge"):
        out[1] = hl  # [T, H, D]
    elif len(out) == 4:  # final states [T, KV, G, D]
        out[1], out[2] = kvl, hl // kvl
    else:  # states [rows, KV, C, G, D + 1]
        out[1], out[3] = kvl, hl // kvl
    p.reshape_buffer(op.output, tuple(out))


def _row_parallel(p: _Pass, op: Op, w: int) -> None:
    k = _wshape(op)[1]
    lo, hi = p.part(k, f"the input width of projection {op.name!r}")
    if p.heads is not None and k == p.heads[0] * p.heads[2]:  # o: the rank's heads' columns
        D = p.heads[2]
        q0, q1 = p.part(p.heads[0], "the number of attention heads")
        lo, hi = q0 * D, q1 * D
    p.slice_input(w, 1, [(lo, hi)])
    residual = None
    if len(op.inputs) == 3:
        if op.attrs.get("alpha", 1) != 1 or op.attrs.get("beta", 1) != 1:
            raise ShardingError(f"projection {op.name!r} scales its product or residual (alpha, beta "
                                f"{op.attrs.get('alpha')}, {op.attrs.get('beta')}); expected a plain residual add")
        residual = op.inputs[2]
        op.inputs = op.inputs[:2]
    op.attrs = {}
    out = op.output
    local = p.out_buffer(f"{op.name}.partial", p.g.buffers[out].shape, p.g.buffers[out].dtype)
    op.output = local
    p.collective("all_reduce", op, local, out, residual)


def _lm_head(p: _Pass, op: Op, w: int) -> None:
    vocab = _wshape(op)[0]
    lo, hi = p.part(vocab, "the vocabulary")
    p.slice_input(w, 0, [(lo, hi)])
    out = p.g.buffers[op.output]
    m = out.shape[0]
    local = p.out_buffer(f"{op.name}.local", (m, hi - lo), out.dtype)
    gathered = p.out_buffer(f"{op.name}.gathered", (m, p.world, hi - lo), out.dtype)
    old = op.output
    op.output = local
    p.collective("all_gather", op, local, gathered, None)
    for o in p.g.outputs:
        if o.view is not None and o.view.buffer == old:
            if o.view.steps:
                raise ShardingError(f"the logits output is a view {o.view.steps}; expected the LM head's output")
            o.view = identity_view(gathered, (m, p.world, hi - lo)).then(("reshape", (m, vocab)))


def _refresh_views(p: _Pass) -> None:
    """Rebuild every view whose buffer changed shape: transposes and reshapes of a sharded
    buffer keep their steps with the new sizes (a reshape keeps its leading dims)."""
    for op in p.g.ops:
        op.inputs = tuple(_reshaped(p.g, v) for v in op.inputs)
    for o in p.g.outputs:
        if o.view is not None:
            o.view = _reshaped(p.g, o.view)


def _reshaped(g: OpGraph, v: View) -> View:
    shape = g.buffers[v.buffer].shape
    if shape == v.base_shape:
        return v
    new = identity_view(v.buffer, shape)
    numel = 1
    for s in shape:
        numel *= s
    for step, old_out in zip(v.steps, v.shapes):
        if step[0] == "permute":
            new = new.then(step)
        elif step[0] == "reshape" and numel % max(1, _prod(old_out[:-1])) == 0:
            new = new.then(("reshape", tuple(old_out[:-1]) + (numel // _prod(old_out[:-1]),)))
        else:
            raise ShardingError(f"a view {v.steps} of sharded buffer {g.buffers[v.buffer].name!r}; expected "
                                "transposes or reshapes keeping the leading dims")
    return new


def _drop_unused(g: OpGraph) -> None:
    """Remove buffers nothing writes or reads any more (the LM head's full-vocabulary output,
    replaced by the gather's), renumbering the rest."""
    used = {op.output for op in g.ops} | {v.buffer for op in g.ops for v in op.inputs}
    used |= {o.view.buffer for o in g.outputs if o.view is not None} | {b.id for b in g.buffers if b.role == "input"}
    keep = [b for b in g.buffers if b.id in used]
    new_id = {b.id: i for i, b in enumerate(keep)}
    g.buffers = [replace(b, id=new_id[b.id]) for b in keep]
    for op in g.ops:
        op.output = new_id[op.output]
        op.inputs = tuple(replace(v, buffer=new_id[v.buffer]) for v in op.inputs)
    for o in g.outputs:
        if o.view is not None:
            o.view = replace(o.view, buffer=new_id[o.view.buffer])


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _check_shapes(g: OpGraph) -> None:
    """Every op's input regions of its whole output fit its (resharded) inputs: a shape the
    pass got wrong is a ShardingError here, not a wrong read later."""
    from mpk.compiler.partition import op_sig, split_bounds
    from mpk.ops import get_op

    for op in g.ops:
        sig = op_sig(g, op)
        opdef = get_op(op.kind)
        grid = (opdef.default_grid(sig, 1) if opdef.default_grid else None) or (1,) * len(sig.out_shape)
        last = tuple(split_bounds(n, k)[-2:] for n, k in zip(sig.out_shape, grid))  # reaches every end
        try:
            regions = opdef.input_regions(sig, last)
        except Exception as e:  # a kind's shape assertion: reword it with the op
            raise ShardingError(f"sharded op {op.name!r} ({op.kind}) is inconsistent: {e}") from e
        for v, r in zip(op.inputs, regions):
            if r is not None and any(b > n for (_, b), n in zip(r, v.shape)):
                raise ShardingError(f"sharded op {op.name!r} ({op.kind}) reads {r} of an input of shape "
                                    f"{list(v.shape)} ({g.buffers[v.buffer].name!r})")


def describe_inputs(sharded: ShardedGraph) -> list[dict[str, Any]]:
    """The sharded graph's inputs in words (for inspection and docs)."""
    names = {b.input_index: b.name for b in sharded.graph.inputs}
    return [{"input": i, "name": names[i], **{k: v for k, v in s.__dict__.items() if v not in (None, (), False)}}
            for i, s in enumerate(sharded.inputs)]
