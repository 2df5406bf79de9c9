"""Eviction policies against every baseline: encoder tokens saved on request mixes."""
