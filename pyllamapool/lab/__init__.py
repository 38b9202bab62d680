"""Policy lab: routing traces (recorded and synthetic), the product's slot policy replayed on them,
reference policies and Belady's offline optimum, measured in bytes moved."""
