"""whalelike's runtime: executes a Plan under torchrun."""
