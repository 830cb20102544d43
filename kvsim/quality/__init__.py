"""Quality on a real model: KV capture, attention vNMSE, top-1/perplexity, speculative
acceptance, and calibration of the synthetic KV generator."""
