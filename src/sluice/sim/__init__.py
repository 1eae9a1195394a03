"""sluice.sim."""
