"""Real vLLM beside hmakv: tiny hybrid models, a server launcher, a fidelity probe."""
