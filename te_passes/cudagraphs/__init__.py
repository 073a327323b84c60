"""CUDA graphs for ``mode="reduce-overhead"``: the lean ``CUDAGraphPolicy`` (``policy``), its replay (``lean``), the
capture/replay engine (``engine``) and what a replay does when it would be unsafe (``hazards``). See docs/design.md."""
