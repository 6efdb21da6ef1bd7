"""Model-parallel mesh dimensions, one module each (see training/parallel/__init__.py)."""
