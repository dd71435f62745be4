"""The model, plain PyTorch: the encoder with its language-model and classification heads."""
