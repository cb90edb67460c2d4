"""runtime: request state, step types, device-resident token rows, graph-capture helpers (no policy)."""
