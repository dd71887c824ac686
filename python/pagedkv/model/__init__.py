"""The model side: Llama-family decoder over paged attention, layers, loader, sampler, default model."""
