"""Known-wrong MoE lab submissions (lab 06), and what the grader must say about each.

Each is solutions/06_moe_lab.ipynb with one edit a student might make, as a `Submission` of
tests/grader_corpus_lab01.py: `cells` holds the edited solution cells by grade_id, `expect` the
status and a phrase of the message per graded function on a GPU, `cpu` what the interpreter shows
where it differs, `gpu_only` why, and `diagnosis` what the message must also say. An edit names text
of the solution that must occur exactly once, so a change to the solution cannot quietly turn a
mistake into a no-op.
"""

from __future__ import annotations

from grading.notebooks import SOLUTIONS_DIR
from tests.grader_corpus_lab01 import PASS, SolutionCells, Submission, course_module_as

NOTEBOOK = SOLUTIONS_DIR / "06_moe_lab.ipynb"
SOLUTION = SolutionCells(NOTEBOOK)
SOLUTION_CELLS, edit, solve_with = SOLUTION.cells, SOLUTION.edit, SOLUTION.solve_with


def fails(function: str, phrase: str) -> dict[str, tuple[str, str]]:
    return {function: ("fail", phrase)}


GRADED = ("route_topk", "permute", "grouped_gemm", "grouped_gemm_swiglu")
CACHED_GEMM = """
_CACHE = {}


def grouped_gemm(x, w, sorted_ids, tile_expert, top_k, out=None):
    key = (tuple(x.shape), tuple(w.shape), sorted_ids.numel())
    if key not in _CACHE:
        _CACHE[key] = launch_grouped_gemm(x, w, w, sorted_ids, tile_expert, top_k, None,
                                          swiglu=False)
    return _CACHE[key] if out is None else out.copy_(_CACHE[key])"""

