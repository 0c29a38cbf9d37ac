"""Benchmarks, run as modules from the repository root: ``python -m bench.<name> [--quick] [--json]``.

codec, append, attention (``--with-decoder`` adds decoder), session, migrate; each prints its figures
and, with ``--json``, one JSON object as the last line.
"""
