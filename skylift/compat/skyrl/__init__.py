"""SkyRL on skylift: its keys, registries, SkyRL-Gym environments, dumps, metric names and routes
(see `skylift.compat`)."""
