"""Models and their weights: loaders for safetensors, GGUF and the packaged offline checkpoints."""
