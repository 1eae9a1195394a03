"""sluice.sim: a discrete-event cluster simulator around sluice's production code.

The router's `Pool` and policies and the engine's `Scheduler` and `BlockManager` run in
virtual time (`loop`); only the forward pass is modelled, as a step time fitted to the
real engine (`profile`, `calibrate`). `cluster.Simulation` wires clients, router,
workers (`worker`) and the planner hook (`planner`); `run` and `cli` are `sluice sim`.
See docs/sim.md.
"""
