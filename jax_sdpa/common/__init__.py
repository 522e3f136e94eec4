"""Small helpers every layer may use: warn.py (warnings at the user's line), versions.py (the
JAX version check) and varying.py (shard_map's varying axes)."""