CORPUS: dict[str, Submission] = {
    # ---- mistakes of the router and the grouped GEMM ---------------------------------------------
    "forgets_renormalization": Submission(
        edit(
            "route_topk",
            "weights = chosen_p / tl.sum(chosen_p, axis=1)[:, None]",
            "weights = chosen_p",
        ),
        fails(
            "route_topk",
            "first: 1x8x1 float32 top_k=1: weights: shape 1x8x1: 1 of 1 elements wrong",
        ),
        diagnosis="these are the chosen experts' softmax probabilities (token 0's sum to",
    ),
    # n // BLOCK_T programs: tokens 32 to 36 of 37 are never routed
    "drops_last_partial_tile": Submission(
        edit("route_topk", "triton.cdiv(tokens, BLOCK_T)", "max(tokens // BLOCK_T, 1)"),
        fails(
            "route_topk",
            "first: 37x8x2 float32 top_k=2: ids: shape 37x8x2: 10 of 74 elements wrong",
        ),
        diagnosis="wrong for tokens not a multiple of the block (tokens=37, first bad token 32): "
                  "the last 5 tokens "
        "are wrong (never written)",
    ),
    # the padding rows keep what the buffer held (the grader's poison): the GEMM would gather
    # garbage
    "permute_leaves_padding_unwritten": Submission(
        edit(
            "permute",
            '    sorted_ids.fill_(-1)  # padding rows: the GEMM reads -1 as "no token here"\n',
            "",
        ),
        # how many rows are padding depends on BLOCK_M (16 on the CPU, 64 on a GPU): the
        # count is left out
        fails("permute", "first: 1x8x1 int32 experts=8: sorted_ids: shape 1x8x1: "),
        diagnosis="padding rows (past an expert's count in its last tile) must hold -1",
    ),
    # experts back to back: a tile holds the end of one expert and the start of the next
    "permute_does_not_pad": Submission(
        edit(
            "permute", "padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M", "padded = running"
        ),
        fails("permute", "first: 1x8x1 int32 experts=8: padded_offsets: "),
        diagnosis="each expert's rows must start at a multiple of BLOCK_M",
    ),
    # n // BLOCK blocks of assignments: the last, partial one is never counted nor placed. A GPU
    # block holds 2048 of the small cases' assignments: it first fails on 32767 tokens' top-2,
    # 65534 assignments
    "permute_drops_last_block": Submission(
        edit("permute", "blocks = max(1, triton.cdiv(n, block))", "blocks = max(1, n // block)"),
        fails("permute", "first: 32767x32x2 int32 experts=32: counts: "),
        cpu=fails("permute", "first: 37x8x2 int32 experts=8: counts: shape 37x8x2: "),
        diagnosis="the last partial block was dropped; launch cdiv(n, BLOCK) programs and mask "
                  "the last one",
    ),
    # a block's assignments of one expert placed in reverse: every one in its expert's rows, out of
    # order
    "permute_not_stable": Submission(
        edit(
            "permute",
            "rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)",
            "rank = tl.sum((tl.sum(onehot, axis=0)[None, :] - tl.cumsum(onehot, axis=0)) * "
            "onehot, axis=1)",
        ),
        fails("permute", "first: 37x8x2 int32 experts=8: sorted_ids: "),
        diagnosis="every assignment is in its expert's rows, but not in order",
    ),
    # tiles past the last expert's rows get expert E (one past the last) instead of -1
    "permute_tiles_past_the_end_not_marked": Submission(
        edit("permute", "tl.where(expert < experts, expert, -1)", "expert"),
        fails("permute", "first: 1x8x1 int32 experts=8: tile_expert: "),
        diagnosis="tiles past the last expert's rows must hold -1",
    ),
    # as the course's kernel does (its combine never reads them), but the lab asks for zeros
    "gemm_skips_unused_tiles": Submission(
        edit(
            "grouped_gemm",
            "    tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], "
            "acc.to(c_ptr.dtype.element_ty),\n"
            "             mask=cols_ok[None, :])",
            "    if expert >= 0:\n        tl.store(c_ptr + rows[:, None].to(tl.int64) * N + "
            "cols[None, :], "
            "acc.to(c_ptr.dtype.element_ty), mask=cols_ok[None, :])",
        ),
        fails("grouped_gemm", "first: 37x8x2x80x96 bfloat16 top_k=2: "),
        diagnosis="was never written; a program whose tile has expert -1 must still store its "
                  "zeros",
    ),
    # the padding rows gather token 0 (their index is clamped, their loads not masked): nonzero rows
    "gemm_ignores_padding_rows": Submission(
        edit("grouped_gemm", "mask=real[:, None] & k_ok[None, :]", "mask=k_ok[None, :]"),
        fails("grouped_gemm", "first: 37x8x2x80x96 bfloat16 top_k=2: shape 37x8x2x80x96: "),
        diagnosis="padding rows (sorted_ids == -1) must be 0, so that whatever reads whole tiles",
    ),
    # N // BLOCK_N column tiles: on the CPU (BLOCK_N 64) columns 64 to 95 are never written; on a
    # GPU (BLOCK_N 128) no column tile is launched at all
    "gemm_drops_last_column_tile": Submission(
        edit("grouped_gemm", "tiles * triton.cdiv(n, BLOCK_N)", "tiles * (n // BLOCK_N)"),
        fails(
            "grouped_gemm",
            "first: 37x8x2x80x96 bfloat16 top_k=2: shape 37x8x2x80x96: "
            "55296 of 55296 elements wrong",
        ),  # 9 tiles of 64 rows, every element
        cpu=fails(
            "grouped_gemm",
            "columns 64 to 95 of N=96 are wrong: the last column tile is never written",
        ),
    ),
    # a sanity check that reads a count on the host: a sync the op watcher sees, in both modes
    "host_item_sync": Submission(
        edit(
            "permute",
            "    return counts, padded_offsets",
            "    assert padded_offsets[-1].item() <= sorted_ids.numel()\n    return counts, "
            "padded_offsets",
        ),
        fails(
            "permute",
            "reads a tensor's value on the host inside the call (Tensor.item "
            "(aten._local_scalar_dense.default)): a host synchronization",
        ),
    ),
    # the same check through .tolist(), which PyTorch runs without dispatching an op: the function
    # watcher names it (once only the GPU's CUDA-graph capture saw it)
    "host_tolist_sync": Submission(
        edit(
            "permute",
            "    return counts, padded_offsets",
            "    assert padded_offsets.tolist()[-1] <= sorted_ids.numel()\n    return counts, "
            "padded_offsets",
        ),
        fails("permute", "reads a tensor's value on the host inside the call (Tensor.tolist): a "
                         "host synchronization"),
    ),
    # ---- the generic mistakes of every lab, where they are cheap here ----------------------------
    "calls_torch_softmax_and_topk": Submission(
        solve_with(
            "route_topk",
            "top_p, top = torch.softmax(logits.float(), dim=1).topk(top_k, dim=1)\n"
            "ids.copy_(top)\nweights.copy_(top_p / top_p.sum(dim=1, keepdim=True))",
        ),
        fails(
            "route_topk",
            "computes with PyTorch instead of its own kernel: torch.softmax "
            "(aten._softmax.default)",
        ),
    ),
    "calls_the_reference_permutation": Submission(
        solve_with(
            "permute",
            "from kernels.moe.triton_permute import permute_reference\n"
            "reference = permute_reference(ids, experts, BLOCK_M)\n"
            "for mine, name in zip(out, ('counts', 'padded_offsets', 'sorted_ids', 'tile_expert', "
            "'row_of')):\n    mine.copy_(getattr(reference, name))",
        ),
        fails("permute", "computes with PyTorch instead of its own kernel: torch.bincount"),
    ),
    "calls_the_course_kernel": Submission(
        solve_with(
            "grouped_gemm_swiglu",
            "from kernels.moe import triton_grouped_gemm\n"
            "from kernels.moe.triton_permute import Permutation\n"
            "perm = Permutation(None, None, sorted_ids, tile_expert, None, BLOCK_M, top_k)\n"
            "return out.copy_(triton_grouped_gemm.gate_up_swiglu(x, w_gate, w_up, perm))",
        ),
        fails(
            "grouped_gemm_swiglu",
            "launches the course's kernel instead of its own (write the kernel in the "
            "notebook): kernels.moe.triton_grouped_gemm.grouped_gemm_kernel",
        ),
    ),
    # the same kernel from the course's file, loaded again as a module of another name
    "course_kernel_under_another_name": Submission(
        solve_with(
            "grouped_gemm_swiglu",
            course_module_as("kernels.moe.triton_grouped_gemm", "my_gemm") + "\n"
            "from kernels.moe.triton_permute import Permutation\n"
            "perm = Permutation(None, None, sorted_ids, tile_expert, None, BLOCK_M, top_k)\n"
            "return out.copy_(my_gemm.gate_up_swiglu(x, w_gate, w_up, perm))",
        ),
        fails(
            "grouped_gemm_swiglu",
            "launches the course's kernel instead of its own (write the kernel in the "
            "notebook): kernels.moe.triton_grouped_gemm.grouped_gemm_kernel",
        ),
    ),
    "caches_outputs": Submission(
        edit(
            "grouped_gemm",
            '''

def grouped_gemm(x, w, sorted_ids, tile_expert, top_k, out=None):
    """c (rows, N): row r = x[sorted_ids[r] // top_k] @ w[tile_expert[r // BLOCK_M]].T, 0 '''
            '''where sorted_ids[r]
    is -1; one launch over every expert's tiles."""
    return launch_grouped_gemm(x, w, w, sorted_ids, tile_expert, top_k, out, swiglu=False)''',
            CACHED_GEMM,
        ),
        fails(
            "grouped_gemm",
            "first: 37x8x2x80x96 bfloat16 top_k=2: called again with new values in the same input "
            "buffers: returned the previous call's result for new inputs",
        ),
    ),
    # the probabilities written over the logits, "to save a buffer"
    "mutates_its_input": Submission(
        edit(
            "route_topk",
            "    probs = z / tl.sum(z, axis=1)[:, None]\n",
            "    probs = z / tl.sum(z, axis=1)[:, None]\n"
            "    tl.store(logits_ptr + t[:, None].to(tl.int64) * stride_t + e[None, :], probs, "
            "mask=t_ok[:, None] & e_ok[None, :])\n",
        ),
        fails("route_topk", "first: 1x8x1 float32 top_k=1: modified its input logits"),
    ),
    # the control: the solution itself
    "solution": Submission({}, {name: PASS for name in GRADED}),
}


