"""Token-count buckets: a ``DecoderLM`` compiled once per step size over one ``PageTable``
(a ``PagedKVCache``, or the engine's table over its block manager), so steps of any number of
new tokens (prefill chunks, decodes, both in one step) run without recompiling, and
``prefill``, which feeds prompts through them.

mpk compiles static shapes: each bucket of T rows is its own graph (and kernel). A step of
n new tokens runs the smallest bucket T ≥ n, rows n … T − 1 padding (token 0; the paged ops
append nothing for them and give them zero attention output); a step of one token per sequence runs the decode form
(``qo_indptr`` None), the decode benchmark's graph. ``TokenBuckets.compile`` traces every
graph first, then builds their kernels together (parallel nvcc through the cubin cache, as
``benchmarks/prebuild_decode.py`` does).

Every bucket is a Dynamo cache entry of ``DecoderLM.forward``: ``compile`` raises Dynamo's
``recompile_limit`` (8 by default) while it traces, and steps run under the
``fail_on_recompile`` stance, so a step that would compile (new shapes, or after
``torch._dynamo.reset()`` / ``torch.compiler.reset()``, which drop every graph) raises instead
of silently tracing in the loop; call ``compile`` again after a reset. A graph that ran once
is replayed from then on without torch.compile's wrappers (``DirectStep``), so it keeps
running after a reset.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from mpk.errors import BadInputError, MpkError, OptionError
from mpk.llm.config import is_count
from mpk.llm.kv_cache import PagedKVCache, PageTable
from mpk.llm.model import LOGITS, DecoderLM
from mpk.llm.staging import PinnedWriter

# A decode step whose longest sequence is this many positions past the median runs as a ragged
# step: the decode form splits every sequence into the same chunks, so the long one's tasks set
# the attention stage's time, while the ragged form spreads it by the balanced split
# (mpk.ops.paged: attn_plan) at a fixed cost (a separate RoPE stage, the plan, the merge).
# Measured on an H200 beside 15 sequences of 512 (benchmarks/prefill_latency.py: skew16,
# even16): the ragged step is 1.3–1.8× faster with one sequence of 16,384, 0.71–0.77× with
# none; the break-even, by those two, lies 3–5k positions past the others.
SKEW_POSITIONS = 4096


def skewed(lens: np.ndarray) -> bool:
    """Whether sequences of lengths ``lens`` are skewed enough for the balanced split to pay."""
    return len(lens) > 1 and int(lens.max()) - int(np.median(lens)) >= SKEW_POSITIONS


def default_buckets(max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, … below ``max_num_batched_tokens``, then ``max_num_batched_tokens`` itself."""
    if not is_count(max_num_batched_tokens, 1):
        raise OptionError(f"max_num_batched_tokens={max_num_batched_tokens!r}; expected an int ≥ 1")
    sizes, t = [], 1
    while t < max_num_batched_tokens:
        sizes.append(t)
        t *= 2
    return sizes + [max_num_batched_tokens]


@dataclass
class CompileReport:
    """What ``TokenBuckets.compile`` did: the graphs it traced ("decode" or "T=<rows>") with the
    seconds each took (Dynamo, AOTAutograd, mpk's compiler), and the seconds of the kernels'
    parallel nvcc build (0 for the CPU interpreter, which builds nothing); ``digests``: each
    graph's tables' SHA-256 without the rank (``Tables.rank_free_digest``: the ranks of a
    tensor-parallel job compare them)."""

    trace_s: dict[str, float] = field(default_factory=dict)
    build_s: float = 0.0
    digests: dict[str, str] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.trace_s.values()) + self.build_s

    def __str__(self) -> str:
        return (f"{len(self.trace_s)} graphs traced in {sum(self.trace_s.values()):.1f} s, kernels built in "
                f"{self.build_s:.1f} s: {self.total_s:.1f} s")


def _recompile_error(e: RuntimeError) -> bool:
    return "fail_on_recompile" in str(e)


