"""TPU ahead-of-time compiles on a CPU: slices, memory, FLOPs, collectives, the roofline,
the dry-run report."""
