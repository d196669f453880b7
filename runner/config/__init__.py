"""Pre-flight checks of a composed config, its resolvers, and what a run folder may build (trust)."""
