"""The base layer all packages share: errors, atomic writes, enums, defaults, stop signals, timing, locks."""
