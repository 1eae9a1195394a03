"""sluice.control: where workers run (local processes for now) and how many."""
