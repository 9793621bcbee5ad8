"""Placeholder until implemented."""
