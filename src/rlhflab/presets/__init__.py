"""Embedded presets (package data)."""
