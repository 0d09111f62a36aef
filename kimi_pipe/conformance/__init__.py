"""Conformance: probe batteries, answer checks, profile fitting and serving=auto."""
