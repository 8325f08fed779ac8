"""Discrete-event simulator: the engine with a latency model, the policies of the paper's Table 2, metrics."""
