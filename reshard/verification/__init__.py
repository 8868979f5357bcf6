"""Verification: per-tensor digests of canonical views (this package will also hold the forward check)."""
