"""sluice.observe."""
