"""``hmakv bench fleet``: the whole pipeline at fleet scale, each hop beside its ceiling."""
