"""raggedfn.map: run a per-sample function over a packed batch."""
