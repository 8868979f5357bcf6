"""Reading and writing tensor files: positioned slice reads and streaming writers."""
