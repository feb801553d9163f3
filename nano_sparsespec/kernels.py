"""The fast path's kernels: torch.compile'd pieces swapped into the eager path's tables.

Same math as the eager path (attention.py), switched on from outside (`LLM(compile=True)`,
`--compile`): `compile_fast_path` swaps compiled versions into attention.py's, lookup.py's and
pillar_attn.py's kernel tables, paged.py's pieces, the model's elementwise table and the
verifier's sampling table.

Owns
  * `compile_kernels`: compiled K/V write, PillarAttn score pass, draft branch, pillar-lookup's
    draft columns (each draft's lists, then one pass over its critical positions), the draft
    buffers' fill (one copy kernel), the selection's keys (one pass over the scores, not five)
    and, with `paged` (a GPU with CUDA graphs), its re-ranking and paged.py's kernel, where
    dense decoding and verification read the pool in place, scores come from swapped_scores.py's
    pass, and drafts read their draft-buffer rows in place through flex_drafts.py.
    `paged.paged_dense` runs three pieces, each compiled as a whole graph (a graph break's
    resume function recompiles).
  * `compile_elementwise`: the model's norms (a row reduced in one pass: one kernel a norm),
    RoPE and SiLU, fused, for static sizes but the token rows.
  * `compile_sampling`: draft sampling and verification, fused, the vocabulary a constant
    (`vocabulary_static`) and the probabilities computed again in each reader, not stored.
  * `sizes_apart`, `compiled_apart`: compiled functions traced without duck sizing.
  * `use_eager_kernels` (the reference) and `use_paged_reference` (paged.py's kernel with
    uncompiled flex_attention: torch's reference implementation over the whole pool, which the
    CPU tests run on tiny pools).

Must not change what the eager path computes, or shape it.
"""
from __future__ import annotations

import functools

import torch
from torch.fx.experimental import _config as shapes_config

from . import attention, lookup, model, pillar_attn, verifier
from . import paged as paged_kernel
from .attention import as_words
from .flex_drafts import drafts_by_reading, flex_drafts
from .paged import PAGED_PIECES, SMALL_BATCH, _paged, paged_attend, paged_dense, paged_prepare
from .pillar_attn import pillar_scores
from .swapped_scores import score_inputs, score_pass


# The paged kernel's merge of S chunks (`paged.merge_chunks`) reads 2S + 1 inputs an element in
# one chain of sums; past its default limits the compiler stores intermediate sums in buffers of
# their own, in more kernels (slower from 4 chunks on: BENCHMARKS.md).
ONE_KERNEL_MERGE = {"realize_acc_reads_threshold": 1000, "realize_reads_threshold": 1000,
                    "realize_opcount_threshold": 1000}


def compile_fast_path(device: torch.device, cuda_graphs: bool, exact: bool = False,
                      dense_batch: int = 2) -> None:
    """What `LLM(compile=True)` switches on for every model in this process: the compiled
    attention kernels (on a GPU with CUDA graphs, the paged kernel, with `exact` rows; its
    smallest batch class holds `dense_batch` requests, the usual step's), the layers' fused
    elementwise pieces, and fused sampling and verification."""
    from .embedded import use_project_compile_cache
    paged_kernel.set_smallest_kernel_batch(dense_batch)
    use_project_compile_cache()
    compile_kernels(paged=device.type == "cuda" and cuda_graphs, exact=exact)
    compile_elementwise()
    compile_sampling()


