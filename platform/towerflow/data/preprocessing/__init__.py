"""Preprocessing functions that pipelines name in their specs (applied per batch or per tower)."""
