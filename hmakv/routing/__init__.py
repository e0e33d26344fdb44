"""The routing study: what an HMA-aware index buys a fleet, against the peers' policies."""
