"""dpro-launch: a drop-in for horovodrun that profiles, optimizes and applies (not built yet)."""
