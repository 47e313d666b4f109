"""Known-wrong matrix products (lab 02b), and what the grader must say about each.

Each is solutions/02b_matmul_lab.ipynb with one edit a student might make, as a `Submission` of
tests/grader_corpus_lab01.py: `cells` holds the edited solution cells by grade_id, `expect` the
status and a phrase of the message per graded function on a GPU, `cpu` what CPU mode shows where it
differs (the CUDA C part needs a GPU there), `gpu_only` why, and `diagnosis` what the message must
also say. An edit names text of the solution that must occur exactly once, so a change to the
solution cannot quietly turn a mistake into a no-op.
"""

from __future__ import annotations

from grading.labs.lab02b_matmul import SEVERAL_TILES
from grading.notebooks import SOLUTIONS_DIR
from tests.grader_corpus_lab01 import SolutionCells, Submission, course_module_as

NOTEBOOK = SOLUTIONS_DIR / "02b_matmul_lab.ipynb"
SOLUTION = SolutionCells(NOTEBOOK)
SOLUTION_CELLS, edit, solve_with = SOLUTION.cells, SOLUTION.edit, SOLUTION.solve_with
NEEDS_GPU = {"matmul_cuda": ("needs a GPU", "")}


def fails(function: str, phrase: str) -> dict[str, tuple[str, str]]:
    return {function: ("fail", phrase)}


def cuda_only(phrase: str, why: str, **fields) -> Submission:
    """A mistake in the CUDA C part: it fails on a GPU; CPU mode cannot run CuPy."""
    return Submission(fields.pop("cells"), fails("matmul_cuda", phrase), cpu=NEEDS_GPU,
                      gpu_only=why, **fields)


