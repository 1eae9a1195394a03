"""sluice.worker."""
