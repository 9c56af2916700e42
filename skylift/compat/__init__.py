"""Other projects' interfaces to skylift: what lets their command lines, modules and clients run here.

- `skyrl`: SkyRL's key names, refused backends and keys accepted without effect (`skyrl.keys`,
  `skyrl.unused_keys`: the config loader's SkyRL dialect), its registries for custom advantage
  estimators and policy losses (`skyrl.registries`, which users' modules import), SkyRL-Gym
  environments (`skyrl.gym`), its evaluation dump (`skyrl.eval_dump`), its metric names
  (`skyrl.metrics`: ``generate/*``) and vLLM's RL routes as its clients drive them (`skyrl.routes`).

Environments and rollout servers of other projects (verifiers, OpenEnv, tinker-cookbook) are in
``skylift.integrations``.

The rule: this wing imports skylift's core; the core never imports it (``scripts/import_graph.py``
refuses any arrow into ``compat`` or ``integrations`` from outside them). The core reaches it only
by module name, through its registries and hooks, which import the built-in plugins with
importlib on first use (in the driver and in Ray workers alike): `skylift.config.dialects`
(keys), `skylift.envs.registry` (environments), `skylift.generator.metrics.METRICS` (metrics),
`skylift.rl.eval_dumps` (dumps), `skylift.inference.route_plugins` (routes) and
`skylift.generator.plugins` (rollout generators).
"""
