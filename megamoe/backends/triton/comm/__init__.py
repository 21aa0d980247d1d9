"""Symmetric-memory communication for expert parallelism: the workspace and the row exchanges."""
