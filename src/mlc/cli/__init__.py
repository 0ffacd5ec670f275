"""Entry layer: one module per command group; each parses, calls one function below, prints."""
