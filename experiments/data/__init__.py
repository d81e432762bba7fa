"""Data modules: real on-disk datasets, their fake twins, and the samplers that feed them."""