def compile_kernels(paged: bool = False, exact: bool = False) -> None:
    """Swap torch.compile'd versions into attention.py's, lookup.py's and pillar_attn.py's kernel
    tables: the score pass, draft branch and the selection's keys (dynamic shapes; float tolerance),
    pillar-lookup's draft columns (two pieces, static but for the drafts, columns, width and
    context), the K/V write and the draft buffers' fill (`compile_store`, `compile_fill`); with
    `paged` the selection's re-ranking and the paged dense path: its attention for static shapes
    (flex_attention's decoding kernel wants them: one compilation per batch class, query rows and
    chunks), the swapped score pass and its inputs for a dynamic batch and context (padded steps
    have at least two requests: torch specialises sizes 0 and 1), and the drafts' attention in place
    (`flex_drafts`) for static buffer rows. With `exact`, a verification row gets its decode row's
    bits."""
    paged_kernel.exact_rows = paged and exact
    kernels = attention._kernels
    kernels["store"] = compile_store()
    kernels["scores"] = torch.compile(pillar_scores, dynamic=True)
    kernels["sparse"] = compiled_apart(attention.sparse_drafts)
    # pillar-lookup's draft columns, in two pieces: drafts, columns, selection width and context
    # dynamic; layers, KV heads and buffer rows constants (symbolic ones: a division per index).
    # lookup_lists(seen, rows, selection_len, selection_start, context_tokens, tokens, verified,
    # prev_tokens, matches); lookup_columns(beyond, selection, rows, selection_len, found_at,
    # found_valid, column_rank)
    lists_dynamic = {0: (0, 1), 4: (1,)} | {i: (0,) for i in (1, 2, 3, 5, 6, 7)}
    columns_dynamic = {0: (0, 1), 1: (3,), 6: (0, 1)} | {i: (0,) for i in (2, 3, 4, 5)}
    lookup._kernels.update(lists=sizes_apart(_static_but(lookup.lookup_lists,
                                                                  lists_dynamic)),
                           columns=sizes_apart(_static_but(lookup.lookup_columns,
                                                                    columns_dynamic)))
    kernels["fill"] = compile_fill()
    pillar_attn._kernels["keys"] = compiled_apart(pillar_attn.selection_keys)
    if paged:
        # (torch's CPU compiler makes the re-ranking's scatters and scans slower than eager ones)
        pillar_attn._kernels["merge"] = compiled_apart(pillar_attn.merge_ranked)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        # paged_attend(out, q, q_index, ...): token rows T dynamic, and a small dense batch;
        # score_inputs(q, q_index, k_layer, block_table, block_size, score_weight, lse) and
        # score_pass(scores, keys, rows, shift, q_start, Q): T, batch and context dynamic
        _paged.update(attend=_static_but(paged_attend, {0: (0,), 1: (0,)}, small_batch_arg=2,
                                         options=ONE_KERNEL_MERGE),
                      score_inputs=_static_but(score_inputs, {0: (0,), 1: (0,), 3: (0, 1),
                                                              5: (0,), 6: (0,)}),
                      score_pass=_static_but(score_pass, {0: (0, 2), 1: (0, 2), 2: (0,),
                                                          3: (0,), 4: (0,)}))
        # drafts reading their rows in place (flex_drafts.py): T, Bs and the columns N dynamic
        rows_dynamic = {i: (0,) for i in (0, 1, 2, 3, 6, 7, 8, 9)}
        in_place = sizes_apart(_static_but(flex_drafts, rows_dynamic | {10: (2,)}))
        kernels.update(paged=paged_dense, prepare=paged_prepare,
                       sparse=drafts_by_reading(kernels["sparse"], in_place))


# The token-row arguments of the model's elementwise pieces (`compile_elementwise`)
ELEMENTWISE_ROWS = {"rms_norm": (0,), "add_rms_norm": (0, 1), "apply_rope": (0, 1, 2),
                    "silu_mul": (0,)}


def compile_elementwise() -> None:
    """Swap torch.compile'd (fused) versions into the model's elementwise table (norms, RoPE,
    SiLU), equal up to float rounding: static sizes but the token rows (`_static_but`), so a
    step's row count recompiles nothing and no element's index needs a runtime division. The
    norms reduce a row in one pass (`one_pass_mean_of_squares`)."""
    pieces = dict(model._eager_ops)
    for name in ("rms_norm", "add_rms_norm"):
        pieces[name] = functools.partial(pieces[name], mean_sq=one_pass_mean_of_squares)
    model._ops.update({name: _static_but(fn, {i: (0,) for i in ELEMENTWISE_ROWS[name]})
                       for name, fn in pieces.items()})


