"""The model side: checkpoint config and loading, the decoder, paged attention, sampling, the runner."""