class TokenBuckets:
    """``model`` compiled for steps of up to ``max_num_batched_tokens`` new tokens over ``cache``
(its batch and table tensors: ``step`` grows a ``PagedKVCache``; ``run`` takes a table its
caller wrote).

    ``buckets``: the row counts compiled (default ``default_buckets(max_num_batched_tokens)``;
    given, ``max_num_batched_tokens`` defaults to their largest); ``decode``: also compile the
    decode form for steps of one token per sequence. ``logits``: "last" (each sequence's last
    new token, [batch, vocab]) or "all" (every new token's, [tokens, vocab]). ``options``: mpk's
    compile options. ``eager``: run the model in PyTorch instead, same buckets and padding (a
    reference for tests; nothing compiles). ``compile`` runs at the first ``step`` if not called.
    """

    def __init__(self, model: DecoderLM, cache: PageTable, max_num_batched_tokens: int | None = None,
                 buckets: Sequence[int] | None = None, decode: bool = True, logits: str = "last",
                 options: dict | None = None, eager: bool = False):
        if buckets is None:
            if max_num_batched_tokens is None:
                raise OptionError("TokenBuckets: expected max_num_batched_tokens or buckets (the step sizes to "
                                  "compile)")
            buckets = default_buckets(max_num_batched_tokens)
        sizes = sorted(set(buckets)) if all(is_count(b, 1) for b in buckets) else []
        if not sizes:
            raise OptionError(f"buckets={list(buckets)!r}; expected row counts, ints ≥ 1")
        if max_num_batched_tokens is not None and max_num_batched_tokens != sizes[-1]:
            raise OptionError(f"max_num_batched_tokens={max_num_batched_tokens!r} with buckets {sizes}; expected "
                              "the largest bucket (or leave one of them out)")
        if logits not in LOGITS:
            raise OptionError(f"logits={logits!r}; expected one of {LOGITS}")
        self.model, self.cache, self.buckets, self.decode, self.logits = model, cache, sizes, decode, logits
        device = model.embed.device
        # fixed token buffers, one per graph: a launch whose arguments keep their addresses
        # skips the GPU executor's full bind
        self._tokens = {T: torch.zeros(T, dtype=torch.long, device=device) for T in sizes}
        self._decode_tokens = torch.zeros(cache.batch, dtype=torch.long, device=device)
        self._writers = {key: PinnedWriter(buf) for key, buf in [*self._tokens.items(), ("decode", self._decode_tokens)]}
        self._run: Callable = model if eager else torch.compile(
            model, backend="mpk", fullgraph=True, dynamic=False, options=dict(options or {}))
        self.eager, self.report = eager, None
        self._compiled: dict[int | str, object] = {}  # graph key (T or "decode") → its CompiledGraph
        self._direct: dict[int | str, DirectStep | None] = {}

    @property
    def max_tokens(self) -> int:
        """The most new tokens one step takes (the largest bucket)."""
        return self.buckets[-1]

    def bucket(self, tokens: int) -> int:
        """The rows of the graph a step of ``tokens`` new tokens runs: the smallest bucket ≥ it."""
        i = int(np.searchsorted(self.buckets, tokens))
        if not is_count(tokens, 1) or i == len(self.buckets):
            raise BadInputError(f"a step of {tokens!r} new tokens; expected 1…{self.max_tokens} (the largest bucket: "
                                "split the work into chunks, or compile a larger bucket)")
        return self.buckets[i]

    def compile(self, progress: bool | None = None) -> CompileReport:
        """Trace every graph (the buckets, then the decode form), then build their kernels in
        parallel into the cubin cache (GPU executor); a progress bar per phase on stderr
        (``progress``: default when stderr is a terminal). Nothing runs and the cache is not
        written. Returns the times, also kept as ``report``."""
        from tqdm import tqdm

        from mpk.backend import TracedOnly, trace_only

        report = CompileReport()
        if self.eager:
            self.report = report
            return report
        ragged = {"qo_indptr": self.cache.qo_indptr, "logits": self.logits}
        graphs = [(T, self._tokens[T], ragged) for T in self.buckets]
        if self.decode:
            graphs.append(("decode", self._decode_tokens, {}))
        compiled = []
        self._direct.clear()
        limit = torch._dynamo.config.recompile_limit + len(graphs)  # headroom over entries other compiles hold
        with torch._dynamo.config.patch(recompile_limit=limit), torch.no_grad(), trace_only(), \
                tqdm(graphs, desc="tracing", unit="graph", disable=None if progress is None else not progress) as bar:
            for name, tokens, extra in bar:
                start = time.perf_counter()
                try:
                    self._run(tokens, *self.cache.args(), **extra)
                except TracedOnly as traced:
                    compiled.append(traced.compiled)
                    self._compiled[name] = traced.compiled
                    report.digests[_graph_name(name)] = traced.compiled.tables.rank_free_digest()
                else:
                    raise MpkError(f"TokenBuckets: the {_graph_name(name)} graph ran instead of being traced; expected "
                                   "the mpk backend (did options select another?)")
                report.trace_s[_graph_name(name)] = time.perf_counter() - start
        report.build_s = build_kernels(compiled, progress)
        self.report = report
        return report

    def step(self, new_tokens: Sequence[Sequence[int] | torch.Tensor]) -> torch.Tensor:
        """Append ``new_tokens[b]`` (token ids; empty: none) to sequence b of the cache (a
        ``PagedKVCache``) and run one step over them: the decode form when every sequence has
        one, else the smallest bucket that holds them all. Returns the logits: "last": [batch,
        vocab], row b the logits after sequence b's last new token (a sequence with none: a
        meaningless row); "all": [tokens, vocab], the new tokens in sequence order."""
        if not isinstance(self.cache, PagedKVCache):
            raise MpkError("step() grows a PagedKVCache; over another page table, write it and call run()")
        if len(new_tokens) != self.cache.batch:
            raise BadInputError(f"step() got tokens for {len(new_tokens)} sequences; expected one list per sequence "
                                f"of the cache ({self.cache.batch}; empty for a sequence with none)")
        ids = [[int(t) for t in (seq.tolist() if isinstance(seq, torch.Tensor) else seq)] for seq in new_tokens]
        counts = [len(s) for s in ids]
        vocab = self.model.cfg.vocab
        bad = next(((b, t) for b, s in enumerate(ids) for t in s if not 0 <= t < vocab), None)
        if bad is not None:  # checked before the cache grows: a refused step changes nothing
            raise BadInputError(f"token id {bad[1]} of sequence {bad[0]} is outside the embedding table's {vocab} "
                                f"rows [0, {vocab})")
        if not self._decodes(counts):
            self.bucket(sum(counts))  # before growing: a refused step changes nothing
        if self.report is None:
            self.compile()
        self.cache.grow(counts)
        return self.run([t for s in ids for t in s], counts)

    def _decodes(self, counts: Sequence[int]) -> bool:
        """Whether a step runs the decode form: one token for every sequence of the table, and
        lengths not so skewed that the ragged form's balanced split pays (``skewed``)."""
        return (self.decode and len(counts) == self.cache.batch and all(k == 1 for k in counts)
                and not (self.buckets[-1] >= len(counts) and skewed(self.cache.step_lens)))

    def run(self, tokens: Sequence[int] | np.ndarray, counts: Sequence[int]) -> torch.Tensor:
        """Run one step over the table as its caller wrote it: ``counts[b]`` new tokens of
        sequence b (the table's rows in order, the rest none), ``tokens`` theirs in sequence
        order (ids already checked against the vocabulary). The decode form when every row of
        the table has one, else the smallest bucket; returns the logits as ``step`` does."""
        total = int(sum(counts))
        if len(tokens) != total:
            raise BadInputError(f"run() got {len(tokens)} tokens for new-row counts summing to {total}")
        if self._decodes(counts):
            key, buf, extra = "decode", self._decode_tokens, {}
        else:
            key = self.bucket(total)
            buf, extra = self._tokens[key], {"qo_indptr": self.cache.qo_indptr, "logits": self.logits}
        if self.report is None:
            self.compile()
        host = self._writers[key].host()
        host[:total] = tokens
        host[total:] = 0  # padding rows: token 0
        self._writers[key].flush()
        with torch.no_grad():
            direct = self._direct.get(key)
            if direct is not None and direct.valid():
                out = direct()
            else:
                out = self._traced_call(counts, buf, extra)
                self._direct[key] = DirectStep.capture(self._compiled.get(key), self.model)
        return out[:total] if self.logits == "all" else out  # (the decode form's rows: one per token)

    def _traced_call(self, counts: Sequence[int], buf: torch.Tensor, extra: dict) -> torch.Tensor:
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._run(buf, *self.cache.args(), **extra)
        except RuntimeError as e:
            if not _recompile_error(e):
                raise
            raise MpkError(f"a step of {list(counts)} new tokens would compile a new graph (after torch._dynamo.reset() "
                           "or torch.compiler.reset(), which drop every bucket's graph?); expected the graphs "
                           "compile() made: call compile() again") from e


