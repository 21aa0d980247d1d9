"""The benchmark harness behind `python -m megamoe bench` (what and how: docs/design.md, "How it is measured")."""
