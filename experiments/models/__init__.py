"""Models of the presets that are not taken ready-made from torchvision or transformers."""