def build_kernels(compiled: Sequence, progress: bool | None = None) -> float:
    """Build the kernels of the ``compiled`` graphs meant for the GPU executor together
    (parallel nvcc into the cubin cache); the seconds it took (0 when none is)."""
    gpu = [c for c in compiled if c is not None and c.tables.meta["options"].get("executor") == "gpu"]
    if not gpu:
        return 0.0
    from mpk.executors import build
    from mpk.executors.codegen import generate

    start = time.perf_counter()
    build.prebuild([generate(c.tables) for c in gpu], progress=progress)
    return time.perf_counter() - start


def _graph_name(key: int | str) -> str:
    return key if isinstance(key, str) else f"T={key}"


@dataclass
class DirectStep:
    """A graph's launch replayed without torch.compile's wrappers (Dynamo's guards and
    AOTAutograd's runtime wrapper: about a third of a decode step's host time): the mpk runner
    called with the arguments of its last launch, which are the same tensors every step (the
    buckets' token buffers, the page table, the cache, the model's parameters and buffers).
    Valid while the model's parameters and buffers keep their addresses (``valid``; else the
    step goes through torch.compile, which rebinds, and is captured again). The graph's outputs
    are the logits and the mutated cache as a view of itself (the wrapper's copy of it onto
    itself does nothing): a call returns the logits."""

    runner: Callable
    args: list
    output: int
    model: DecoderLM
    addresses: tuple[int, ...]

    @classmethod
    def capture(cls, compiled, model: DecoderLM) -> DirectStep | None:
        """The step of ``compiled`` as its last launch ran it; None where there is none to replay
        (not compiled by mpk, no launch recorded, a tensor-parallel rank's graph, or outputs
        other than the logits)."""
        from mpk.backend import RUNNERS, last_args

        runner = RUNNERS.get(id(compiled)) if compiled is not None else None
        # a rank's runner takes the full model's arguments, its last launch the shard's
        if runner is None or "args" not in getattr(runner, "state", {}) or compiled.sharded is not None:
            return None
        graph = compiled.graph
        inputs = {b.id for b in graph.inputs}
        own = [i for i, o in enumerate(graph.outputs) if o.view is not None and o.view.buffer not in inputs]
        if len(own) != 1:
            return None
        return cls(runner, last_args(runner), own[0], model, _addresses(model))

    def valid(self) -> bool:
        return _addresses(self.model) == self.addresses

    def __call__(self) -> torch.Tensor:
        return self.runner(*self.args)[self.output]


