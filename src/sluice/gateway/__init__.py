"""sluice.gateway."""
