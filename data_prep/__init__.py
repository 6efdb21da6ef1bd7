"""Data curation domain: ingest, dedup, language ID, quality filters, PII, mixing, tokenizer, packing.

Plain functions and small classes; never imports prefect.
"""