def _addresses(model: DecoderLM) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def prefill(steps: TokenBuckets, prompts: Sequence[Sequence[int]], chunk: int | None = None) -> torch.Tensor:
    """Append ``prompts[b]`` to sequence b of ``steps``' cache (one prompt per sequence; empty:
    none), ``chunk`` tokens per step at most (None: the largest bucket, so a prompt that fits
    runs in one step), taken first come first served: the earlier sequences' prompts fill a
    step before the later ones start. Returns [batch, vocab]: row b the logits after the last
    token of ``prompts[b]`` (zeros for an empty prompt)."""
    limit = steps.max_tokens if chunk is None else chunk
    if not is_count(limit, 1) or limit > steps.max_tokens:
        raise OptionError(f"chunk={chunk!r}; expected None or 1…{steps.max_tokens} (the largest bucket)")
    if len(prompts) != steps.cache.batch:
        raise BadInputError(f"prefill() got {len(prompts)} prompts; expected one per sequence of the cache "
                            f"({steps.cache.batch}; empty for a sequence with none)")
    prompts = [list(p) for p in prompts]
    done = [0] * len(prompts)
    out: torch.Tensor | None = None
    while any(d < len(p) for d, p in zip(done, prompts)):
        budget, batch = limit, []
        for b, p in enumerate(prompts):
            take = min(len(p) - done[b], budget)
            batch.append(p[done[b]: done[b] + take])
            budget -= take
        logits = steps.step(batch)
        if out is None:
            out = logits.new_zeros(len(prompts), logits.shape[-1])
        ends = np.cumsum([len(s) for s in batch])
        for b, s in enumerate(batch):
            done[b] += len(s)
            if s and done[b] == len(prompts[b]):  # the prompt's last token was in this step
                out[b] = logits[b] if steps.logits == "last" else logits[ends[b] - 1]
    if out is None:
        raise BadInputError("prefill() got only empty prompts; expected at least one token")
    return out
