"""Ahead-of-time compiles on a CPU for TPU slices and GPU nodes: targets, memory, FLOPs,
collectives, the roofline, the dry-run report."""
