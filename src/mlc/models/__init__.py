"""Model layer: architectures (one file each), the model store and weight loading."""
