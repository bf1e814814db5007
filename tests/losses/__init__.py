"""Tests of rlhflab.losses (a package so test module names stay unique)."""
