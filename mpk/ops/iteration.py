"""``decode_advance``: the start-of-iteration task (the seed paper's §6.1), so that several decode
iterations run inside one persistent-kernel launch without the host.

After a decode step has picked each sequence's next token, one task (one CTA; a thread per
sequence) does what the host would do between steps, writing the graph's own inputs for the
next iteration:

* the token becomes the next iteration's input (``tokens``) and is recorded in an output ring
  ``out [K, B]`` at slot ``step % K`` (``pool[STEP]``, incremented);
* the sequence grows by one: its length (``seqs[b, LEN]``) + 1, and when its new position starts
  a page, a page popped from a GPU-side free list (``pool[FREE:]``, its top ``pool[TOP]``) into
  its block table (``seqs[b, table:]``, a fixed capacity of P pages: no CSR to shift);
* the page table a step reads (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) is rebuilt
  from every row's length and block table;
* the sampler's counter (``seqs[b, GEN]``, the index of the token being generated) + 1;
* stop conditions set ``seqs[b, DONE]``: a stop token id (``seqs[b, STOPS:STOPS + S]``, −1
  padded), ``seqs[b, MAX]`` tokens generated, ``max_len`` tokens in all, or no page left for
  the next position. The token that stopped a sequence is still emitted (the host appends it,
  as after a step) but not fed back; a free list run dry is no finish, only the end of this
  launch's run for the row.

A done row is not advanced: its token, length and table stay, so every later iteration
recomputes the same step (rewrites its last k/v slot with what it holds: harmless, nobody reads
the row's output) and its ring slots are −1. Rows are ordered: the rows needing a page take
them from the top of the free list in row order, so every executor pops the same pages.

**Ordering.** The task writes inputs that this iteration's tasks read (tokens: the embedding;
the page table: every layer's append and attention; ``seqs``: the sampler's counter). Those
writes are for the *next* iteration (``OpDef.carried_writes``), so every reader in this
iteration must finish before the task starts: it reads the next tokens, which come from the
logits, which need every row of the final hidden state, which needs every layer's attention
and append tiles (they feed the output projection, which reads all of them) and the embedding;
the counter feeds the sampler. The compiler's happens-before check verifies exactly this
(``mpk.compiler.verify``), and the end event of an iteration starts the next one, so the next
iteration's readers see the writes.

Inputs: next [B] int64, tokens [B] int64, kv_indptr [B + 1], kv_indices [N], kv_last_page_len
[B] (int32), seqs [B, SEQ_FIELDS + S + P] int32, pool [POOL_FIELDS + F] int32, out [K, B] int32.
Output: emitted [B] int64, this iteration's tokens (−1 for done rows). Attrs: page_size,
max_len, stops (S).
"""

from __future__ import annotations

import torch

from mpk.ops.gpu import GpuSpec, OpInfo, Params
from mpk.ops.registry import OpDef, OpSig, register

# seqs [B, SEQ_FIELDS + S + P] columns: the length the page table counts (the step's token
# included), tokens generated so far (the sampler's counter), the generation limit (max_tokens),
# done (0 / 1); then S stop token ids (−1: none), then the block table (P pages)
LEN, GEN, MAX, DONE = 0, 1, 2, 3
SEQ_FIELDS = 4
# pool [POOL_FIELDS + F]: the iteration counter (out's slot), the free list's size, its pages
STEP, TOP = 0, 1
POOL_FIELDS = 2
MAX_BATCH = 256  # a thread per row of the one CTA (cuda/mpk_tasks/iteration.cuh)
CARRIED = (1, 2, 3, 4, 5, 6, 7)  # the inputs the task writes for the next iteration


def table_pages(sig: OpSig) -> int:
    """P, the block table's capacity per row."""
    return sig.in_shapes[5][1] - SEQ_FIELDS - int(sig.attrs["stops"])


