"""The benchmark harness behind `python -m megamoe bench` (what and how: BENCHMARKS.md)."""
