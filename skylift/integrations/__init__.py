"""Other projects' environments and rollout servers, adapted to skylift: one folder each.

- `verifiers`: a verifiers env server plays rows of env_class ``verifiers`` (``environment.verifiers``);
- `openenv`: OpenEnv servers as the ``openenv`` environment;
- `tinker_cookbook`: tinker-cookbook ``EnvGroupBuilder`` factories (``tinker-cookbook:module:factory``);
- `mini_swe_agent`: mini-SWE-agent as a harness on the agent gateway (``environment.harness``).

The rule: these modules import skylift's core; the core never imports them (``scripts/import_graph.py``
refuses any such arrow). The core's registries name them and import them by name on first use
(`skylift.envs.registry`, `skylift.generator.plugins`), in the driver and in Ray workers alike.
"""