# The first failing case of each is the first fixed case that shows the mistake (grading/labs/
# lab02b_matmul.py's CASES, in order).
CORPUS: dict[str, Submission] = {
    # ---- Triton: both modes ----------------------------------------------------------------------
    # the K loop stops at the last whole block: K = 1 computes nothing, K = 63 drops 31 columns
    "k_tail_dropped": Submission(
        edit("matmul", "for k0 in range(0, K, BLOCK_K):", "for k0 in range(0, K - K % BLOCK_K, "
             "BLOCK_K):"),
        fails("matmul", "first: 1x1x1 bfloat16: shape 1x1x1: 1 of 1 elements wrong"),
        diagnosis="the last 1 are left out; mask the K tail with zeros",
    ),
    # the running sum rounded to the input dtype after every K step (kept in a float32 variable:
    # the interpreter's 16-bit arithmetic is not the GPU's)
    "fp16_accumulation": Submission(
        edit("matmul", "acc = tl.dot(a, b, acc)",
             "acc = tl.dot(a, b, acc).to(c_ptr.dtype.element_ty).to(tl.float32)"),
        # one K step per case where K fits one block (a GPU's BLOCK_K is 64): rounded once, right
        fails("matmul", "cases fail; first: "),
        cpu=fails("matmul", "first: 37x45x63 bfloat16: "),
        diagnosis="is the running sum kept in 16 bits? Accumulate in float32",
    ),
    # strides taken from the shape, as if both operands were row-major
    "transposed_operand_ignored": Submission(
        edit("matmul", "a.stride(0), a.stride(1), b.stride(0), b.stride(1)", "K, 1, N, 1"),
        fails("matmul", "first: 37x45x63 bfloat16 tn: "),
        diagnosis="a is a transposed view (strides (1, 37)) and was read as if it were row-major",
    ),
    # cuBLAS does the work
    "calls_torch_matmul": Submission(
        solve_with("matmul", "out.copy_(a @ b)"),
        fails("matmul", "computes with PyTorch instead of its own kernel: Tensor.matmul"),
        diagnosis="(aten.mm.default)",
    ),
    # the grid rounds down: the last, partial tile row or column of C is never computed (what a
    # wrong store mask does too, and the CPU's stand-in for the shared-tile race below)
    "grid_rounds_down": Submission(
        edit("matmul", "grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)",
             "grid = (max(1, M // bm) * max(1, N // bn),)"),
        # a GPU's 128-wide tiles cover the small cases in one program; the CPU's 32-wide ones do not
        fails("matmul", f"first: {'x'.join(map(str, SEVERAL_TILES))} bfloat16 nt: "),
        cpu=fails("matmul", "first: 37x45x63 bfloat16: "),
        diagnosis="elements were never written (still NaN)",
    ),
    # the course's Triton kernel, its module loaded again under another name
    "course_kernel_under_another_name": Submission(
        solve_with("matmul", course_module_as("kernels.matmul.triton_matmul", "my_matmul")
                   + "\nmy_matmul.matmul(a, b, out=out)"),
        fails("matmul", "launches the course's kernel instead of its own (write the kernel in "
              "the notebook): kernels.matmul.triton_matmul.matmul_kernel"),
    ),
    # ---- CUDA C: a GPU shows them ----------------------------------------------------------------
    "cuda_missing_syncthreads": cuda_only(
        "cases fail",
        "a race between the threads of a block needs a GPU to run them",
        cells=edit("matmul_cuda", "        __syncthreads();  // both tiles complete before anyone "
                   "reads them\n", ""),
    ),
    "cuda_k_tail_dropped": cuda_only(
        "first: 1x1x1 bfloat16: shape 1x1x1: 1 of 1 elements wrong",
        "CuPy needs a GPU",
        cells=edit("matmul_cuda", "for (int k0 = 0; k0 < K; k0 += BK)",
                   "for (int k0 = 0; k0 + BK <= K; k0 += BK)"),
        diagnosis="the last 1 are left out; mask the K tail with zeros",
    ),
    "cuda_transposed_operand_ignored": cuda_only(
        "first: 37x45x63 bfloat16 tn: ",
        "CuPy needs a GPU",
        cells=edit("matmul_cuda", "(a.stride(0), a.stride(1), b.stride(0), b.stride(1), "
                   "out.stride(0))", "(K, 1, N, 1, N)"),
        diagnosis="a is a transposed view (strides (1, 37)) and was read as if it were row-major",
    ),
    # the kernel is named by the course file that defines it (matmul_tiles.cuh's macro)
    "cuda_calls_the_course_kernel": cuda_only(
        "launches the course's kernel instead of its own (write the kernel in the notebook): "
        "kernels/matmul/matmul_tiles.cuh:matmul_register_",
        "CuPy needs a GPU",
        cells=solve_with("matmul_cuda", "from kernels.matmul import cupy_matmul\n"
                         "cupy_matmul.matmul(a, b, out=out, step='register')"),
    ),
    # the course's CUDA C file, compiled by the student's code: the kernel is still the course's,
    # named by the header whose macro defines it, as above
    "cuda_compiles_the_course_source": cuda_only(
        "launches the course's kernel instead of its own (write the kernel in the notebook): "
        "kernels/matmul/matmul_tiles.cuh:matmul_register_",
        "CuPy needs a GPU",
        cells=solve_with(
            "matmul_cuda",
            "path = cuda.source_path('matmul/matmul_register.cu')\n"
            "module = cuda.module_from_source(path.read_text(), path.parent)\n"
            "kernel = module.get_function(f'matmul_register_{SUFFIX[a.dtype]}')\n"
            "sizes = (M, N, K, *a.stride(), *b.stride(), out.stride(0), 0, 0)\n"
            "cuda.launch(kernel, cuda.cdiv(M, 128) * cuda.cdiv(N, 128), 256, (cuda.pointer(a), "
            "cuda.pointer(b), cuda.pointer(out), *map(np.int32, sizes)), a.device)",
        ),
    ),
    "cuda_calls_cublas": cuda_only(
        "computes with PyTorch instead of its own kernel: torch.matmul",
        "CuPy needs a GPU",
        cells=solve_with("matmul_cuda", "out.copy_(torch.matmul(a, b))"),
        diagnosis="(aten.mm.default)",
    ),
}
