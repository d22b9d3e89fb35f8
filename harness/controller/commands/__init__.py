"""What each command does with a world: run, invariance, fuzz, simulate, bisect, repro."""
