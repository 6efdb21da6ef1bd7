"""Training engines, one module each (see training/parallel/__init__.py)."""
