"""sluice.bench."""
