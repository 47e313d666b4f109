"""Known-wrong and adversarial submissions for lab 01, and what the grader must say about each.

Each entry replaces one solution cell of solutions/01_elementwise_add_lab.ipynb (by grade_id) and
lists, per graded function, the status and a phrase of the reason the grader must give.
"""
SOLUTION_ADD_KERNEL_HEADER = '''
BLOCK = runtime.pick(gpu=4096, cpu=8192)


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + offsets, mask=mask)
'''


def add_cell(kernel_tail: str, wrapper_body: str) -> str:
    return SOLUTION_ADD_KERNEL_HEADER + kernel_tail + '''

def add(a, b, out=None):
    check_elementwise("add", {"a": a, "b": b}, out, device_type=runtime.DEVICE)
    out = torch.empty_like(a) if out is None else out
''' + wrapper_body + "\n    return out\n"


CORRECT_STORE = "    tl.store(out_ptr + offsets, (a.to(tl.float32) + b.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)\n"
CORRECT_LAUNCH = "    n = out.numel()\n    if n:\n        add_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)"

CORPUS = {
    # Launches n // BLOCK programs: the last partial block is never written.
    "wrong_on_tail": ("add", add_cell(CORRECT_STORE, CORRECT_LAUNCH.replace("triton.cdiv(n, BLOCK)", "max(n // BLOCK, 1)")),
                      {"add": ("fail", "n=98765: 461 of 98765 elements wrong; first bad index 98304")}),
    "returns_an_input": ("add", add_cell(CORRECT_STORE, "    return a"),
                         {"add": ("fail", "it returned another tensor")}),
    "copies_an_input": ("add", add_cell(CORRECT_STORE, "    out.copy_(a)"),
                        {"add": ("fail", "elements wrong")}),
    "calls_torch_add": ("add", add_cell(CORRECT_STORE, "    torch.add(a, b, out=out)"),
                        {"add": ("fail", "computes with PyTorch ops instead of its own kernel: aten.add")}),
    # Right values, computed by NumPy on the host: no kernel of its own.
    "computes_on_host": ("add", add_cell(CORRECT_STORE, "    out.copy_(torch.from_numpy(a.cpu().numpy() + b.cpu().numpy()))"),
                         {"add": ("fail", "1 float32: launched no Triton kernel")}),
    # Adds in float16 whatever the input: float32 results lose 13 bits.
    "lower_precision": ("add", add_cell(
        "    tl.store(out_ptr + offsets, (a.to(tl.float16) + b.to(tl.float16)).to(out_ptr.dtype.element_ty), mask=mask)\n",
        CORRECT_LAUNCH), {"add": ("fail", "1 float32: n=1: 1 of 1 elements wrong")}),
    "raises": ("add", add_cell(CORRECT_STORE, '    raise RuntimeError("boom")'),
               {"add": ("fail", "RuntimeError: boom")}),
    "mutates_an_input": ("add", add_cell(CORRECT_STORE, CORRECT_LAUNCH + "\n    a.copy_(out)"),
                         {"add": ("fail", "modified its input #1")}),
    "syntax_error": ("add", "def add(a, b, out=None:\n    pass\n",
                     {"add": ("error", "SyntaxError"), "residual_add": ("error", "SyntaxError")}),
    # The other association, accumulated in float32: right to tolerance, wrong bits.
    "residual_wrong_order": ("residual_add", '''
@triton.jit
def residual_add_kernel(x_ptr, attn_ptr, mlp_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    attn = tl.load(attn_ptr + offsets, mask=mask).to(tl.float32)
    mlp = tl.load(mlp_ptr + offsets, mask=mask).to(tl.float32)
    partial = (attn + x).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (mlp + partial).to(out_ptr.dtype.element_ty), mask=mask)


def residual_add(x, attn, mlp, out=None):
    check_elementwise("residual_add", {"x": x, "attn": attn, "mlp": mlp}, out, device_type=runtime.DEVICE)
    out = torch.empty_like(x) if out is None else out
    n = out.numel()
    if n:
        residual_add_kernel[(triton.cdiv(n, BLOCK),)](x, attn, mlp, out, n, BLOCK=BLOCK)
    return out
''', {"residual_add": ("fail", "not bit-identical to PyTorch"), "add": ("pass", "")}),
}
