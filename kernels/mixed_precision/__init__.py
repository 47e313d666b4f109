"""Mixed precision: sums with a chosen accumulator (naive, pairwise, Kahan) and fp8 quantization."""
