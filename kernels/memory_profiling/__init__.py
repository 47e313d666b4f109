"""Where GPU memory goes: profiling helpers, snapshots and timelines, an activation-memory
estimator, and a fused linear + cross-entropy that never materializes the (tokens x vocab)
logits."""
