"""Real language models: presets by name (conf/model/), hardware presets and the roofline
timing model, fetching weights, offline loading."""
