"""Where GPU memory goes.

Profiling helpers, snapshots and timelines, an activation-memory estimator, and a fused linear +
cross-entropy that never materializes the (tokens x vocab) logits."""