def one_pass_mean_of_squares(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> mean of x^2 over the last dimension [..., 1], in one reduction. Compiled into
    a norm, the reduction and the scaling become one kernel (the eager reference's fixed chunks,
    summed in order, take three); that kernel, compiled once for every row count, reduces each
    row alike whatever the rows beside it."""
    return x.pow(2).mean(-1, keepdim=True)


def _static_but(fn, dynamic_dims: dict[int, tuple[int, ...]], small_batch_arg: int | None = None,
                options: dict | None = None):
    """`fn` compiled for static shapes but the dims `dynamic_dims` names (argument index ->
    dims): sizes that vary from step to step (token rows, which also count a step's sparse drafts;
    batch; context) do not recompile it, while the pool's and the heads' sizes stay constants of
    the kernel (symbolic ones there make every index a runtime division). With `small_batch_arg`,
    that argument's dim 0 (a dense batch) is dynamic too where it is at most SMALL_BATCH: the paged
    kernel attends such a batch padded to a static size (`kernel_batch`).
    Each tensor goes in as a fresh view (`detach`): the output of another compiled function
    carries that function's dynamic dims, which would override the static ones here. `options`:
    the compiler's settings for `fn` alone."""
    compiled = torch.compile(fn, dynamic=False, options=options)

    def run(*args):
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        for i, dims in dynamic_dims.items():
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(args[i], dim)
        if small_batch_arg is not None and args[small_batch_arg].shape[0] <= SMALL_BATCH:
            torch._dynamo.maybe_mark_dynamic(args[small_batch_arg], 0)
        return compiled(*args)
    return run


def compile_store():
    """`attention.store_kv`, compiled as `compile_fill` is: the pool's, heads' and buffers' sizes
    constants, the rows moved as integer words (`as_words`); the step's token rows and window
    writes dynamic. Two compilations: with and without the window writes."""
    pool_only = _static_but(attention.store_kv, {2: (0,), 3: (0,), 4: (0,)})
    with_window = sizes_apart(
        _static_but(attention.store_kv, {i: (0,) for i in (2, 3, 4, 7, 8, 9)}))

    def store(k_layer, v_layer, slots, k, v, *window) -> None:
        pool = (*(as_words(x) for x in (k_layer, v_layer)), slots, as_words(k), as_words(v))
        if not window:
            return pool_only(*pool)
        draft_k, draft_v, tokens, rows, columns = window
        with_window(*pool, as_words(draft_k), as_words(draft_v), tokens, rows, columns)
    return store


def compile_fill():
    """`attention.fill_draft_buffers`, compiled with the pool's, heads' and buffers' sizes as
    constants (symbolic ones make each element's index a chain of runtime divisions), on the rows'
    integer words (`as_words`: a bfloat16 row of 64 moves as 16 words, each element's index math
    done once per word). A batch or a list of one position is given twice (the same copies again),
    a table of one block gets a second column (unread): torch would specialise a size of 1 (and
    an index tensor's offset: one with an offset goes in as a copy). So two compilations serve a
    run: positions per layer and KV head (a selection), and positions shared by all (a pending
    draft's, lookup)."""
    # batch, table width and positions per row dynamic
    compiled = sizes_apart(_static_but(attention.fill_draft_buffers,
                                                {4: (0, 1), 6: (0, 3), 7: (0,), 8: (0, 1)}))

    def fill(k_cache, v_cache, draft_k, draft_v, block_table, block_size: int, positions, rows,
             columns) -> None:
        if positions.shape[-1] == 1:
            positions, columns = positions.repeat(1, 1, 1, 2), columns.repeat(1, 2)
        block_table, rows = (x.clone() if x.storage_offset() else x for x in (block_table, rows))
        if block_table.shape[1] == 1:
            block_table = block_table.repeat(1, 2)
        if positions.shape[0] == 1:
            block_table, positions = block_table.repeat(2, 1), positions.repeat(2, 1, 1, 1)
            rows, columns = rows.repeat(2), columns.repeat(2, 1)
        compiled(*(as_words(x) for x in (k_cache, v_cache, draft_k, draft_v)), block_table,
                 block_size, positions.contiguous(), rows, columns.contiguous())
    return fill


def use_eager_kernels() -> None:
    paged_kernel.exact_rows = False
    paged_kernel.set_smallest_kernel_batch(2)
    attention._kernels.update(attention.EAGER_KERNELS)
    lookup._kernels.update(lookup.EAGER_KERNELS)
    pillar_attn._kernels.update(pillar_attn.EAGER_KERNELS)
    _paged.update(PAGED_PIECES)


def use_paged_reference() -> None:
    """The paged path with uncompiled flex_attention (torch's reference math over the whole pool:
    tiny pools only), so the CPU tests check the block mask that the compiled GPU kernel relies
    on."""
    attention._kernels.update(paged=paged_dense, prepare=paged_prepare,
                              sparse=drafts_by_reading(attention.sparse_drafts, flex_drafts))
    _paged.update(PAGED_PIECES)


def sizes_apart(compiled):
    """A compiled function traced without duck sizing: dynamo gives sizes that are equal when it
    traces one symbol (a step of drafts alone has as many token rows as the draft buffers have
    rows; the draft logits' storage offset, the checks' rows before them, may be one row of the
    vocabulary), and the next step, where they differ, would compile it again."""
    def run(*args):
        # as `shapes_config.patch(use_duck_shape=False)`, at a fourth of its host time
        duck, shapes_config.use_duck_shape = shapes_config.use_duck_shape, False
        try:
            return compiled(*args)
        finally:
            shapes_config.use_duck_shape = duck
    return run


def compiled_apart(fn, options: dict | None = None):
    """`fn` compiled for dynamic shapes, traced without duck sizing (`sizes_apart`); `options`:
    the compiler's settings for `fn` alone."""
    return sizes_apart(torch.compile(fn, dynamic=True, options=options))


# The compiler stores an elementwise result that several readers share once it reads more than a
# few inputs; the probabilities (`distribution`) are cheap to compute again in each reader, and a
# stored copy is a write and a read of [rows, V].
RECOMPUTE_PROBS = {"realize_reads_threshold": 1000, "realize_opcount_threshold": 1000}


def vocabulary_static(fn, *vocab_args: int):
    """`fn` as `compiled_apart` compiles it (with `RECOMPUTE_PROBS`), but for the last dim of its
    arguments `vocab_args` (indices; a missing tensor is skipped): the vocabulary stays a constant
    of the kernels (a symbolic one makes every element's index a runtime division)."""
    compiled = compiled_apart(fn, RECOMPUTE_PROBS)

    def run(*args):
        for i in vocab_args:
            if args[i] is not None:
                torch._dynamo.mark_static(args[i], args[i].dim() - 1)
        return compiled(*args)
    return run


def compile_sampling() -> None:
    """Swap torch.compile'd (fused) draft sampling and verification into verifier.py's table."""
    verifier._fused["drafts"] = vocabulary_static(verifier._sample_drafts, 0, 3)  # logits, store
    verifier._fused["verify"] = vocabulary_static(verifier._verify_logits, 0, 2)  # logits, q
