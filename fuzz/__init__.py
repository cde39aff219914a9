"""Fuzzing the live API: `python -m fuzz.schemathesis_run` (or `make fuzz`)."""
