"""Running and measuring: generated test models, RPC devices, scripted decode and sessions, sweeps,
routing traces, host measurements and the demo."""
