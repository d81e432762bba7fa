"""Tasks: what a batch's loss is, what a prediction is, and how predictions are scored."""
