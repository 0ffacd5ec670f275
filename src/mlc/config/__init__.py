"""Base layer: configuration schemas, templates, hardware profiles and model store paths."""
