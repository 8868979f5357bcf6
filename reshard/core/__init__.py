"""Pure index arithmetic: canonical tensors, which ranges each rank of each layout holds, and plans."""
