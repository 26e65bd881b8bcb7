"""Evaluations: the ICQS study (FPB, SST-2, ChaosNLI), its baselines (ICL, Ask LLM), MT-Bench
glass-box evaluation, model ranking and plots.
"""
