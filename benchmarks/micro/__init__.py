"""Micro-benchmarks: one operation against a baseline, side by side."""
