"""Tracing f into a plan, and what a trace depends on."""
