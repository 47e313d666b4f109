"""Communication between processes: a ring all-reduce from point-to-point sends and receives,
a data-parallel wrapper that overlaps the gradient all-reduce with the backward pass, an optimizer
that shards its state across ranks, and the alpha-beta cost model that predicts what they cost.

Everything uses `torch.distributed`. `launch.run` starts the processes: the gloo backend with CPU
processes (what CI and a laptop can run), NCCL with one GPU per process where a machine has as many
GPUs as ranks. The algorithms do not know which one they run on.
"""
