"""The adversarial suite (issue 11): regression tests for wrong data and local security.

Each test reproduces a bug seen on an earlier main (wrong dataset served, a squatted socket
directory, a truncated file, leaked rings, lying metadata, ...) against a real daemon where the
bug was a daemon's, and asserts contents (pixels, labels), not only ids or counts.
"""
