"""The lab and the cost model: routing traces (recorded and synthetic), the product's slot policy
replayed on them beside reference policies (upstream's among them) and Belady's offline optimum,
measured in bytes moved; `predict` (decode time per mode from a hardware profile), the what-if
plan and `tune`."""
