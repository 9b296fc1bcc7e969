"""Records that cross process boundaries: the lowest layer of `nemo_rl`, importing nothing from it."""
