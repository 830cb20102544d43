"""`kvsim advise`: rank codec presets x transfer policies for one setting by simulated
TTKT under a quality floor (kvsim.advise.floor), print the Pareto front (kvsim.advise.pareto)
and one recommendation (kvsim.advise.rank)."""
