"""The model side: the family registry (one module per family), shared blocks, layers, loader, sampler."""
