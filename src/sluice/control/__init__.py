"""sluice.control."""
