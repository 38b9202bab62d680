"""Building the native tree: the pinned llama.cpp source and its checks, the patch series, the build
driver behind `build.py` and `pip install`, and where the built libraries and tools live."""
