"""Prefect flows: one per stage, composed by `flows.pipeline`."""
