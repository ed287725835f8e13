"""Data: Ray Data readers, feature specs, synthetic generators."""
