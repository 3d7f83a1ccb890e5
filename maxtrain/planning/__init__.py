"""The layout planner: which mesh, remat policy and micro-batches for a slice, by compiling the
candidates (plan.py; docs/planning.md)."""
