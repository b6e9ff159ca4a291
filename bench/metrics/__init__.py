"""Probes every backend is measured with: step timer, peak memory, communication counter, peak FLOP/s."""
