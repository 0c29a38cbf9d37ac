"""Thin command-line front ends (``coli-kv ...``) over :mod:`kernels` and :mod:`sessionstore`."""