def advance(nxt: torch.Tensor, tokens: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
            last: torch.Tensor, seqs: torch.Tensor, pool: torch.Tensor, out: torch.Tensor, page_size: int,
            max_len: int, stops: int) -> torch.Tensor:
    """The task on CPU tensors, in place (the module docstring); returns ``emitted``."""
    B, S = nxt.shape[0], stops
    rows, p, ids = seqs.tolist(), pool.tolist(), nxt.tolist()
    top, free = p[TOP], p[POOL_FIELDS:]
    emitted = [-1] * B
    for b, row in enumerate(rows):
        if row[DONE]:
            continue
        t = emitted[b] = ids[b]
        row[GEN] += 1
        n = row[LEN] + 1  # the sequence's tokens with t; t sits at position n − 1
        stop = t in row[SEQ_FIELDS: SEQ_FIELDS + S] or row[GEN] >= row[MAX] or n >= max_len
        if not stop and (n - 1) % page_size == 0:  # t starts a page
            if top == 0:
                stop = True
            else:
                top -= 1
                row[SEQ_FIELDS + S + (n - 1) // page_size] = free[top]
        if stop:
            row[DONE] = 1
        else:
            row[LEN] = n
            tokens[b] = t
    out[p[STEP] % out.shape[0]] = torch.tensor(emitted, dtype=out.dtype)
    pool[STEP], pool[TOP] = p[STEP] + 1, top
    seqs.copy_(torch.tensor(rows, dtype=seqs.dtype))
    rebuild_table(seqs, indptr, indices, last, page_size, S)
    return torch.tensor(emitted, dtype=torch.int64)


def rebuild_table(seqs: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, page_size: int,
             stops: int) -> None:
    """The BSR page table of every row from its length and block table (entries past the rows'
    pages keep what they held; pages past kv_indices' capacity are dropped: the host sizes it)."""
    lens = seqs[:, LEN].long()
    counts = (lens + page_size - 1) // page_size
    indptr[0] = 0
    indptr[1:] = torch.cumsum(counts, 0).clamp_max(indices.shape[0]).to(indptr.dtype)
    table = seqs[:, SEQ_FIELDS + stops:]
    for b, n in enumerate(counts.tolist()):
        lo = int(indptr[b])
        k = min(n, indices.shape[0] - lo)
        indices[lo: lo + k] = table[b, :k].to(indices.dtype)
    last.copy_(torch.where(lens > 0, (lens - 1) % page_size + 1, 0).to(last.dtype))


def _regions(sig: OpSig, rect):
    return [tuple((0, n) for n in shape) for shape in sig.in_shapes]


def _writes(sig: OpSig, rect):
    return [(i, tuple((0, n) for n in sig.in_shapes[i])) for i in CARRIED]


def _cpu(sig: OpSig, rect, xs):
    a = sig.attrs
    return advance(*xs, page_size=int(a["page_size"]), max_len=int(a["max_len"]), stops=int(a["stops"]))


def _params(op: OpInfo) -> Params:
    """iparam: page_size, max_len, S (stop ids per row)."""
    return [int(op.attrs["page_size"]), int(op.attrs["max_len"]), int(op.attrs["stops"])], []


def _check(op: OpInfo) -> None:
    B = op.out_shape[0]
    if B > MAX_BATCH:
        raise op.error(f"a batch of {B} sequences; the decode_advance task takes a thread per sequence, at most "
                       f"{MAX_BATCH}")
    want = [torch.int64, torch.int64] + [torch.int32] * 6
    got = [v.dtype for v in op.inputs]
    if got != want or not all(v.graph_input for v in op.inputs[1:]):
        raise op.error(f"inputs of dtypes {[str(d)[6:] for d in got]}; expected {[str(d)[6:] for d in want]}, all "
                       "but the first graph inputs (written in place)")
    for i, v in enumerate(op.inputs):
        dense = [1] * v.ndim
        for d in range(v.ndim - 2, -1, -1):
            dense[d] = dense[d + 1] * v.shape[d + 1]
        if v.offset or any(v.stride(d) != dense[d] for d in range(v.ndim) if v.shape[d] > 1):
            raise op.error(f"input {i} must be a whole contiguous tensor; got offset {v.offset}, strides {v.strides}")

register(OpDef(
    kind="decode_advance", type_id=100, input_regions=_regions, cpu=_cpu,
    splittable=lambda sig: (False,),  # one task: the rows share the free list
    carried_writes=_writes,
    gpu=GpuSpec(params=_params, check=_check, float64_exact=True),
    doc="emitted [B] int64: the start-of-iteration task: feed each sequence's next token back, record it in the "
        "out ring, grow the sequence (pages from the free list), rebuild the page table, check stop conditions",
))
