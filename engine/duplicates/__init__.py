"""The duplicate finder, every piece of it: signatures, their layout, pairs, groups, tiers and review."""
