"""Side-by-side quality and speed comparison of GGUF quants (arrives with the MC weights issue)."""