# --------------------------------------------------------------------------------------------------
# Wrong submissions that every fixed case lets through, caught by the class of cases drawn per run
# (grading.labs.lab06_moe: draw_router_cases, draw_permute_cases, draw_gemm_cases): name ->
# (the edited cells, the function, the index of the class among its drawn cases, what the grader
# says there).
DRAWN_CORPUS: dict[str, tuple[dict[str, str], str, int, str]] = {
    # tokens a multiple of the block: the last block of tokens is never routed
    "router_skips_last_full_block": (
        edit(
            "route_topk",
            "triton.cdiv(tokens, BLOCK_T)",
            "triton.cdiv(tokens, BLOCK_T) - (tokens % BLOCK_T == 0)",
        ),
        "route_topk",
        0,
        "the last block of tokens was skipped (tokens=",
    ),
    # tl.arange(0, experts): Triton's ranges must be powers of two
    "router_experts_not_padded": (
        edit("route_topk", "E_PAD=triton.next_power_of_2(experts)", "E_PAD=experts"),
        "route_topk",
        1,
        "arange's range must be a power of 2",
    ),
    # every padded slot stored too: past the last token's top_k, into the grader's guard band
    "router_stores_padded_slots": (
        edit(
            "route_topk",
            "mask = t_ok[:, None] & (slot[None, :] < TOP_K)",
            "mask = t_ok[:, None] & (slot[None, :] < K_PAD)",
        ),
        "route_topk",
        1,
        "wrote past the end of out (ids)",
    ),
    # rows taken to be `experts` apart: wrong for logits in a wider buffer
    "router_rows_at_stride_experts": (
        edit("route_topk", "logits.stride(0)", "experts"),
        "route_topk",
        2,
        "elements wrong",
    ),
    # a number of assignments that is a multiple of the block: the last block never counted
    "permute_skips_last_full_block": (
        edit(
            "permute",
            "blocks = max(1, triton.cdiv(n, block))",
            "blocks = max(1, triton.cdiv(n, block) - (n % block == 0))",
        ),
        "permute",
        0,
        "block was dropped; launch cdiv(n, BLOCK) programs",
    ),
    # E_PAD counts stored for E experts: past the end of counts unless E is a power of two
    "permute_counts_unmasked": (
        edit(
            "permute",
            "tl.store(counts_ptr + e, running, mask=e_ok)",
            "tl.store(counts_ptr + e, running)",
        ),
        "permute",
        1,
        "wrote past the end of out (counts)",
    ),
    # one step of the tile -> expert map: the tiles past the first BLOCK_TILES are left unwritten
    # (a scan that stops after one step of blocks would leave rows unplaced: out-of-bounds stores)
    "permute_tile_map_one_step": (
        edit(
            "permute",
            "for t0 in range(0, tiles, BLOCK_TILES):",
            "for t0 in range(0, tl.minimum(tiles, BLOCK_TILES), BLOCK_TILES):",
        ),
        "permute",
        2,
        "elements wrong",
    ),
    # hidden a multiple of BLOCK_K: the last full step of the K loop is left out
    "gemm_skips_last_full_k_step": (
        edit(
            "grouped_gemm",
            "for k0 in range(0, K, BLOCK_K):",
            "for k0 in range(0, tl.where(K % BLOCK_K == 0, K - BLOCK_K, K), BLOCK_K):",
        ),
        "grouped_gemm",
        0,
        "elements wrong",
    ),
    # token = assignment >> (top_k - 1): right for top-1 and top-2, wrong for top-3 and top-6
    "gemm_gathers_with_a_shift": (
        edit("grouped_gemm", "assignment // TOP_K", "assignment >> (TOP_K - 1)"),
        "grouped_gemm",
        0,
        "elements wrong",
    ),
    # the hidden columns past 1024 never reach the accumulator
    "gemm_hidden_past_1024_ignored": (
        edit(
            "grouped_gemm",
            "for k0 in range(0, K, BLOCK_K):",
            "for k0 in range(0, tl.minimum(K, 1024), BLOCK_K):",
        ),
        "grouped_gemm",
        1,
        "elements wrong",
    ),
}
