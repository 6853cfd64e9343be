"""Communication engines (torch-ddp, horovod, ...): each engine's knobs, wiring, cost model and search,
looked up by name."""
