"""sluice.router."""
