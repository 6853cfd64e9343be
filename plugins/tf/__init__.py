"""dpro plugin for tf (not built yet: see the project's issues)."""
