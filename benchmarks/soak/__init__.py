"""Soaks: long runs that check memory and threads stay flat."""
